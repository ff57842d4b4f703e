"""Shape buckets: the shapes of a bucket's static state, and the ladder of buckets a backend runs.

A bucket is a batch size and a canvas length (whole blocks) for one block length; a request is padded
up to its bucket (`dlmrt.runtime.device_state` says why padding is inert). The ladder has batches of
1, 2, 4, 8, ... rows up to the largest, and canvases of whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlmrt.core.errors import ArgumentError


@dataclass(frozen=True)
class Bucket:
    """The shapes of one state, for either noise kind. A mask model's bucket is a batch and a canvas
    of whole blocks. A uniform-noise model's canvas is its prompt region (`prompt`) followed by its
    blocks, and it has room for a temperature schedule (`schedule`)."""

    batch: int  # rows, padded rows included
    canvas: int  # positions, padding included
    block: int  # block length (uniform noise: W, the positions a step denoises)
    guided: bool = False  # classifier-free guidance: the model runs 2 * batch rows
    cached: bool = False  # the state holds K/V storage (cache prefix or dual)
    noise: str = "mask"  # Denoiser.noise
    prompt: int = 0  # uniform noise: P, the prompt region (left padding included)
    schedule: int = 0  # uniform noise: the temperature schedule's room (the most steps a block takes)

    @property
    def model_rows(self) -> int:
        return self.batch * (2 if self.guided else 1)

    @property
    def blocks(self) -> int:
        """Uniform noise: the blocks after the prompt region."""
        return (self.canvas - self.prompt) // self.block

    @property
    def storage(self) -> int:
        """Uniform noise: S, the cache positions (the last block is never committed)."""
        return self.canvas - self.block

    def slot(self, block: int) -> int:
        """Uniform noise: the storage index where block `block`'s committed tokens start."""
        return self.prompt + block * self.block

    @staticmethod
    def schedule_room(steps: int) -> int:
        """The schedule length of a bucket for blocks of at most `steps` steps: a power of two of at
        least 64, so that runs with different step counts share a bucket."""
        return max(64, 1 << (steps - 1).bit_length())


@dataclass(frozen=True)
class BucketLadder:
    """Which buckets a backend runs: the batch sizes, and the canvas lengths up to a limit.

    batch_sizes: the batch buckets (default: 1, 2, 4, ... up to `max_batch`).
    canvas_lengths: the canvas buckets (default: every whole number of blocks up to `max_canvas`);
    a request takes the smallest that is a whole number of its blocks and holds its canvas.
    """

    max_batch: int
    max_canvas: int
    batch_sizes: tuple[int, ...] | None = None
    canvas_lengths: tuple[int, ...] | None = None
    batch_hint: str = ""  # how to raise each limit, for error messages
    canvas_hint: str = ""

    def __post_init__(self):
        if self.max_batch <= 0 or self.max_canvas <= 0:
            raise ArgumentError(f"the largest bucket must be positive, got batch {self.max_batch} and canvas "
                                f"{self.max_canvas}")
        for name in ("batch_sizes", "canvas_lengths"):
            sizes = getattr(self, name)
            if sizes is not None and (not sizes or min(sizes) <= 0):
                raise ArgumentError(f"{name.replace('_', ' ')} must be positive sizes, got {list(sizes)}")

    def batches(self) -> list[int]:
        if self.batch_sizes is not None:
            return sorted(set(self.batch_sizes))
        sizes, size = [], 1
        while size < self.max_batch:
            sizes.append(size)
            size *= 2
        return [*sizes, self.max_batch]

    def batch_for(self, rows: int) -> int:
        fitting = [size for size in self.batches() if size >= rows]
        if not fitting:
            largest = self.batches()[-1]
            raise ArgumentError(f"{rows} prompts exceed the batch limit of {largest}: "
                                f"{self.batch_hint or 'split the batch'}")
        return fitting[0]

    def canvas_for(self, length: int, block: int) -> int:
        """The canvas bucket of a canvas of `length` positions (a whole number of blocks, or the length
        itself when no bucket holds it)."""
        if length > self.max_canvas:
            raise ArgumentError(f"the batch needs a canvas of {length} positions, more than the largest of "
                                f"{self.max_canvas}: {self.canvas_hint or 'shorten the prompts or gen-length'}")
        if self.canvas_lengths is None:
            candidates = [-(-length // block) * block]
        else:
            candidates = sorted(c for c in self.canvas_lengths if c >= length and c % block == 0)
        fitting = [c for c in candidates if c <= self.max_canvas]
        return fitting[0] if fitting else length
