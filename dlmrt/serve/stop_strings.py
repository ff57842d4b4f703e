"""OpenAI's `stop` on a completion that arrives a block at a time.

    scan = StopScan(["\\n\\n", "END"])
    piece, stopped = scan.release(text_so_far, done=False)   # what may be sent now

The text returned ends before the first occurrence of any stop string, which is not returned. Text
once sent cannot be taken back, so while blocks arrive the last max(len(stop)) - 1 characters wait:
they may begin a stop string that a later block completes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence


class StopScan:
    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.held = max((len(stop) for stop in self.stops), default=1) - 1
        self.sent = 0  # characters of the completion released so far

    def release(self, text: str, done: bool) -> tuple[str, bool]:
        """(the part of `text`, the whole completion so far, that may be sent now; whether a stop string
        ended it). `done`: no text will follow, so nothing waits."""
        # a stop string cannot begin before `sent`: it would have ended inside the text seen before
        found = [at for at in (text.find(stop, self.sent) for stop in self.stops) if at >= 0]
        end = min(found) if found else len(text) if done else max(self.sent, len(text) - self.held)
        piece, self.sent = text[self.sent:end], end
        return piece, bool(found)


def tokens_spanning(decode: Callable[[list[int]], str], ids: list[int], length: int) -> int:
    """How many of `ids` (from the first) it takes to decode to `length` characters or more: a token the
    cut falls inside counts."""
    return bisect.bisect_left(range(len(ids) + 1), length, key=lambda count: len(decode(ids[:count])))
