"""Every error the app answers, in OpenAI's error object (`dlmrt.serve.schema.ApiError`): its own refusals,
an exception inside a request, and the router's (an unknown path, a method a path does not take); each one
counted in `dlmrt_rejected_requests` by its code."""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException

from dlmrt.core.errors import DlmrtError
from dlmrt.serve.metrics import ServerMetrics
from dlmrt.serve.schema import ApiError

ENDPOINTS = ("GET /health", "GET /v1/models", "GET /metrics", "POST /v1/completions", "POST /v1/chat/completions")


def failure(error: BaseException) -> ApiError:
    """What a request that failed inside dlmrt answers: 400 for a DlmrtError (a value dlmrt refuses), else 500."""
    if isinstance(error, DlmrtError):
        return ApiError(400, str(error), code="invalid_value")
    return ApiError(500, f"the request failed inside dlmrt ({type(error).__name__}: {error})", code="internal_error",
                    kind="server_error")


def count(metrics: ServerMetrics, error: ApiError) -> None:
    metrics.rejected.labels(error.code or str(error.status)).inc()


def install_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """The app's exception handlers: each error as its response, counted."""

    def answer(error: ApiError):
        count(metrics, error)
        return error.response()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return answer(error)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        return answer(failure(error))

    @app.exception_handler(HTTPException)
    async def framework_error(request: Request, error: HTTPException):
        response = answer(_refusal(request, error))
        response.headers.update(error.headers or {})
        return response


def _refusal(request: Request, error: HTTPException) -> ApiError:
    """The router's own refusal, in OpenAI's shape."""
    path, method = request.url.path, request.method
    if error.status_code == 404:
        return ApiError(404, f"there is no {path}: the endpoints are {', '.join(ENDPOINTS)}", code="not_found")
    if error.status_code == 405:
        allowed = (error.headers or {}).get("Allow", "")
        return ApiError(405, f"{path} does not take {method}: use {allowed}", code="method_not_allowed")
    return ApiError(error.status_code, str(error.detail), code=f"http_{error.status_code}",
                    kind="invalid_request_error" if error.status_code < 500 else "server_error")
