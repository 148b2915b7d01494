"""Who may use the server: API keys (``--api-key``, ``PP_API_KEY``, ``--api-key-file``) and the origins whose pages
may call it from a browser (``--cors-origin``).

With keys set, every request but ``/health`` and the chat page's files (``PUBLIC``) needs ``Authorization: Bearer
KEY``; a missing or wrong key gets a 401 in OpenAI's error shape. Keys are compared as SHA-256 digests with
``hmac.compare_digest``, each one every time, so the time taken tells nothing of a key, its length or which one
matched; no key is ever printed. CORS is Starlette's middleware, outside the key check: a browser's preflight carries
no key, and a 401 needs the CORS headers for the page to read it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from pp_worker.serve.fields import ApiError

PUBLIC = ("/health", "/", "/static/")  # exact paths, or a prefix where it ends in "/": the page needs no key to load
ORIGIN = re.compile(r"^https?://[^/\s]+$")  # what a browser sends in Origin: scheme://host[:port], no path
CORS_MAX_AGE_S = 600  # how long a browser may keep a preflight's answer


def parse_keys(values: Iterable[str]) -> list[str]:
    """Keys from flags and variables: each value may hold several, comma-separated (as llama-server's); blanks are
    dropped."""
    return [key.strip() for value in values for key in value.split(",") if key.strip()]


def read_key_file(path: str) -> list[str]:
    """``--api-key-file``: one key per line (blank lines and ``#`` comments skipped); keeps keys out of ``ps``."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def check_origin(origin: str) -> str | None:
    """Why a ``--cors-origin`` would never match what a browser sends, None when it is fine."""
    if origin == "*" or ORIGIN.match(origin):
        return None
    return f"--cors-origin {origin!r}: expected * or scheme://host[:port] (no path, no trailing slash)"


class RequireKey:
    """ASGI middleware: requests outside ``PUBLIC`` need one of the keys as a bearer token."""

    def __init__(self, app: ASGIApp, keys: Iterable[str]):
        self.app = app
        self._digests = [_digest(key) for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _public(scope["path"]) or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        given = _bearer(scope) is not None
        error = ApiError(401, "Incorrect API key provided" if given else "An API key is required: send the header "
                         "'Authorization: Bearer KEY'", code="invalid_api_key")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="pp-serve"')]})
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope: Scope) -> bool:
        token = _bearer(scope)
        if token is None:
            return False
        given = _digest(token)
        matched = False
        for digest in self._digests:  # every key, every time: no early exit to time
            matched |= hmac.compare_digest(digest, given)
        return matched


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def _bearer(scope: Scope) -> bytes | None:
    """The token of an ``Authorization: Bearer ...`` header (the scheme is case-insensitive, RFC 7235)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def _public(path: str) -> bool:
    return any(path == p or p.endswith("/") and p != "/" and path.startswith(p) for p in PUBLIC)


def cors(origins: list[str]) -> Middleware:
    """Starlette's CORS middleware for these origins (``*``: any): the headers on every answer to them, and the
    answer to their preflight (``OPTIONS``); requests from other origins get none, their preflight a 400. Any
    request header may be sent (the OpenAI client libraries add their own ``x-stainless-*`` ones)."""
    return Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],
                      allow_headers=["*"], max_age=CORS_MAX_AGE_S)
