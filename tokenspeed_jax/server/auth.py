"""API-key authentication (`--api-key`, `TOKENSPEED_JAX_API_KEY`): a pure ASGI middleware, so a
request without a valid `Authorization: Bearer KEY` is refused (401, OpenAI's error body) before
its body is read or any route (streaming ones included) runs.

Every path needs the key except `/health` (load balancers probe it without credentials) and, unless
`require_key_for_metrics`, `/metrics` and `/stats` (scrapers). Keys are compared in constant time
(`hmac.compare_digest`) and never logged: the error message does not echo what was sent.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Sequence

from tokenspeed_jax.server.errors import send_error

ENV_VAR = "TOKENSPEED_JAX_API_KEY"
_OPEN = frozenset({"/health"})
_METRICS = frozenset({"/metrics", "/stats"})


def resolve_keys(flags: Sequence[str] | None, environ: dict[str, str] | None = None) -> list[str]:
    """The accepted keys: every `--api-key` flag, else the environment variable (empty = none)."""
    keys = [k for k in (flags or ()) if k]
    if not keys:
        env = (os.environ if environ is None else environ).get(ENV_VAR, "")
        keys = [env] if env else []
    return keys


class ApiKeyMiddleware:
    """Refuses HTTP requests whose bearer token is not one of `keys` (see the module docstring)."""

    def __init__(self, app, keys: Iterable[str], *, require_key_for_metrics: bool = False) -> None:
        self.app = app
        self.keys = [k.encode("utf-8") for k in keys]
        if not self.keys:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.open = _OPEN if require_key_for_metrics else _OPEN | _METRICS

    def allowed(self, header: bytes | None) -> bool:
        if header is None:
            return False
        scheme, _, token = header.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        ok = False
        for key in self.keys:  # no early exit: time does not depend on which key matched
            ok |= hmac.compare_digest(token, key)
        return ok

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"].rstrip("/") in self.open
            or scope.get("method") == "OPTIONS"
        ):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or ()).get(b"authorization")
        if self.allowed(header):
            await self.app(scope, receive, send)
            return
        message = (
            "Missing API key: send 'Authorization: Bearer <key>'"
            if header is None
            else "Incorrect API key provided"
        )
        await send_error(
            send, 401, message, code="invalid_api_key", headers=((b"www-authenticate", b"Bearer"),)
        )
