"""Stopping a batch verb cleanly on Ctrl-C (SIGINT) and on SIGTERM (``kill``, Kubernetes,
Slurm), with the one-line message and exit code of an interrupt and its run lock released.

Why a handler of our own: Python turns SIGINT into a ``KeyboardInterrupt`` wherever the main
thread is, and one raised inside a finaliser or an import-lock callback during start-up is
printed as "Exception ignored" and lost, so the job ran on to the end; SIGTERM ended the
process with no message (a local run) or with Ray's native stack dump (Ray installs its own
handler when it starts). Here both signals set a flag and raise (a second one while stopping
only says so, so the lock's release is not cut short; a third quits at once); the job's progress callbacks
(``raise_if_stopped``) raise again at the next shard if the first was swallowed; and
``reinstall`` puts the handler back after ``ray.init``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Terminated", "stop_signals", "raise_if_stopped", "reinstall"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state: dict[str, object] = {"signum": None, "installed": False, "repeats": False, "ours": ()}


class Terminated(KeyboardInterrupt):
    """SIGTERM, stopping the run as Ctrl-C does (committed work is kept)."""


def _stop(signum: int) -> None:
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _handler(signum: int, frame: FrameType | None) -> None:
    if _state["signum"] is not None:
        # Already stopping: a second signal would interrupt the clean-up itself (the lock's
        # release), so it only says so; a third quits at once, as the user insists.
        if _state["repeats"]:
            os._exit(143 if signum == signal.SIGTERM else 130)
        _state["repeats"] = True
        print("stopping: committed work is kept and the lock released; signal again to quit at once", file=sys.stderr)
        return
    _state["signum"] = signum
    _stop(signum)


def raise_if_stopped() -> None:
    """Raise the stop a signal asked for, if it has not ended the run yet (a swallowed one)."""
    signum = _state["signum"]
    if isinstance(signum, int):
        _stop(signum)


def reinstall() -> None:
    """Put the handlers back where a library (Ray) replaced them while ``stop_signals`` is active."""
    if _state["installed"] and threading.current_thread() is threading.main_thread():
        for sig in _state["ours"]:  # type: ignore[union-attr]
            signal.signal(sig, _handler)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise ``KeyboardInterrupt`` / ``Terminated`` (main thread
    only; elsewhere a no-op; a signal the process ignores stays ignored). The previous
    handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # A signal the caller ignores stays ignored (a background job of a shell ignores SIGINT)
    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
    _state.update(signum=None, installed=True, repeats=False, ours=tuple(previous))
    for sig in previous:
        signal.signal(sig, _handler)
    try:
        yield
    finally:
        _state.update(installed=False)
        for sig, old in previous.items():
            signal.signal(sig, old)
