"""API keys (stored hashed) and the operator's allow-list for job URIs. Pure functions."""

from __future__ import annotations

import hashlib
import hmac
import os
import posixpath
import re
import secrets
from collections.abc import Sequence
from urllib.parse import unquote, urlparse

from pairclean.schema import SIDE_SUFFIX, side_folder
from pairclean.uris import local_path, under_prefix

__all__ = ["new_api_key", "hash_key", "keys_match", "UriRefused", "check_uri", "is_allowed", "local_target", "local_roots_of",
           "output_location", "output_key", "OutputMoved", "checked_output", "job_roots"]


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
    """A job URI the operator's policy does not allow; the message says why.

    Messages name only what the caller sent, never where a path resolves to or whether
    something outside the allow-list exists.
    """


_PERCENT = re.compile(r"%[0-9A-Fa-f]{2}")


def local_target(uri: str) -> str | None:
    """The real filesystem path a local URI touches (symlinks and ``..`` resolved), or
    None for a remote URI. Raises ``UriRefused`` for a local URI the service will not use.

    The reader and writer take ``file://`` paths and plain paths literally (no
    percent-decoding), so a path with percent-escapes is refused rather than checked under
    one spelling and created under another.
    """
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower() if len(parsed.scheme) > 1 else ""
    if scheme not in ("", "file"):
        return None
    if scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise UriRefused(f"{uri!r}: file:// URIs must name a local path (file:///path)")
    path = parsed.path if scheme else uri
    if _PERCENT.search(path):
        raise UriRefused(f"{uri!r}: percent-escapes are not accepted in local paths; write the path as it is")
    if not path.startswith("/"):
        raise UriRefused(f"{uri!r}: local paths must be absolute")
    if ".." in path.split("/"):
        raise UriRefused(f"{uri!r}: '..' path segments are not accepted")
    return os.path.realpath(path)


def _prefix_root(prefix: str) -> str:
    parsed = urlparse(prefix)
    path = parsed.path if len(parsed.scheme) > 1 else prefix
    return os.path.realpath(unquote(path)) if path.startswith("/") else ""


def check_uri(uri: str, allowed_prefixes: Sequence[str], allow_pipe: bool = False) -> None:
    """Raise ``UriRefused`` unless what ``uri`` will actually touch is under an allowed prefix.

    Refused: ``pipe:`` (unless allowed), credentials inside the URI, ``..`` segments,
    percent-escapes in local paths, and anything outside the prefixes. Local paths are
    compared after resolving symlinks (the real target must be under the real prefix);
    remote URIs on path-segment boundaries (``s3://laion`` does not admit
    ``s3://laion-private/``).
    """
    if uri.startswith("pipe:"):
        if not allow_pipe:
            raise UriRefused(f"{uri!r}: pipe: URIs are disabled on this service")
        return
    parsed = urlparse(uri)
    if parsed.username or parsed.password:
        # The reply names the location without the secret (replies end up in logs and tickets).
        shown = parsed._replace(netloc="***@" + parsed.netloc.rpartition("@")[2]).geturl()
        raise UriRefused(f"{shown!r}: credentials inside URIs are not accepted; configure them on the workers")
    target = local_target(uri)
    if target is None:
        if ".." in unquote(parsed.path).split("/"):
            raise UriRefused(f"{uri!r}: '..' path segments are not accepted")
        if any(not _is_local(p) and under_prefix(uri, p) for p in allowed_prefixes):
            return
    else:
        for prefix in allowed_prefixes:
            root = _prefix_root(prefix) if _is_local(prefix) else ""
            if root and (root == "/" or target == root or target.startswith(root + "/")):
                return
    raise UriRefused(f"{uri!r} is outside the locations this service may use")


def is_allowed(uri: str, allowed_prefixes: Sequence[str]) -> bool:
    """``check_uri`` as a yes/no answer (pipes refused)."""
    try:
        check_uri(uri, allowed_prefixes)
    except UriRefused:
        return False
    return True


def local_roots_of(allowed_prefixes: Sequence[str]) -> list[str]:
    """The resolved local folders among ``allowed_prefixes`` (remote prefixes left out): the
    roots a job process checks its local paths against (``pairclean.uris.local_roots``)."""
    roots = [_prefix_root(p) for p in allowed_prefixes if _is_local(p)]
    return [r for r in roots if r]


def _is_local(prefix: str) -> bool:
    scheme = urlparse(prefix).scheme
    return len(scheme) <= 1 or scheme.lower() == "file"


def output_location(output: str) -> str:
    """Where an output is, one spelling per place (no trailing slash): the resolved local
    path, or a remote URI with its scheme and host lower-cased and its path normalised.
    ``UriRefused`` for a local URI the service will not use."""
    target = local_target(output)
    if target is None:
        parsed = urlparse(output)
        target = f"{parsed.scheme.lower()}://{parsed.netloc.lower()}{posixpath.normpath(unquote(parsed.path) or '/')}"
    return target.rstrip("/")


def output_key(output: str) -> str:
    """The identity of an output location (two spellings of one folder share it)."""
    try:
        location = output_location(output)
    except UriRefused:  # a row stored before today's checks: its spelling is its identity
        location = output.rstrip("/")
    return hashlib.sha256(location.encode("utf-8", "replace")).hexdigest()


class OutputMoved(UriRefused):
    """A job's output folder (or its side folder) no longer resolves where it did when the
    job was submitted, or has left the allow-list: a symlink changed since."""


def checked_output(output: str, recorded_key: str | None, allowed_prefixes: Sequence[str]) -> str:
    """``output`` (a job's output URI) when it may still be read or written for its job;
    ``OutputMoved`` otherwise. Checked on every use, not once at submission: the output
    folder and its side folder (``OUT.pairclean``) must still be inside the allow-list, the
    output must resolve to the location recorded at submission (``recorded_key``, its
    ``output_key``; None for rows of earlier releases), and the side folder must be the one
    beside it (not a link of its own to somewhere else). So a tenant who re-points their own
    job's folder at another tenant's output reads nothing through the job's pages or routes.
    The message names only the job's own output."""
    moved = OutputMoved(f"the output folder {output!r} no longer resolves where it did when the job was submitted, "
                        "or is outside the locations this service may use; its results are not read")
    try:
        check_uri(output, allowed_prefixes)
        check_uri(side_folder(output), allowed_prefixes)
        target = local_target(output)
        side = local_target(side_folder(output))
    except (UriRefused, ValueError) as exc:
        raise moved from exc
    if recorded_key is not None and output_key(output) != recorded_key:
        raise moved
    if target is not None and side != _side_beside(output):
        raise moved
    return output


def _side_beside(output: str) -> str:
    """Where the side folder of local ``output`` resolves when it is no link of its own:
    beside the output's own name in the output's resolved parent (an output that is a link,
    ``out/latest -> out/2024-05``, keeps ``out/latest.pairclean``)."""
    path = local_path(output).rstrip("/")
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path) + SIDE_SUFFIX)


def job_roots(output: str) -> list[str]:
    """The local folders a job's files must resolve inside: its output folder and side folder,
    resolved now (after ``checked_output``); [] for a remote output. The job process writes
    only there (``PAIRCLEAN_LOCAL_WRITE_ROOTS``), and the service reads a job's folder only
    there (``OutputDir(roots=...)``): a link planted inside the folder, to another tenant's
    table or state, leads nowhere."""
    target = local_target(output)
    side = local_target(side_folder(output))
    return [p for p in (target, side) if p is not None]
