"""One run per output folder: a lock object with a heartbeat and a time-to-live.

The lock is ``OUT/_pairclean/lock.json`` (holder's run id, host, pid, heartbeat time). It
works on any store, object stores included (no rename, no append, no conditional write
needed):

- a run takes the lock when there is none, when the holder's heartbeat is older than its
  TTL (the holder crashed), or when the holder ran on this host and its process is gone;
- otherwise it is refused with ``OutputBusyError`` naming the live holder;
- a free lock is created exclusively where the store can: a local folder (a temporary
  linked to its name) and S3 (a conditional PUT, ``If-None-Match: *``): of two runs
  racing for it one is refused, however slow its write;
- after writing, the run waits ``settle_s`` and reads the lock back: where the store has
  no conditional write (or a crashed holder's lock is taken over), of two runs racing the
  one whose write landed last wins and the other one is refused;
- while running, a background thread rewrites the heartbeat every TTL/4. If it finds
  another holder's lock (this run stalled for longer than the TTL and was taken over), it
  sets ``lost`` and stops; the job loop then stops committing. A beat that fails (the store
  unreachable) is tried again next time; once no beat has landed for a TTL, another run may
  have taken the folder, so ``check`` stops the run too (a network blip used to end the
  heartbeat thread for good while the run went on committing, unlocked).

Why not a library: fsspec offers no lock, filelock only works on local disks, and a
lock service (etcd, a database) would be one more thing for every user to run.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from pairclean import schema
from pairclean.errors import InputError, OutputBusyError
from pairclean.storage import Store

__all__ = ["DEFAULT_TTL_S", "RunLock", "lock_ttl_from_env"]

log = logging.getLogger(__name__)

#: A crashed run's lock is taken over after this long without a heartbeat.
DEFAULT_TTL_S = 60.0


def lock_ttl_from_env() -> float:
    """``$PAIRCLEAN_LOCK_TTL_S`` or ``DEFAULT_TTL_S``."""
    value = os.environ.get("PAIRCLEAN_LOCK_TTL_S")
    return float(value) if value else DEFAULT_TTL_S


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):  # gone, or no pid a process can have (10**20 raised OverflowError)
        return False
    except PermissionError:
        return True  # someone else's process, alive
    return True


def _holder_alive(doc: dict[str, Any] | None, ttl_s: float = DEFAULT_TTL_S) -> bool:
    """Whether the run holding a lock document ``doc`` (``RunLock.read``; None: no lock) is
    alive: its heartbeat younger than its TTL (``ttl_s`` where the document has none) and, on
    this host, its process still there (a holder whose process is gone is dead, whatever its
    heartbeat says)."""
    if doc is None:
        return False
    try:
        beat, ttl, pid = float(doc.get("heartbeat", 0)), float(doc.get("ttl_s", ttl_s)), int(doc.get("pid", 0))
    except (TypeError, ValueError):
        return False  # not a document a run wrote: nobody holds the folder
    now = time.time()
    if now - beat > ttl or beat - now > ttl:  # stale, or a heartbeat from further ahead than any clock skew: no run wrote
        return False  # it (one a day ahead held the folder until lock.json was deleted by hand)
    return not (doc.get("host") == socket.gethostname() and not _pid_alive(pid))


class RunLock:
    """The lock of the folder ``store``; use as a context manager or acquire/release."""

    def __init__(self, store: Store, ttl_s: float | None = None, settle_s: float | None = None) -> None:
        self.store = store
        self.ttl_s = ttl_s if ttl_s is not None else lock_ttl_from_env()
        # Long enough for a racing writer's PUT to land before we read back.
        self.settle_s = settle_s if settle_s is not None else (0.05 if store.local else 0.5)
        self.run_id = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.started = time.time()
        self.lost = threading.Event()
        self._last_beat = time.monotonic()  # when a heartbeat last landed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def describe(self, doc: dict[str, Any]) -> str:
        """A holder, as users see it in messages."""
        age = time.time() - float(doc.get("heartbeat", 0))
        return f"run {doc.get('run_id', '?')[:12]} (pid {doc.get('pid')} on host {doc.get('host')}, last heartbeat {age:.0f} s ago)"

    def _doc(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "host": self.host, "pid": self.pid, "started": self.started,
                "heartbeat": time.time(), "ttl_s": self.ttl_s}

    def read(self) -> dict[str, Any] | None:
        """The current holder's document, or None."""
        return self._parse(self.store.get(schema.LOCK_FILE))

    @staticmethod
    def _parse(data: bytes | None) -> dict[str, Any] | None:
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except json.JSONDecodeError:
            return None  # cannot happen with whole-object writes; treat as free
        return doc if isinstance(doc, dict) else None

    def _is_live(self, doc: dict[str, Any]) -> bool:
        return doc.get("run_id") != self.run_id and _holder_alive(doc, self.ttl_s)

    def acquire(self) -> None:
        """Take the lock and start the heartbeat; raises ``OutputBusyError`` naming a live holder."""
        data = self.store.get(schema.LOCK_FILE)
        holder = self._parse(data)
        if holder is not None and self._is_live(holder):
            raise self._busy(holder)
        try:
            # A free lock is created exclusively where the store can (a local folder, S3): of two
            # runs starting together one gets FileExistsError, however slow its write was
            # (the read-back below alone let both in when a write took longer than settle_s).
            # (an unreadable or expired document is replaced, as before)
            self.store.put(schema.LOCK_FILE, json.dumps(self._doc()).encode(), replace=data is not None)
        except FileExistsError:
            holder = self.read()
            raise self._busy(holder or {}) from None
        time.sleep(self.settle_s)
        holder = self.read()
        if holder is None or holder.get("run_id") != self.run_id:
            raise self._busy(holder or {})
        self._last_beat = time.monotonic()
        self._thread = threading.Thread(target=self._beat, name="pairclean-lock-heartbeat", daemon=True)
        self._thread.start()
        self.store.write_guard = self.check

    def _busy(self, holder: dict[str, Any]) -> OutputBusyError:
        return OutputBusyError(
            f"output {self.store.url()} is in use by another pairclean {self.describe(holder)}; wait for it "
            f"to finish or stop it (a crashed run's lock expires {holder.get('ttl_s', self.ttl_s):.0f} s after its last heartbeat)"
        )

    def _beat(self) -> None:
        interval = max(0.05, self.ttl_s / 4)
        failing = False
        while not self._stop.wait(interval):
            try:
                holder = self.read()
                # Gone is lost too: another run took the lock over while this one stalled
                # (stopped with Ctrl-Z, a VM paused) and has released it since; writing it
                # back let the stalled run go on over that run's finished work.
                if holder is None or holder.get("run_id") != self.run_id:
                    self.lost.set()
                    return
                self.store.put(schema.LOCK_FILE, json.dumps(self._doc()).encode())
                self._last_beat = time.monotonic()
                failing = False
            except InputError:  # the folder left the job's write roots (a link re-pointed): not ours any more
                self.lost.set()
                return
            except Exception as exc:  # noqa: BLE001 - any store error (botocore's are no OSError): try again next beat
                failing = self._beat_failed(exc, failing)

    def _beat_failed(self, exc: BaseException, failing: bool) -> bool:
        """Say once per outage that the heartbeat could not be written (one line, no trace)."""
        if not failing:
            log.warning("the lock's heartbeat on %s could not be written (%s: %s); trying again", self.store.url(),
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return True

    def check(self) -> None:
        """Raise ``OutputBusyError`` when another run has taken the lock over, or may have: no
        heartbeat has landed for a TTL (the store unreachable), so the lock reads as expired."""
        if self.lost.is_set():
            raise OutputBusyError(
                f"lost the lock of {self.store.url()} to another run (this run stalled for longer than "
                f"{self.ttl_s:.0f} s, or its lock file was deleted); stopping without committing more"
            )
        silent = time.monotonic() - self._last_beat
        if self._thread is not None and silent > self.ttl_s:
            raise OutputBusyError(
                f"the lock of {self.store.url()} could not be refreshed for {silent:.0f} s (over its {self.ttl_s:.0f} s "
                "TTL; storage unreachable?): another run may have taken the folder, so this one stops without committing "
                "more; run it again to resume"
            )

    def release(self) -> None:
        """Stop the heartbeat and delete the lock if it is still ours. Never raises: it runs
        in ``finally`` blocks, where its own storage error hid the one that ended the run (a
        lock left behind expires after its TTL)."""
        if self.store.write_guard == self.check:
            self.store.write_guard = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            holder = self.read()
            if holder is not None and holder.get("run_id") == self.run_id:
                self.store.rm(schema.LOCK_FILE)
        except InputError:  # the folder left the job's write roots: nothing of ours to delete there
            return
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("the lock %s could not be removed (%s: %s); it expires %.0f s after its last heartbeat",
                        self.store.url(schema.LOCK_FILE), type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
                        self.ttl_s)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
