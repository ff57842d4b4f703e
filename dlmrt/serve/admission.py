"""A request before any compute: parsed and checked for the model it names and the values dlmrt cannot honour,
its chat rendered with the model's template, its prompt tokenized, and its settings made and checked as the
command line's are (what it leaves out from the model's generation_config.json). Every refusal is an
ApiError naming the request field it is about."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dlmrt.core.chat_template import ChatTemplate
from dlmrt.core.errors import DlmrtError
from dlmrt.runtime import text
from dlmrt.runtime.backend import Backend
from dlmrt.serve.schema import ApiError, ChatRequest, CompletionRequest, OpenAIRequest, parse_request


def parsed(kind: type[OpenAIRequest], body: bytes, name: str) -> OpenAIRequest:
    """The request, parsed and checked for its model (`name`, the one served) and the values dlmrt cannot
    honour."""
    request = parse_request(kind, body)
    if request.model != name:
        raise ApiError(404, f"the model {request.model!r} does not exist: this server runs {name!r}",
                       param="model", code="model_not_found")
    request.refuse_unsupported()
    return request


def admitted(model, backend: Backend, chat_template: ChatTemplate | None, name: str, request: OpenAIRequest):
    """(its prompt ids, settings, the most tokens to return): every check before any compute."""
    if isinstance(request, ChatRequest):
        prompt, most = _rendered(chat_template, name, request), request.most_tokens
    else:
        prompt, most = request.prompt, request.max_tokens
    return _prepare(model, backend, request, prompt, most)


def _rendered(chat_template: ChatTemplate | None, name: str, request: ChatRequest) -> str:
    """The chat's messages through the model's template."""
    if chat_template is None:
        raise ApiError(400, f"{name} has no chat template (no chat_template in its tokenizer_config.json): "
                            f"use /v1/completions with a prompt", param="messages", code="no_chat_template")
    try:
        return chat_template.render([m.model_dump(exclude_none=True) for m in request.messages])
    except DlmrtError as error:
        raise ApiError(400, str(error), param="messages", code="invalid_value") from None


# What a settings or prompt check names (the CLI's spelling), and the request field it is about
_FIELDS_NAMED = (("logprobs", "logprobs"),
                 ("prompt", "prompt"), ("gen-length", "gen_length"), ("block-length", "block_length"),
                 ("policy", "policy"), ("threshold", "threshold"), ("steps", "steps"), ("cache", "cache"),
                 ("temperature", "temperature"), ("seed", "seed"))


def _param_named(message: str, request: OpenAIRequest) -> str | None:
    """The request field a check's message is about (None when it names none)."""
    for words, field in _FIELDS_NAMED:
        if message.startswith(words) or f" {words}" in message:
            if field == "prompt" and isinstance(request, ChatRequest):
                return "messages"
            if field == "gen_length" and request.gen_length is None:
                return "max_tokens" if request.max_tokens is not None else None
            return field
    return None


def decoded(model, ids: list[int]) -> str:
    return text.decode(model, ids) or ""


def token_text(model) -> Callable[[int], str]:
    """A token's own text, special tokens included (its id, where the model has no tokenizer)."""
    if model.tokenizer is None:
        return str
    return lambda token: model.tokenizer.decode([token], skip_special_tokens=False)


def scoring_input(model, backend: Backend, request: CompletionRequest) -> tuple[list[int], int]:
    """(the prompt's ids, the block length) of a request that scores its prompt; every check before any compute."""
    from dlmrt.runtime.scoring import check_scorable, check_text

    try:
        check_scorable(backend.spec)
    except DlmrtError as error:
        raise ApiError(400, f"echo: {error}", param="echo", code="unsupported_value") from None
    block = request.block_length or model.generation_config.get("block_length") or model.default_block_length
    try:
        ids = text.encode(model, request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
        check_text(backend, ids)
    except DlmrtError as error:
        raise ApiError(400, f"prompt: {error}", param="prompt", code="invalid_value") from None
    return ids, block or len(ids)


def _prepare(model, backend: Backend, request: OpenAIRequest, prompt: str | list[int], wanted: int | None):
    """(prompt ids, settings, the most tokens to return) for a request; every check before any compute."""
    from dlmrt.runtime.settings import check_request, settings_with_defaults

    if wanted is not None and request.gen_length is not None:
        raise ApiError(400, "give max_tokens or gen_length, not both", param="gen_length")
    wanted = wanted or request.gen_length
    block = request.block_length or model.generation_config.get("block_length") or model.default_block_length
    gen_length = None if wanted is None else (-(-wanted // block) * block if block else wanted)
    try:
        ids = text.encode(model, prompt) if isinstance(prompt, str) else list(prompt)
        settings = settings_with_defaults(
            model, gen_length=gen_length, block_length=request.block_length, policy=request.policy,
            steps=request.steps, remasking="low_confidence", threshold=request.threshold, factor=None,
            confidence="prob", minimal_topk=1, editing_threshold=None, max_post_steps=None, preset=None,
            entropy_bound=None, cache=request.cache or "none", max_block_steps=None,
            temperature=request.temperature or 0.0, cfg_scale=0.0, seed=request.seed or 0, steps_per_sync=None)
        settings = dataclasses.replace(settings, logprobs=request.alternatives())
        check_request(backend.spec, [ids], settings)
    except DlmrtError as error:
        raise ApiError(400, str(error), param=_param_named(str(error), request), code="invalid_value") from None
    if not ids:
        raise ApiError(400, "prompt: the prompt is empty", param="prompt")
    return ids, settings, wanted or settings.gen_length
