"""What a generate call cost: forwards, tokens, time on the backend and on the host, memory.

One dataclass serves a single request (one row) and a whole call or evaluation
(aggregated with `combine`); it prints as a rich table and serializes to JSON.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class GenerationMetrics:
    nfe: int  # forwards that did work, including those that refresh a cache (a guided pair is one)
    sequence_forwards: int  # forwards summed over rows: each row counts the forwards it took part in
    generated_tokens: int  # positions the model committed in the requested outputs; prompts never count
    prompt_tokens: int  # unpadded prompt tokens
    batch_size: int
    latency_s: float  # wall time, less the time spent compiling or capturing (`compile_s`)
    backend_s: float = 0.0  # time running steps on the backend (the rest is host-side loop overhead)
    peak_memory_bytes: int = 0  # device peak allocation on CUDA; the process's peak RSS on a CPU
    # Forwards run, no-op steps after a block was done included: K steps per host read may run more
    # than `nfe`, and the difference is what a large K costs.
    forwards_executed: int = 0
    compile_s: float = 0.0  # compiling or capturing step graphs (first use of a bucket), apart from latency_s
    edits: int = 0  # committed tokens that token editing overwrote (LLaDA2.1's llada21 policy)

    @property
    def tpf(self) -> float:
        """Tokens per forward, per sequence."""
        return self.generated_tokens / max(1, self.sequence_forwards)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.latency_s if self.latency_s > 0 else float("inf")

    @property
    def host_s(self) -> float:
        return max(0.0, self.latency_s - self.backend_s)

    @property
    def host_fraction(self) -> float:
        return self.host_s / self.latency_s if self.latency_s > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {**asdict(self), "tpf": self.tpf, "tokens_per_s": self.tokens_per_s,
                "host_s": self.host_s, "host_fraction": self.host_fraction}

    @staticmethod
    def combine(parts: Sequence[GenerationMetrics]) -> GenerationMetrics:
        """Metrics of calls run one after another."""
        return GenerationMetrics(
            nfe=sum(p.nfe for p in parts), sequence_forwards=sum(p.sequence_forwards for p in parts),
            generated_tokens=sum(p.generated_tokens for p in parts),
            prompt_tokens=sum(p.prompt_tokens for p in parts), batch_size=sum(p.batch_size for p in parts),
            latency_s=sum(p.latency_s for p in parts), backend_s=sum(p.backend_s for p in parts),
            peak_memory_bytes=max((p.peak_memory_bytes for p in parts), default=0),
            forwards_executed=sum(p.forwards_executed for p in parts), compile_s=sum(p.compile_s for p in parts),
            edits=sum(p.edits for p in parts))

    def table(self, title: str = "generation metrics"):
        from rich.table import Table

        table = Table(title=title, show_header=True)
        table.add_column("metric")
        table.add_column("value", justify="right")
        rows = [
            ("forwards (NFE)", f"{self.nfe}"), ("forwards executed", f"{self.forwards_executed}"),
            ("generated tokens", f"{self.generated_tokens}"), ("tokens edited", f"{self.edits}"),
            ("prompt tokens", f"{self.prompt_tokens}"), ("batch", f"{self.batch_size}"),
            ("tokens per forward", f"{self.tpf:.2f}"), ("tokens/s", f"{self.tokens_per_s:.1f}"),
            ("latency", f"{self.latency_s * 1e3:.1f} ms"), ("backend", f"{self.backend_s * 1e3:.1f} ms"),
            ("host overhead", f"{self.host_s * 1e3:.1f} ms ({self.host_fraction:.1%})"),
            ("peak memory", f"{self.peak_memory_bytes / 2**20:.1f} MiB"),
            ("compile / capture", f"{self.compile_s:.1f} s"),
        ]
        for name, value in rows:
            table.add_row(name, value)
        return table


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
