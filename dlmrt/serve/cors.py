"""Which web pages may call the server from a browser: its CORS policy (`dlmrt serve --allowed-origins`).

By default no origin is allowed: the server sends no CORS headers, so a browser lets no page of another
origin read an answer, or send a request that needs a preflight (a JSON body does). With allowed origins,
Starlette's CORSMiddleware answers their preflights and marks the answers to them; the methods are the
API's (GET, POST), any request header is allowed (OpenAI's JavaScript client sends its own), and so is a
preflight that asks for access to a private network (`Access-Control-Request-Private-Network`, a public
page calling a server on localhost), as the operator named the page's origin. A refused preflight is
answered in OpenAI's error shape.

Origins are compared as strings, so each is checked here to be what a browser sends in its `Origin`
header (`scheme://host[:port]`, lowercase, no path): a trailing slash would otherwise never match.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware

from dlmrt.core.errors import ArgumentError
from dlmrt.serve.schema import ApiError

ANY = "*"
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://([a-z0-9-]+(\.[a-z0-9-]+)*|\[[0-9a-f:.]+\])(:[0-9]{1,5})?")


def parse_origins(value: str | None) -> tuple[str, ...]:
    """The origins of `--allowed-origins` (comma-separated, or *); () for none."""
    origins = tuple(dict.fromkeys(part.strip() for part in (value or "").split(",") if part.strip()))
    if ANY in origins and len(origins) > 1:
        raise ArgumentError(f"--allowed-origins: give {ANY} alone (any origin), or a list of origins without it")
    for origin in origins:
        if origin != ANY and not _ORIGIN.fullmatch(origin):
            raise ArgumentError(f"--allowed-origins: {origin!r} is not an origin as a browser sends it: give "
                                f"scheme://host[:port] in lowercase, with no path or trailing slash (as "
                                f"https://app.example or http://localhost:3000)")
    return origins


class Cors(CORSMiddleware):
    """Starlette's CORS middleware over the API's methods for `origins`, its refusals in OpenAI's shape."""

    def __init__(self, app, origins: tuple[str, ...]):
        super().__init__(app, allow_origins=origins, allow_methods=("GET", "POST"), allow_headers=(ANY,),
                         allow_private_network=True)

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        refused = response.body.decode().removeprefix("Disallowed CORS ")  # e.g. "origin, method"
        error = ApiError(400, f"the browser's CORS preflight is refused ({refused} not allowed): this server "
                              f"takes GET and POST from the origins of dlmrt serve --allowed-origins",
                         code="cors_refused")
        cors = {name: value for name, value in response.headers.items()
                if name.startswith("access-control-") or name == "vary"}
        return JSONResponse(error.body(), status_code=error.status, headers=cors)
