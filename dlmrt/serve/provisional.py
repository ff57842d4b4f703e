"""A stream's provisional view of the block being decoded (`"stream_provisional": true`).

    view = ProvisionalView(decode, most=16)
    shown = view.show(progress, committed)   # a Provisional, or None when nothing changed
    chunk = {**chunk, **shown.extension()}   # {"dlmrt": {"provisional": {"block", "token_ids", "text"}}}

A snapshot is the current block's tokens as its steps have committed them so far (the runtime's
`BlockProgress`, read at a K-step boundary): from the block's first output position up to the first
end-of-sequence committed, cut at the most tokens the request asked for, `null` where a position is
still masked. Its text shows each masked position as MASK_PLACEHOLDER. The block's committed chunk is
what counts: once the block's steps are over, its last snapshot holds the block's committed tokens.
Semantics and guarantees: docs/streaming.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from dlmrt.runtime.running_batch import BlockProgress

MASK_PLACEHOLDER = "\u2591"  # LIGHT SHADE, one per masked position: display only, token_ids are exact


@dataclass(frozen=True)
class Provisional:
    block: int  # the request's block, counted from 0
    token_ids: list[int | None]
    text: str

    def extension(self) -> dict:
        """The chunk's dlmrt extension object: a field OpenAI's clients keep as an unknown extra."""
        return {"dlmrt": {"provisional": {"block": self.block, "token_ids": self.token_ids, "text": self.text}}}


class ProvisionalView:
    """One stream's snapshots, each sent only when it differs from the one before."""

    def __init__(self, decode: Callable[[list[int]], str], most: int):
        self.decode, self.most = decode, most
        self.last: tuple[int, list[int | None]] | None = None

    def show(self, progress: BlockProgress, committed: list[int]) -> Provisional | None:
        """The snapshot of `progress` after the completion's `committed` ids, or None when unchanged."""
        tokens = progress.token_ids[:max(0, self.most - len(committed))]
        if (progress.block, tokens) == self.last:
            return None
        self.last = progress.block, tokens
        return Provisional(progress.block, tokens, provisional_text(self.decode, committed, tokens))


def provisional_text(decode: Callable[[list[int]], str], committed: list[int], tokens: list[int | None]) -> str:
    """The text `tokens` add after `committed`, a placeholder for each masked (None) position. The
    leading run is decoded after the committed ids, as the committed chunk's text is, so a snapshot with
    no mask left reads as that chunk; later runs are decoded on their own."""
    before, parts = decode(committed), []
    for masked, group in itertools.groupby(tokens, key=lambda token: token is None):
        run = list(group)
        if masked:
            parts.append(MASK_PLACEHOLDER * len(run))
        elif not parts:
            parts.append(decode(committed + run)[len(before):])
        else:
            parts.append(decode(run))
    return "".join(parts)
