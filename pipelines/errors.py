"""The pairclean exception hierarchy, written out in one place.

    PaircleanError
    ├── InputError                 bad job-level input (names the URI or option)
    │   ├── UnsupportedSchemeError  a URI scheme pairclean cannot read or write
    │   ├── ShardNotFoundError      a shard URI that does not exist
    │   ├── ShardReadError          a shard that exists but is not a readable tar
    │   └── ForeignOutputError      an output that holds files pairclean did not write
    ├── SpecMismatchError          an output folder written by a different job spec
    ├── OutputBusyError            another live run holds the output folder's lock
    └── ModelLoadError             an estimator that cannot be built or loaded

Per-sample problems (a corrupt image, a missing caption) are never exceptions: they
become rows with a ``status``. Per-shard and per-job problems are these exceptions,
translated from foreign exceptions at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = [
    "PaircleanError",
    "first_line",
    "InputError",
    "UnsupportedSchemeError",
    "ShardNotFoundError",
    "ShardReadError",
    "ShardTimeoutError",
    "ForeignOutputError",
    "SpecMismatchError",
    "OutputBusyError",
    "ModelLoadError",
    "causes",
]


class PaircleanError(Exception):
    """Base class of every error pairclean raises on purpose."""


class InputError(PaircleanError):
    """Job-level input that cannot be used; the message names the URI or option."""

    def __init__(self, message: str, uri: str | None = None) -> None:
        super().__init__(message)
        self.uri = uri


class UnsupportedSchemeError(InputError):
    """A URI whose scheme pairclean does not read (or is not allowed to)."""


class ShardNotFoundError(InputError):
    """A shard URI that points at nothing."""


class ShardReadError(InputError):
    """A shard that exists but cannot be read as a tar archive (corrupt, truncated)."""


class ShardTimeoutError(InputError):
    """A shard that took longer than the time limit its job gave it (``--shard-timeout``)."""


class ForeignOutputError(InputError):
    """An output location holding files pairclean did not write: never touched."""


class OutputBusyError(PaircleanError):
    """Another run that is still alive (fresh heartbeat) holds the output folder."""


class SpecMismatchError(PaircleanError):
    """The output folder already holds a job with a different frozen spec."""


class ModelLoadError(PaircleanError):
    """The estimator could not be built or its weights could not be loaded."""


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\x1b``): keys and shard names are the
    corpus's, and an escape sequence in one would clear or recolour the terminal that prints it."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none: what a
    one-line error quotes of a library's (pyarrow's run to dozens of lines)."""
    text = str(exc)
    return text.splitlines()[0] if text.strip() else type(exc).__name__


def causes(exc: BaseException, limit: int = 5) -> Iterator[BaseException]:
    """``exc`` and what it was raised from (``__cause__``, else ``__context__``), at most
    ``limit`` of them: libraries wrap the error that says what went wrong (fsspec reports a
    refused connection as FileNotFoundError, an s3fs write a botocore error)."""
    current: BaseException | None = exc
    for _ in range(limit):
        if current is None:
            return
        yield current
        current = current.__cause__ or current.__context__
