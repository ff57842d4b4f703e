"""The on-policy training loop of ORL, of its control, and of the base's further training.

Each iteration draws `prompts` training prompts, rolls the current model out under the rollout
policy (`dlmrt.orl.rollout`), keeps the verified rows' states, and takes `updates` optimizer steps on
minibatches of those states (`dlmrt.orl.objective`). The ORL run starts from the base checkpoint with
the residual adapter added (its output layer at zero, so the model starts as exactly the base); the
control runs the same loop on the base architecture. The third method, `further`, is the base trained
on for the same number of updates with its own objective (`dlmrt.orl.supervised`), on fresh batches
of training examples and no rollouts: what the same updates buy without on-policy data. Everything
random is seeded (prompt draws, minibatches, the adapter's initial weights), so a run is
reproducible on the same machine.

After each iteration the model is saved with its training state (`training_state.safetensors` and
`training_state.json`: optimizer, scheduler, random generators, history) in one atomic write, so an
interrupted run leaves the last complete iteration loadable, and `resume` continues it as if it had
not stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from dlmrt.core import file_reads, hashing, json_files, limits, tasks
from dlmrt.core.errors import ArgumentError, CheckpointError
from dlmrt.eval.evaluation import parse_setting
from dlmrt import models
from dlmrt.models import checkpoint
from dlmrt.models import Denoiser
from dlmrt.models import residual as residual_context
from dlmrt.orl import supervised
from dlmrt.orl.objective import orl_loss
from dlmrt.orl.rollout import rollout
from dlmrt.runtime import GenerationSettings

STATE_TENSORS = "training_state.safetensors"
STATE_JSON = "training_state.json"
STATE_FORMAT = 1
METHODS = {"orl": "on-policy, with the residual pathway", "control": "on-policy, the base architecture",
           "further": "the base's own objective, the base architecture"}


@dataclass(frozen=True)
class TrainingConfig:
    method: str = "orl"  # a key of METHODS
    adapter: str = "mlp"
    adapter_hidden_size: int | None = None
    iterations: int = 30
    prompts: int = 512  # rolled out per iteration
    updates: int = 100  # optimizer steps per iteration
    batch_size: int = 128  # states per optimizer step
    rollout_batch: int = 128
    lr: float = 3e-4
    adapter_lr: float | None = None  # ORL only: the residual adapter's own rate (None: `lr`)
    warmup: int = 100  # optimizer steps
    weight_decay: float = 0.0
    rho: float = 0.25
    aec_weight: float = 0.1
    policy: str = "threshold:threshold=0.5"  # the rollout policy, as `dlmrt eval` writes a setting
    tasks: tuple[str, ...] = tuple(tasks.TASKS)
    gen_length: int = 16
    block_length: int = 8
    seed: int = 0

    @property
    def residual(self) -> bool:
        return self.method == "orl"

    def check(self) -> None:
        """One clear error for a setting that cannot work, before anything is loaded."""
        if self.method not in METHODS:
            raise ArgumentError(f"method {self.method!r} is not one of {', '.join(METHODS)}")
        tasks.check_canvas(self.tasks, self.gen_length)
        if self.residual and self.adapter not in residual_context.ADAPTERS:
            raise ArgumentError(f"adapter {self.adapter!r} is not registered (registered: "
                                f"{', '.join(sorted(residual_context.ADAPTERS))})")
        for name in ("iterations", "prompts", "updates", "batch_size", "rollout_batch", "gen_length",
                     "block_length"):
            if getattr(self, name) <= 0:
                raise ArgumentError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.adapter_lr is not None and not (self.residual and self.adapter_lr > 0):
            raise ArgumentError(f"adapter-lr is the residual adapter's learning rate: it must be positive and "
                                f"needs --method orl; got {self.adapter_lr} with method {self.method}")
        if not self.lr > 0 or not 0 <= self.rho < 1 or not self.aec_weight >= 0:
            raise ArgumentError(f"need lr > 0, 0 <= rho < 1 and aec-weight >= 0; got lr {self.lr}, rho {self.rho}, "
                                f"aec-weight {self.aec_weight}")
        self.settings().validate()

    def settings(self) -> GenerationSettings:
        return GenerationSettings(gen_length=self.gen_length, block_length=self.block_length,
                                  policy=parse_setting(self.policy).policy)


@dataclass(frozen=True)
class IterationRecord:
    iteration: int
    rollout_exact_match: float | None  # of the prompts rolled out, before this iteration's updates (None: `further`)
    rollout_tpf: float | None
    states: int  # verified states trained on (`further`: training rows)
    loss: float | None  # means over the iteration's updates; None where there was nothing to train on
    cross_entropy: float | None  # (None, not NaN: the training state is strict JSON)
    contraction: float | None


def start_model(base: Path, config: TrainingConfig) -> Denoiser:
    """The model a run starts from: the base checkpoint, with the residual adapter added for ORL."""
    model = checkpoint.load(base)
    family = models.family_of(model.raw_config, str(base / "config.json"))
    if model.residual_config is not None:
        raise ArgumentError(f"{base} already has a residual pathway (residual_context in config.json): ORL "
                            f"training starts from a base checkpoint; to continue an ORL run, resume it")
    if not config.residual:
        return model
    if not family.model_class.supports_residual_context:
        raise ArgumentError(f"{base}: the {family.model_type} family has no residual pathway, so ORL cannot "
                            f"train it (families with one: {', '.join(residual_families())}); train the "
                            f"control (--method control) or choose another base")
    raw = {**model.raw_config, "residual_context": {"adapter": config.adapter,
                                                    "adapter_hidden_size": config.adapter_hidden_size, "topk": 0}}
    orl = models.create(raw, tokens=model.tokens, seed=config.seed)
    missing, unexpected = orl.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("residual_adapter" in name for name in missing), (missing, unexpected)
    orl.tokenizer, orl.generation_config = model.tokenizer, model.generation_config
    return orl


def residual_families() -> list[str]:
    return [name for name, f in models.FAMILIES.items() if f.model_class.supports_residual_context]


class Run:
    """One training run: the model, its optimizer and generators, and where it is saved."""

    def __init__(self, model: Denoiser, config: TrainingConfig, out: Path, base_sha256: str):
        self.model, self.config, self.out = model, config, out
        self.base_sha256 = base_sha256  # of the base checkpoint's weights, for the report
        model.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(_parameter_groups(model, config), lr=config.lr, betas=(0.9, 0.98),
                                           weight_decay=config.weight_decay)
        total = config.iterations * config.updates
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: _lr_scale(step, config.warmup,
                                                                                                   total))
        self.prompt_rng = random.Random(config.seed)
        self.batch_generator = torch.Generator().manual_seed(config.seed)
        self.history: list[IterationRecord] = []

    @classmethod
    def start(cls, base: Path, config: TrainingConfig, out: Path) -> Run:
        config.check()
        model = start_model(base, config)
        tasks.check_canvas(config.tasks, config.gen_length, model.max_positions)
        return cls(model, config, out, weights_sha256(base))

    @classmethod
    def resume(cls, out: Path, config: TrainingConfig) -> Run:
        """Continue the run saved in `out`; `config` must be the run's own (only `iterations` may grow)."""
        state, tensors = _read_state(out)
        saved = _config_from(state["config"], out)
        differ = [f.name for f in fields(TrainingConfig)
                  if f.name != "iterations" and getattr(saved, f.name) != getattr(config, f.name)]
        if differ:
            listed = ", ".join(f"{n} (saved {getattr(saved, n)!r}, given {getattr(config, n)!r})" for n in differ)
            raise ArgumentError(f"--resume continues the run in {out} with its own settings, but these differ: "
                                f"{listed}; give the same options, or start a new run in another directory")
        config.check()
        run = cls(checkpoint.load(out), config, out, str(state.get("base_weights_sha256")))
        if (run.model.residual_config is not None) != config.residual:
            raise CheckpointError(f"{out}: the checkpoint's residual pathway does not match its training state; "
                                  f"the directory is inconsistent: start a new run")
        try:
            run.optimizer.load_state_dict(_optimizer_state(state["optimizer"], tensors))
            run.scheduler.load_state_dict(state["scheduler"])
            run.batch_generator.set_state(tensors["batch_generator"])
            version, internal, gauss = state["prompt_rng"]
            run.prompt_rng.setstate((version, tuple(internal), gauss))
            run.history = [IterationRecord(**record) for record in state["history"]]
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"{out / STATE_JSON}: the training state is corrupt ({type(error).__name__}: "
                                  f"{str(error)[:200]}); start a new run") from None
        return run

    @property
    def iteration(self) -> int:
        return len(self.history)

    def train(self, on_update: Callable[[], None] | None = None,
              on_iteration: Callable[[IterationRecord], None] | None = None) -> list[IterationRecord]:
        config = self.config
        while self.iteration < config.iterations:
            record = self._iteration(on_update)
            self.history.append(record)
            self.save()
            if on_iteration is not None:
                on_iteration(record)
        self.model.eval().requires_grad_(False)
        return self.history

    def _iteration(self, on_update: Callable[[], None] | None) -> IterationRecord:
        if self.config.method == "further":
            return self._supervised_iteration(on_update)
        config = self.config
        examples = [tasks.sample(self.prompt_rng.choice(config.tasks), "train", self.prompt_rng)
                    for _ in range(config.prompts)]
        result = rollout(self.model, examples, config.settings(), batch=config.rollout_batch)
        states = result.states
        sums = [0.0, 0.0, 0.0]
        self.model.train()
        for _ in range(config.updates):
            if len(states):
                index = torch.randint(len(states), (config.batch_size,), generator=self.batch_generator)
                loss = orl_loss(self.model, states.select(index), rho=config.rho, aec_weight=config.aec_weight)
                self._step(loss.total)
                for i, part in enumerate(loss):
                    sums[i] += part.item()
            self.scheduler.step()
            if on_update is not None:
                on_update()
        means = [s / config.updates for s in sums] if len(states) else [None] * 3
        return IterationRecord(self.iteration, result.exact_match, result.tpf, len(states), *means)

    def _supervised_iteration(self, on_update: Callable[[], None] | None) -> IterationRecord:
        config = self.config
        total = 0.0
        self.model.train()
        for _ in range(config.updates):
            batch = supervised.masked_batch(self.prompt_rng, self.model.tokenizer, config.batch_size,
                                            self.batch_generator, config.tasks, config.gen_length,
                                            config.block_length)
            loss = supervised.masked_loss(self.model, batch)
            self._step(loss)
            total += loss.item()
            self.scheduler.step()
            if on_update is not None:
                on_update()
        mean = total / config.updates
        return IterationRecord(self.iteration, None, None, config.updates * config.batch_size, mean, mean, None)

    def _step(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()

    def save(self, *, with_state: bool = True) -> None:
        """The model and (unless `with_state` is False) its training state, in one atomic write."""
        files = {}
        if with_state:
            optimizer, tensors = _flatten_optimizer(self.optimizer.state_dict())
            tensors["batch_generator"] = self.batch_generator.get_state()
            version, internal, gauss = self.prompt_rng.getstate()
            state = {"format": STATE_FORMAT, "config": asdict(self.config), "base_weights_sha256": self.base_sha256,
                     "optimizer": optimizer,
                     "scheduler": self.scheduler.state_dict(), "prompt_rng": [version, list(internal), gauss],
                     "history": [asdict(r) for r in self.history]}
            files[STATE_TENSORS] = save_tensors(tensors)
            files[STATE_JSON] = (json.dumps(state) + "\n").encode()
        was_training = self.model.training
        checkpoint.save(self.model.eval(), self.out, extra_files=files)
        self.model.train(was_training)


def _parameter_groups(model: Denoiser, config: TrainingConfig) -> list[dict[str, Any]]:
    """One group at `lr`, and with `adapter_lr` the adapter's weights in a group of their own: the
    adapter starts at zero, and a rate that keeps the base's quality may leave it there."""
    if config.adapter_lr is None:
        return [{"params": list(model.parameters())}]
    adapter = {id(p) for p in model.residual_adapter().parameters()}
    return [{"params": [p for p in model.parameters() if id(p) not in adapter]},
            {"params": list(model.residual_adapter().parameters()), "lr": config.adapter_lr}]


def weights_sha256(root: Path) -> str:
    """One hash of a checkpoint's weight files (sha256 of their sha256s, in name order)."""
    files = sorted(set(checkpoint.tensor_files(root).values()))
    if len(files) == 1:
        return hashing.sha256_of(files[0])
    return hashlib.sha256("".join(hashing.sha256_of(f) for f in files).encode()).hexdigest()


def _lr_scale(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _flatten_optimizer(state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """The optimizer's state dict as JSON-able structure plus named tensors (safetensors, not pickle)."""
    tensors, per_param = {}, {}
    for index, values in state["state"].items():
        per_param[str(index)] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value.contiguous()
                per_param[str(index)][key] = None
            else:
                per_param[str(index)][key] = value
    return {"state": per_param, "param_groups": state["param_groups"]}, tensors


def _optimizer_state(flat: dict, tensors: dict[str, torch.Tensor]) -> dict:
    state = {int(index): {key: tensors[f"optimizer.{index}.{key}"] if value is None else value
                          for key, value in values.items()}
             for index, values in flat["state"].items()}
    return {"state": state, "param_groups": flat["param_groups"]}


def _read_state(out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    json_path, tensor_path = out / STATE_JSON, out / STATE_TENSORS
    if not json_path.is_file() or not tensor_path.is_file():
        raise CheckpointError(f"{out} holds no training state ({STATE_JSON} and {STATE_TENSORS}): it is not a run "
                              f"that train_orl.py saved, or it is the final model of a finished run; start a new run")
    state = json_files.read(json_path, CheckpointError)
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{json_path}: not a training state of format {STATE_FORMAT}; start a new run")
    try:
        tensors = load_tensors(file_reads.read_bytes(tensor_path, CheckpointError, most=limits.MAX_WEIGHTS_BYTES,
                                                     what="a training state"))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{tensor_path}: not a valid safetensors file, it may be truncated or corrupt "
                              f"({error}); start a new run") from None
    return state, tensors


def _config_from(raw: object, out: Path) -> TrainingConfig:
    if not isinstance(raw, dict) or set(raw) != {f.name for f in fields(TrainingConfig)}:
        raise CheckpointError(f"{out / STATE_JSON}: its 'config' is not a training config of this dlmrt; "
                              f"start a new run")
    return replace(TrainingConfig(), **{**raw, "tasks": tuple(raw["tasks"])})
