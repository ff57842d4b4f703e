"""What a generate call cost: forwards, tokens, time."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GenerationMetrics:
    nfe: int  # denoiser forwards (a classifier-free-guidance pair runs as one batched forward)
    generated_tokens: int  # positions committed by the loop, over all rows; prompts never count
    prompt_tokens: int  # unpadded prompt tokens, over all rows
    batch_size: int
    latency_s: float  # wall time of the whole call

    @property
    def tpf(self) -> float:
        """Tokens per forward, per sequence: generated tokens / (forwards x rows)."""
        return self.generated_tokens / max(1, self.nfe * self.batch_size)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.latency_s if self.latency_s > 0 else float("inf")

    def to_dict(self) -> dict[str, float | int]:
        return {**asdict(self), "tpf": self.tpf, "tokens_per_s": self.tokens_per_s}
