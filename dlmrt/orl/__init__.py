"""ORL (on-policy residual learning) at small scale: train a denoiser's residual pathway on the
states its own decoding visits.

- `rollout`: decode with dlmrt's step loop and record each step's input state as the step consumed it;
- `objective`: cross-entropy on the masked positions plus the adjacent-entropy-contraction term;
- `trainer`: the on-policy loop (rollouts, then updates), seeded, checkpointed atomically, resumable.

`scripts/train_orl.py` runs it; the method and its choices are in docs/orl.md.
"""
