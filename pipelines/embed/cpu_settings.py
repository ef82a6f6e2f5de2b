"""Process-wide CPU settings that pairclean's own processes need to run the model at full speed.

Two causes, each found by measurement on the 2-core CPU (pairclean-lite, 1,000 Flickr8k
pairs, ``benchmarks/throughput.py``):

**Allocator** (``keep_heap_memory``). glibc's malloc serves every allocation above its
mmap threshold (128 KiB, rising with use to at most 32 MiB) with a fresh ``mmap`` and
gives it back with ``munmap`` on free, and trims the heap top back to the kernel above
128 KiB free. A CNN at batch 64 allocates activations of 25-100 MiB per layer
(EfficientNet-Lite0's stem output alone is 64 x 32 x 112 x 112 floats = 98 MiB), so every
forward pass mapped, page-faulted (the kernel zeroes each page) and unmapped gigabytes:
2.8 million minor faults per 250 pairs, a third of the CPU time spent in the kernel (21 s
of system against 41 s of user CPU per 1,000 pairs). ViT-B/32's activations stay under
32 MiB, which is why only the lite path suffered. Raising both thresholds to 1 GiB keeps
that memory in the heap for the next batch: 3 s of system CPU per 1,000 pairs, start-up
included. The cost: the process keeps its peak working set (about 0.6 GiB more resident
memory for pairclean-lite at batch 64). ``mallopt`` works at run time, so
``load_estimator`` calls it in every process that loads a model (CLI, Ray actors, notebooks).

**OpenMP wait policy** (``OPENMP_ENV``, ``apply_process_env``). torch's libgomp keeps the
model's idle worker threads spinning for up to 300,000 iterations after each parallel
region. Between the regions the model's thread runs Python, tokenises, and the reader
thread decodes; the spinning worker takes the core they need. ``OMP_WAIT_POLICY=PASSIVE``
(workers sleep at once) took the in-process loop from 18 to 28 pairs/s and from 36 to 23
user CPU seconds per 1,000 pairs. libgomp reads it once, when torch is first imported, so
it is set as an environment variable: by the CLI before anything imports torch, and for
Ray actors through their ``runtime_env``. A value the user set wins.

``PAIRCLEAN_CPU_TUNING=0`` turns both off. No torch import here (the CLI calls this first).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

__all__ = ["OPENMP_ENV", "HEAP_THRESHOLD_BYTES", "process_env", "apply_process_env", "keep_heap_memory"]

log = logging.getLogger(__name__)

#: Environment that pairclean's processes and Ray actors get, unless already set.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}

#: glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations up to this size come from the heap, and up to this much free memory stays
#: at the heap top. 1 GiB covers the largest activation of batch 256 on the towers
#: pairclean ships (EfficientNet-Lite0's stem: 392 MiB); mallopt takes a C int, so < 2 GiB.
HEAP_THRESHOLD_BYTES = 1 << 30

_heap_done = False


def _enabled() -> bool:
    return os.environ.get("PAIRCLEAN_CPU_TUNING", "1") != "0"


def process_env() -> dict[str, str]:
    """``OPENMP_ENV`` with the values this process's environment already sets in their
    place (empty when tuning is off): what pairclean's processes and Ray actors run with."""
    if not _enabled():
        return {}
    return {key: os.environ.get(key, value) for key, value in OPENMP_ENV.items()}


def apply_process_env() -> bool:
    """Set ``OPENMP_ENV`` in this process's environment where unset.

    Takes effect only if torch (libgomp) is not imported yet: returns False when it
    already was (nothing is changed then, so the process's behaviour stays consistent).
    """
    if "torch" in sys.modules:
        return False
    for key, value in process_env().items():
        os.environ.setdefault(key, value)
    return True


def keep_heap_memory() -> bool:
    """Tell glibc malloc to reuse large freed blocks instead of returning them to the kernel.

    Idempotent; returns True when the setting is in force (glibc, tuning not turned off),
    False otherwise. Never raises.
    """
    global _heap_done
    if _heap_done:
        return True
    if not _enabled() or not _is_glibc():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, HEAP_THRESHOLD_BYTES) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, HEAP_THRESHOLD_BYTES) == 1 and ok
    except (OSError, AttributeError) as exc:  # no libc to load, or no mallopt in it
        log.debug("malloc tuning unavailable: %s", exc)
        return False
    _heap_done = ok
    return bool(ok)


def _is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")  # type: ignore[union-attr]
    except (ValueError, OSError, AttributeError):  # not a GNU libc (or not POSIX)
        return False
