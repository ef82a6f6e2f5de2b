"""Browser sessions for the web pages: an API key exchanged once for a session cookie.

Why server-side sessions (a random id, only its sha256 kept in memory) rather than a
signed cookie:

- the cookie carries nothing but 256 random bits: nothing to decode, forge or replay
  after logout, and no signing secret to generate, share between replicas or rotate;
- logout ends the session on the server at once (a signed cookie stays valid until it
  expires, whatever the browser does with it);
- every request resolves the session to the *API key's hash* and then the key's owner
  through the job store, so a key removed from the store ends its sessions too;
- only hashes are held, so a memory dump or a debug print shows no usable cookie.

The cost: sessions live in this process, so they end when the service restarts (one logs
in again) and do not span API replicas (put sticky sessions in front, or move this table
into the job store; ``Sessions`` is the whole interface). Bounded: at most
``max_sessions`` live at once (the oldest go first), at most ``max_per_key`` of them for
one API key (that key's oldest go first, so one tenant logging in again and again churns
only its own sessions, never another's), and each lasts ``ttl_s``.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["Sessions", "COOKIE"]

#: The cookie's name (HttpOnly, SameSite=Strict, Path=/ui; Secure over HTTPS).
COOKIE = "pairclean_session"


@dataclass(frozen=True)
class _Session:
    key_hash: str
    expires: float


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


class Sessions:
    """Live sessions by the sha256 of their token; thread-safe."""

    def __init__(self, ttl_s: float, max_sessions: int = 10_000, max_per_key: int = 32) -> None:
        self.ttl_s, self.max_sessions, self.max_per_key = ttl_s, max_sessions, max_per_key
        self._live: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()

    def create(self, key_hash: str) -> str:
        """A new session for the API key with hash ``key_hash``; returns the cookie value."""
        token = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            for digest in [d for d, s in self._live.items() if s.expires <= now]:
                del self._live[digest]
            own = [d for d, s in self._live.items() if s.key_hash == key_hash]  # oldest first
            for digest in own[: max(0, len(own) - self.max_per_key + 1)]:
                del self._live[digest]
            while len(self._live) >= self.max_sessions:
                self._live.popitem(last=False)  # the oldest login goes first
            self._live[_digest(token)] = _Session(key_hash, now + self.ttl_s)
        return token

    def key_hash(self, token: str | None) -> str | None:
        """The API key hash of a live session, or None (unknown, expired or malformed)."""
        if not token or len(token) > 100:
            return None
        digest = _digest(token)
        with self._lock:
            session = self._live.get(digest)
            if session is None:
                return None
            if session.expires <= time.monotonic():
                del self._live[digest]
                return None
            return session.key_hash

    def end(self, token: str | None) -> None:
        """Forget a session (logout); unknown tokens are ignored."""
        if token:
            with self._lock:
                self._live.pop(_digest(token), None)
