"""Limits at the service's edge: request bodies counted while they stream, text fields
checked for characters no URI or name may hold, validation errors that never echo input,
and a byte- and time-bounded read of a shard's prefix for ``:validate``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import unicodedata
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, BinaryIO

from starlette.datastructures import MutableHeaders

__all__ = ["BodyLimit", "safe_text", "public_errors", "BoundedReader", "PrefixEnd", "scrub", "RedactSecrets", "redact_access_log",
           "redact_query"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """ASGI middleware: read the whole body first, counting bytes as they arrive.

    A ``Content-Length`` over the limit is refused before reading; a chunked body is
    refused (413) as soon as the count passes the limit, and a body that takes longer than
    ``timeout_s`` (a slow sender holding a connection) gets 408. It wraps the whole app,
    so the limit holds before authentication and before any route reads the body.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, on_refused: Callable[[int], None] | None = None) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        #: Told each refusal's status code (the metrics: the app's own middleware, inside
        #: this one, never sees these requests)
        self.on_refused = on_refused

    async def _refuse(self, send: Send, code: int, detail: str) -> None:
        if self.on_refused is not None:
            self.on_refused(code)
        await _reply(send, code, detail)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and (not value.isdigit() or int(value) > self.max_bytes):
                await self._refuse(send, 413, f"request body over {self.max_bytes} bytes")
                return
        body = bytearray()
        deadline = time.monotonic() + self.timeout_s
        more = True
        while more:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await self._refuse(send, 408, f"request body not received within {self.timeout_s:g} s")
                return
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = bool(message.get("more_body", False))
            if len(body) > self.max_bytes:
                await self._refuse(send, 413, f"request body over {self.max_bytes} bytes")
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # later calls wait for the disconnect, as Starlette expects

        await self.app(scope, replay, send)


class SecurityHeaders:
    """ASGI middleware: the pages' ``page_policy`` on replies under ``/`` and ``/ui`` (with
    ``no-store``: they hold one tenant's data), a policy that runs nothing on every other
    reply, and ``nosniff``, ``DENY`` and ``same-origin`` on all. Plain ASGI, not
    ``@app.middleware``: Starlette's wrapper raised "No response returned" (two tracebacks
    in the log) for every client that left mid-body."""

    API_POLICY = "default-src 'none'; frame-ancestors 'none'; base-uri 'none'"

    def __init__(self, app: ASGIApp, page_policy: str) -> None:
        self.app, self.page_policy = app, page_policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        page = scope["path"] == "/" or scope["path"].startswith("/ui")

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["Content-Security-Policy"] = self.page_policy if page else self.API_POLICY
                headers["X-Content-Type-Options"] = "nosniff"
                headers["X-Frame-Options"] = "DENY"
                headers["Referrer-Policy"] = "same-origin"
                if page and "cache-control" not in headers:
                    headers["Cache-Control"] = "no-store"
            await send(message)

        await self.app(scope, receive, with_headers)


async def _reply(send: Send, status: int, detail: str) -> None:
    payload = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})


def safe_text(value: str) -> str:
    """Refuse text that cannot be a URI, a path or a name: NUL and other control characters,
    and lone surrogates (which no encoder can write). The message never repeats the value."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone surrogate (not valid Unicode text)") from None
    if any(unicodedata.category(ch) == "Cc" for ch in value):
        raise ValueError("contains a NUL byte or another control character")
    return value


def _printable(item: Any) -> Any:
    """A location item fit for a JSON reply (field names come from the request)."""
    if isinstance(item, str):
        return item.encode("utf-8", "replace").decode("utf-8")[:100]
    return item if isinstance(item, int) else str(item)[:100]


def public_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validation errors without the ``input`` and ``ctx`` pydantic adds: a 422 never
    echoes the request (which may be large, hold NaN or invalid text, or secrets)."""
    return [{"loc": [_printable(i) for i in e.get("loc", ())], "msg": str(e.get("msg", ""))[:300], "type": str(e.get("type", ""))}
            for e in errors[:20]]


def scrub(value: Any) -> Any:
    """Make stored values (written before these checks existed) encodable in a reply."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {scrub(k): scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


class PrefixEnd(Exception):
    """The bounded read reached its byte or time limit (not an error of the shard).

    Deliberately not an ``OSError``/``ValueError``: the tar reader must not mistake it
    for a damaged shard.
    """


class BoundedReader:
    """A read-only stream that stops (``PrefixEnd``) after ``max_bytes`` or ``deadline``.

    The deadline is checked before and after each read: the opener cuts a stalled HTTP
    connection at the same deadline (``pairclean.uris.SocketWatch``), and the short read
    that follows is the deadline, not a damaged shard.
    """

    def __init__(self, fh: BinaryIO, max_bytes: int, deadline: float) -> None:
        self.fh, self.max_bytes, self.deadline, self.count = fh, max_bytes, deadline, 0
        self.reason: str | None = None

    def read(self, n: int = -1) -> bytes:
        if time.monotonic() > self.deadline:
            self.reason = "time"
            raise PrefixEnd
        if self.count >= self.max_bytes:
            self.reason = "bytes"
            raise PrefixEnd
        room = self.max_bytes - self.count
        try:
            data = self.fh.read(room if n is None or n < 0 else min(n, room))
        except OSError:
            if time.monotonic() > self.deadline:
                self.reason = "time"
                raise PrefixEnd from None
            raise
        if time.monotonic() > self.deadline:
            self.reason = "time"
            raise PrefixEnd
        self.count += len(data)
        return data


# Query parameters whose values are secrets: never written to a log.
_SECRET_PARAM = re.compile(r"(?i)([?&](?:[a-z0-9_.%-]*(?:key|token|auth|authorization|bearer|password|secret|session|credentials?)"
                           r"[a-z0-9_.%\[\]-]*)=)[^&#\s]*")
#: A pairclean API key (``security.new_api_key``) wherever it appears: names are endless
#: (``?X_API_KEY=``, ``?api%5Fkey=``, ``?key[]=``, a path segment), the key's shape is not.
_API_KEY = re.compile(r"pc_[A-Za-z0-9_-]{20,}")


def redact_query(text: str) -> str:
    """``text`` with the values of secret-looking query parameters, and anything shaped like
    a pairclean API key, replaced by ``***``."""
    return _API_KEY.sub("***", _SECRET_PARAM.sub(r"\1***", text))


class RedactSecrets(logging.Filter):
    """Rewrites uvicorn's access-log records so a key sent as ``?api_key=`` (by a client
    that should have used the header) is not kept in the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        return True


def redact_access_log() -> None:
    """Put ``RedactSecrets`` on uvicorn's access logger (once per process). A logger's
    filters survive uvicorn's own ``dictConfig``, which only replaces handlers."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactSecrets) for f in logger.filters):
        logger.addFilter(RedactSecrets())
