"""What a generate call is asked to do: lengths, policy, sampling, cache, stopping."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from dlmrt.core import limits
from dlmrt.core.errors import ArgumentError
from dlmrt.runtime.model_spec import ModelSpec
from dlmrt.runtime.policies import Fixed, Policy, ResidualPolicy, make_policy

CACHE_MODES = ("none", "prefix", "dual")


@dataclass(frozen=True)
class GenerationSettings:
    gen_length: int = 128
    block_length: int = 128
    policy: Policy = field(default_factory=Fixed)
    temperature: float = 0.0
    cfg_scale: float = 0.0
    seed: int = 0
    # none: full recompute each step; prefix: prefix K/V reused within a block (for block-causal
    # models, the exact block cache); dual: prefix and suffix K/V reused, only the block recomputed.
    cache: str = "none"
    # Decode the full length even after end-of-sequence, as the research scripts do.
    ignore_eos: bool = False
    # Cap on the steps of one block; the last allowed step commits whatever is left.
    max_block_steps: int | None = None
    # Steps run back to back on the device before the host reads whether the block is done (K). None
    # is automatic: 1 on a CPU, where a read costs nothing; on CUDA, as many as the tokens per
    # forward seen so far say the block still needs. Steps after a block is done change nothing.
    steps_per_sync: int | None = None
    # Each committed token's log-probability at the step that committed it, with this many of the most
    # likely alternatives (0 to limits.MAX_TOP_LOGPROBS); None computes none (docs/logprobs.md).
    logprobs: int | None = None

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    def block_steps(self) -> int:
        """The most steps a block runs: no block needs more than one per position, and token editing
        its editing-only steps after them."""
        steps = self.policy.block_steps(self)
        steps = steps if self.max_block_steps is None else min(steps, self.max_block_steps)
        # an editing policy's block_steps counts its editing-only steps itself (row_params is not read
        # here: it may read the device, and this runs every block)
        return steps if self.policy.edits else min(steps, self.block_length)

    def validate(self, block_causal: bool = False) -> None:
        """Raise ArgumentError for settings that cannot work. Block-causal models place blocks on
        their absolute grid, so there any gen-length works, except under the fixed policy, whose
        steps are shared out over gen-length / block-length blocks."""
        for name in ("gen_length", "block_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ArgumentError(f"{name.replace('_', '-')} must be an integer, got {value!r}")
            if value <= 0:
                raise ArgumentError(f"{name.replace('_', '-')} must be positive, got {value}")
            if value > limits.MAX_POSITIONS:
                raise ArgumentError(f"{name.replace('_', '-')} must be at most {limits.MAX_POSITIONS}, got {value}")
        if self.gen_length % self.block_length and not (block_causal and not isinstance(self.policy, Fixed)):
            raise ArgumentError(f"gen-length ({self.gen_length}) must be divisible by block-length "
                                f"({self.block_length})")
        if self.max_block_steps is not None and self.max_block_steps <= 0:
            raise ArgumentError(f"the step budget per block must be positive, got {self.max_block_steps}")
        if self.steps_per_sync is not None and self.steps_per_sync <= 0:
            raise ArgumentError(f"steps-per-sync must be positive, got {self.steps_per_sync}")
        if not isinstance(self.policy, Policy):
            raise ArgumentError(f"policy must be a dlmrt.runtime.policies.Policy, got {self.policy!r}")
        self.policy.validate(self)
        for name in ("temperature", "cfg_scale"):
            value = getattr(self, name)
            problem = limits.float32_problem(value) if isinstance(value, (int, float)) else "must be a number"
            if problem or not value >= 0:
                raise ArgumentError(f"{name.replace('_', '-')} {problem or f'must be >= 0, got {value}'}")
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed <= limits.MAX_SEED):
            raise ArgumentError(f"seed must be an integer in [0, 2**62], got {str(self.seed)[:30]}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                              and 0 <= self.logprobs <= limits.MAX_TOP_LOGPROBS):
            raise ArgumentError(f"logprobs must be an integer in [0, {limits.MAX_TOP_LOGPROBS}] (the alternatives a "
                                f"token comes with), or None for none; got {self.logprobs!r}")
        if self.cache not in CACHE_MODES:
            raise ArgumentError(f"cache must be one of {', '.join(CACHE_MODES)}, got {self.cache!r}")


def check_request(spec: ModelSpec, prompts: Sequence[Sequence[int]], settings: GenerationSettings) -> None:
    """Every check that can fail, before any compute."""
    settings.validate(spec.block_causal)
    if settings.policy.noise != spec.noise:
        if spec.noise == "uniform":
            raise ArgumentError(f"policy {settings.policy.name!r} is mask-based, but {spec.name} is a uniform-noise "
                                f"model (no mask token: its canvas starts as random tokens): use --policy "
                                f"entropy_bound")
        raise ArgumentError(f"policy {settings.policy.name!r} decodes uniform-noise models (DiffusionGemma), but "
                            f"{spec.name} is mask-based: use --policy threshold, factor or fixed")
    if settings.logprobs is not None:
        _check_logprobs(spec, settings)
    if spec.noise == "uniform" and settings.cache == "dual":
        raise ArgumentError(f"cache mode 'dual' does not apply to {spec.name}: its decoder reads the encoder's "
                            f"cache of everything before the canvas, and nothing after it")
    if settings.cache == "dual" and spec.block_causal:
        raise ArgumentError(f"cache mode 'dual' does not apply to {spec.name}: it is block-causal, so no "
                            f"block sees what follows it and there is no suffix to cache; --cache prefix "
                            f"is already its exact block cache")
    if isinstance(settings.policy, ResidualPolicy) and not spec.has_residual:
        raise ArgumentError(f"policy 'residual' needs an ORL model (a residual_context entry in "
                            f"config.json); {spec.name} has none: use --policy threshold or factor")
    if settings.policy.edits and not spec.supports_editing:
        raise ArgumentError(f"{spec.name} was exported before token editing (its dlmrt::ParallelUnmask is v1): "
                            f"re-export it with this dlmrt (`dlmrt export`) for the llada21 policy's editing, or "
                            f"turn editing off (--editing-threshold 1)")
    if settings.cfg_scale > 0 and not spec.supports_guidance:
        raise ArgumentError(f"{spec.name} was exported without the guidance graphs: re-export with "
                            f"`dlmrt export --guidance` for --cfg-scale, or use the torch backend")
    if spec.block_grid is not None and spec.block_causal and settings.block_length != spec.block_grid:
        raise ArgumentError(f"{spec.name} was exported for blocks of {spec.block_grid} (its block-causal "
                            f"attention is built in): generate with block-length {spec.block_grid}, or "
                            f"re-export with --block-length {settings.block_length}")
    if not prompts:
        raise ArgumentError("no prompt given")
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ArgumentError(f"prompt {row} is empty")
        bad = [t for t in prompt if not 0 <= t < spec.vocab_size]
        if bad:
            raise ArgumentError(f"prompt {row} has token ids outside the vocabulary [0, "
                                f"{spec.vocab_size}): {bad[:5]}")
        if spec.mask_id in prompt:
            raise ArgumentError(f"prompt {row} contains the mask token id {spec.mask_id} "
                                f"(at position {list(prompt).index(spec.mask_id)})")
        needed = len(prompt) + settings.gen_length
        if spec.block_causal:  # denoising runs to the end of the last block
            needed = -(-needed // settings.block_length) * settings.block_length
        if needed > spec.max_positions:
            hint = f": {spec.limits_hint}" if spec.limits_hint else ""
            raise ArgumentError(f"prompt {row} ({len(prompt)} tokens) + gen-length ({settings.gen_length}) "
                                f"needs {needed} positions, more than the model's context of "
                                f"{spec.max_positions}{hint}")


def _check_logprobs(spec: ModelSpec, settings: GenerationSettings) -> None:
    if spec.noise == "uniform":
        raise ArgumentError(f"logprobs: policy {settings.policy.name!r} commits no token at a step of its own: each "
                            f"step resamples the whole block and refills it with random tokens, and the block's "
                            f"tokens are its last argmax, so no step's probability is a token's; ask for logprobs of "
                            f"a mask-based model")
    if not spec.supports_logprobs:
        raise ArgumentError(f"logprobs: {spec.name} was exported before the step graph returned its logits: "
                            f"re-export it with this dlmrt (`dlmrt export`) for logprobs, or use the torch backend")


def lengths_with_defaults(model, gen_length: int | None, block_length: int | None) -> tuple[int, int]:
    """Generation and block length, with defaults from the model's generation_config. A model trained for
    one generation length alone (the tiny models' `trained_gen_length`) gets a warning at any other."""
    if gen_length is None:
        gen_length = model.generation_config.get("gen_length", 128)
    trained = model.generation_config.get("trained_gen_length")
    if trained is not None and gen_length != trained:
        warnings.warn(f"{model.name} was trained to generate exactly {trained} tokens: at gen-length {gen_length} "
                      f"it answers nonsense. Use --gen-length {trained} (or leave it out)", stacklevel=2)
    if block_length is None:
        default_block = model.generation_config.get("block_length", model.default_block_length or gen_length)
        fits = model.block_causal or gen_length % default_block == 0  # block-causal: any length on its grid
        block_length = default_block if default_block > 0 and fits else gen_length
    return gen_length, block_length


def settings_with_defaults(model, *, gen_length, block_length, policy, steps, remasking, threshold, factor,
                           confidence, minimal_topk, editing_threshold, max_post_steps, preset, entropy_bound,
                           cache, max_block_steps, temperature, cfg_scale, seed, steps_per_sync,
                           ignore_eos=False) -> GenerationSettings:
    """GenerationSettings from decoding options (the CLI's, or a served request's fields), where None
    takes the model's default (its generation_config.json, else its family's)."""
    gen_length, block_length = lengths_with_defaults(model, gen_length, block_length)
    if policy is None:
        policy = "entropy_bound" if model.noise == "uniform" else "llada2" if model.block_causal else "fixed"
    chosen = make_policy(policy, steps=steps, remasking=remasking, threshold=threshold, factor=factor,
                         confidence=confidence, minimal_topk=minimal_topk, editing_threshold=editing_threshold,
                         max_post_steps=max_post_steps, preset=preset, entropy_bound=entropy_bound,
                         generation_config=model.generation_config)
    return GenerationSettings(gen_length=gen_length, block_length=block_length, policy=chosen,
                              temperature=temperature, cfg_scale=cfg_scale, seed=seed, cache=cache,
                              ignore_eos=ignore_eos, max_block_steps=max_block_steps,
                              steps_per_sync=steps_per_sync)
