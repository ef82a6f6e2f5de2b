"""API keys (stored hashed) and the operator's allow-list for job URIs. Pure functions."""

from __future__ import annotations

import hashlib
import hmac
import posixpath
import secrets
from collections.abc import Sequence
from urllib.parse import unquote, urlparse

__all__ = ["new_api_key", "hash_key", "keys_match", "UriRefused", "check_uri"]


def new_api_key() -> str:
    """A fresh random API key (shown once; only its hash is stored)."""
    return "pc_" + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """sha256 of the key: keys are random 256-bit secrets, so no salt or stretching is needed."""
    return hashlib.sha256(key.encode()).hexdigest()


def keys_match(key: str, stored_hash: str) -> bool:
    """Constant-time comparison of a presented key with a stored hash."""
    return hmac.compare_digest(hash_key(key), stored_hash)


class UriRefused(ValueError):
    """A job URI the operator's policy does not allow; the message says why."""


def _normalise(uri: str) -> tuple[str, str]:
    """(scheme, normalised location) of a URI; plain paths count as ``file``."""
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower() if len(parsed.scheme) > 1 else ""
    if scheme in ("", "file"):
        path = unquote(parsed.path if scheme else uri)
        if not path.startswith("/"):
            raise UriRefused(f"{uri!r}: local paths must be absolute")
        return "file", posixpath.normpath(path)
    return scheme, uri


def check_uri(uri: str, allowed_prefixes: Sequence[str], allow_pipe: bool = False) -> None:
    """Raise ``UriRefused`` unless ``uri`` is under one of ``allowed_prefixes``.

    Refused: ``pipe:`` (unless allowed), credentials inside the URI, ``..`` segments
    (checked before normalising, so traversal cannot sneak under a prefix), and anything
    outside the prefixes. Local paths are compared after normalisation.
    """
    if uri.startswith("pipe:"):
        if not allow_pipe:
            raise UriRefused(f"{uri!r}: pipe: URIs are disabled on this service")
        return
    parsed = urlparse(uri)
    if parsed.username or parsed.password:
        raise UriRefused(f"{uri!r}: credentials inside URIs are not accepted; configure them on the workers")
    if ".." in unquote(parsed.path if parsed.scheme else uri).split("/"):
        raise UriRefused(f"{uri!r}: '..' path segments are not accepted")
    scheme, location = _normalise(uri)
    for prefix in allowed_prefixes:
        p_scheme, p_location = _normalise(prefix)
        if p_scheme != scheme:
            continue
        if scheme == "file":
            root = p_location.rstrip("/") or "/"
            if location == root or location.startswith(root + "/") or root == "/":
                return
        elif location.startswith(prefix):
            return
    raise UriRefused(f"{uri!r} is outside the locations this service may use")
