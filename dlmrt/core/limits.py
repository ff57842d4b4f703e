"""Resource limits, checked before anything is allocated.

Sizes that drive a loop or an allocation (layers, experts, widths, vocabulary, positions) are bounded
by the MAX_ constants, far above any released model: a config beyond them is refused before a
module is built. Memory is estimated from the config (and the request, for the step loop's buffers)
and refused when it exceeds this machine's memory, or DLMRT_MEMORY_LIMIT_GIB where that is set.
A file dlmrt is given is bounded by its kind (the MAX_..._BYTES below, checked by `dlmrt.core.file_reads`).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from dlmrt.core.errors import ArgumentError, ResourceError

if TYPE_CHECKING:
    import torch

MAX_LAYERS = 1024
MAX_EXPERTS = 4096
MAX_WIDTH = 1 << 17  # hidden and MLP sizes
MAX_HEADS = 1024
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 24
MAX_BATCH = 1 << 16  # rows a graph or backend is built for
MEMORY_LIMIT_VARIABLE = "DLMRT_MEMORY_LIMIT_GIB"
GiB = 2**30
# What the step's tensors hold: thresholds, factors, temperatures and guidance scales are float32;
# a row's seed is int64, and row i of a batch uses seed + i.
FLOAT32_MAX = 3.4028234663852886e38
MAX_SEED = 2**62
# Files, by kind. Configs, manifests, suites and baselines are kilobytes; eval data, prompts files and
# tokenizers (Gemma's tokenizer.json is 33 MB) are read whole and split into lines or parsed; one weights
# file (a safetensors shard, an ONNX graph's data, an engine) is mapped or streamed by its library.
MAX_CONFIG_BYTES = 16 * 2**20
MAX_DATA_BYTES = 256 * 2**20
MAX_WEIGHTS_BYTES = 2**40
# The most alternatives a committed token's log-probability comes with (OpenAI's cap on top_logprobs)
MAX_TOP_LOGPROBS = 20


def recorded_alternatives(vocab_size: int) -> int:
    """The alternatives a step records for each token it commits (a request reads the ones it asked for)."""
    return min(MAX_TOP_LOGPROBS, vocab_size - 1)


def float32_problem(value: float) -> str | None:
    """Why `value` cannot be a float32 step input, or None when it can."""
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if abs(value) > FLOAT32_MAX:
        return f"must fit in float32 (at most {FLOAT32_MAX:.3g} in magnitude), got {value:.3g}"
    return None


def memory_budget(device: str | torch.device) -> tuple[int, str]:
    """(bytes, what they are) that an allocation on `device` may use."""
    import torch

    device = torch.device(device)
    configured = os.environ.get(MEMORY_LIMIT_VARIABLE)
    if configured:
        try:
            limit = float(configured)
        except ValueError:
            limit = -1.0
        if not 0 < limit < 2**40:
            raise ArgumentError(f"{MEMORY_LIMIT_VARIABLE}={configured!r} must be a positive number of GiB")
        return int(limit * GiB), f"{MEMORY_LIMIT_VARIABLE}={configured}"
    if device.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"the memory of {torch.cuda.get_device_name(device)}"
    if device.type == "meta":
        return 1 << 62, "the meta device"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"


def check_fits(needed: int, what: str, device: str | torch.device, hint: str) -> None:
    """Refuse `needed` bytes for `what` on `device` beyond the budget, with `hint` on what to do."""
    budget, of = memory_budget(device)
    if needed > budget:
        raise ResourceError(f"{what} needs {size(needed)}, more than {of} ({size(budget)}): {hint}")


def size(count: int) -> str:
    """A byte count as people read it: 1.5 GiB, 640.0 KiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}"
    return f"{count} bytes"
