"""Between text and token ids: prompts in, completions out."""

from __future__ import annotations

from collections.abc import Sequence

from dlmrt.core.errors import ArgumentError
from dlmrt.models import Denoiser


def require_utf8(text: str, name: str) -> None:
    """Refuse text that holds what is not UTF-8: bytes a terminal could not decode reach Python as lone
    surrogates (the file system's `surrogateescape`), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ArgumentError(f"{name} is not valid UTF-8 (character {error.start + 1} is an undecodable byte): "
                            f"pass UTF-8 text") from None


def encode(model: Denoiser, text: str) -> list[int]:
    """Token ids of a prompt, with the checkpoint's tokenizer (tokenizer.json)."""
    require_utf8(text, "the prompt")
    if model.tokenizer is None:
        raise ArgumentError(f"the model {model.name} has no tokenizer.json: pass token ids "
                            f"(--prompt-ids) instead of text")
    try:
        # encode_batch lets go of the GIL while it works (encode holds it): a megabyte prompt tokenized in the
        # server's worker thread then leaves the event loop running
        return model.tokenizer.encode_batch([text])[0].ids
    except Exception as error:  # tokenizers raises plain Exceptions
        unknown = sorted({c for c in text if model.tokenizer.token_to_id(c) is None})
        detail = f"characters not in its vocabulary: {unknown}" if unknown else str(error)
        raise ArgumentError(f"the prompt {text!r} cannot be tokenized by {model.name}'s tokenizer "
                            f"({detail})") from None


def completion(tokens: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """Generated ids up to (not including) the first stop id (end-of-sequence tokens)."""
    tokens = list(tokens)
    ends = [i for i, t in enumerate(tokens) if t in stop_ids]
    return tokens[:ends[0]] if ends else tokens


def decode(model: Denoiser, ids: Sequence[int]) -> str | None:
    """Text of generated ids (special tokens skipped), or None without a tokenizer."""
    if model.tokenizer is None:
        return None
    return model.tokenizer.decode(list(ids), skip_special_tokens=True)
