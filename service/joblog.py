"""A job process's log, bounded in size: ``python -m pairclean_service.joblog LOG MAX_BYTES -- CMD...``.

The runner starts each job through this wrapper. It runs CMD with its stdout and stderr
on a pipe and appends what CMD writes to LOG until LOG holds ``MAX_BYTES``; past that it
keeps only the last ``TAIL_BYTES`` in memory and appends them, after a line saying how
much was left out, when CMD ends. So a chatty library (a decoder warning per image, a
C++ message per batch) cannot fill the service's disk, and the end of the log, where a
job's error is, is always there. LOG only grows (``pairclean logs --follow`` reads it by
offset). The wrapper exits as CMD did (killed by the same signal where CMD was).

A separate process rather than a thread in the job: C code writes to the file descriptor
directly, and a reader thread in the same process can deadlock against a writer holding
the GIL on a full pipe. Standard library only (it starts in a fraction of a second).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import BinaryIO

__all__ = ["TAIL_BYTES", "copy_bounded", "main", "wrap"]

#: How much of the end of a job's output is kept once its log is full.
TAIL_BYTES = 256 * 1024
_CHUNK = 64 * 1024


def wrap(cmd: list[str], log_path: str, max_bytes: int) -> list[str]:
    """The command line that runs ``cmd`` with its output appended to ``log_path``, bounded."""
    return [sys.executable, "-m", "pairclean_service.joblog", log_path, str(max_bytes), "--", *cmd]


def copy_bounded(read_fd: int, out: BinaryIO, max_bytes: int, tail_bytes: int = TAIL_BYTES) -> int:
    """Copy ``read_fd`` to its end into ``out`` (opened for appending) while ``out`` is
    below ``max_bytes``; past that keep the last ``tail_bytes`` and append them, from
    their first whole line, after a note of how many bytes were left out. Returns the
    number of bytes left out."""
    written = os.fstat(out.fileno()).st_size
    tail = bytearray()
    over = 0  # bytes past the limit: the tail holds the last of them
    while chunk := os.read(read_fd, _CHUNK):  # PEP 475: retried after a signal handler ran
        if not over:
            room = max(max_bytes - written, 0)
            out.write(chunk[:room])
            out.flush()
            written += min(room, len(chunk))
            chunk = chunk[room:]
            if chunk:
                out.write(f"\n[pairclean: this log reached its limit of {max_bytes} bytes (PAIRCLEAN_MAX_LOG_BYTES); "
                          f"the job's output is left out from here, and its last part is added when the job ends]\n".encode())
                out.flush()
        if chunk:
            over += len(chunk)
            tail += chunk
            del tail[: max(len(tail) - tail_bytes, 0)]
    if not over:
        return 0
    if over > len(tail):  # start at a whole line: the cut may fall inside one (or a UTF-8 character)
        newline = tail.find(b"\n")
        tail = tail[newline + 1:] if newline >= 0 else tail
    left_out = over - len(tail)
    out.write(f"[pairclean: {left_out} bytes of the job's output left out; its last {len(tail)} bytes follow]\n".encode())
    out.write(bytes(tail))
    out.flush()
    return left_out


def main(argv: list[str] | None = None) -> int:
    """Run the command after ``--``; see the module's docstring."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 4 or args[2] != "--":
        print("usage: python -m pairclean_service.joblog LOG MAX_BYTES -- CMD...", file=sys.stderr)
        return 2
    log_path, max_bytes, cmd = args[0], int(args[1]), args[3:]
    # The runner ends a job by signalling its process group: CMD must get the signal and
    # stop as it chooses while this copies its last words. A handler (not SIG_IGN, which
    # CMD would inherit) is reset to the default in CMD when it starts.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        assert proc.stdout is not None
        copy_bounded(proc.stdout.fileno(), out, max_bytes)
        code = proc.wait()
    if code < 0:  # killed by a signal: end the same way, so the runner sees what CMD saw
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
