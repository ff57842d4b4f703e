"""Log-probabilities in OpenAI's shapes: the legacy Completions object and Chat's `content` list.

    shape = CompletionLogprobs(token_text, alternatives=2)   # one per reply: it keeps the text offset
    shape.take(entries)   # {"tokens", "token_logprobs", "top_logprobs", "text_offset"} of the next tokens

A token's text is its id decoded alone (`token_text`), special tokens included. A Completions
`top_logprobs` entry holds the `alternatives` most likely tokens and the chosen one, as OpenAI's
("up to logprobs + 1 elements"); tokens whose text is the same share one key there. Docs:
docs/logprobs.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dlmrt.runtime.running_batch import TokenLogprob


class CompletionLogprobs:
    """`choices[].logprobs` of a Completions reply, in pieces (one per streamed chunk, or all at once);
    `text_offset` counts on from `offset` (the echoed prompt's length, or 0)."""

    def __init__(self, token_text: Callable[[int], str], alternatives: int, offset: int = 0):
        self.token_text, self.alternatives, self.offset = token_text, alternatives, offset

    def take(self, ids: Sequence[int], entries: Sequence[TokenLogprob]) -> dict:
        tokens, offsets = [], []
        for token in ids:
            tokens.append(self.token_text(token))
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        top = [{**{self.token_text(t): lp for t, lp in entry.top[:self.alternatives]}, text: entry.logprob}
               for text, entry in zip(tokens, entries)]
        return {"tokens": tokens, "token_logprobs": [entry.logprob for entry in entries], "top_logprobs": top,
                "text_offset": offsets}


def chat_logprobs(ids: Sequence[int], entries: Sequence[TokenLogprob], token_text: Callable[[int], str],
                  alternatives: int) -> dict:
    """`choices[].logprobs` of a Chat reply or chunk."""
    def token(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**token(t, entry.logprob),
                         "top_logprobs": [token(top, lp) for top, lp in entry.top[:alternatives]]}
                        for t, entry in zip(ids, entries)],
            "refusal": None}
