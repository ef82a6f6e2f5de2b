"""The command-line flags every batch verb shares, spelled once.

``score``, ``refine``, ``pseudo-pair`` (and the verbs that come later) take the same
execution, lock, seed and storage flags; defining them here keeps their names, defaults and
help text from drifting apart between verbs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from pairclean.errors import InputError

__all__ = [
    "add_storage_arg",
    "storage_options",
    "add_executor_args",
    "add_threads_arg",
    "add_lock_ttl_arg",
    "add_seed_arg",
    "fraction",
    "positive_seconds",
]

_Adder = argparse.ArgumentParser | argparse._ArgumentGroup


def add_storage_arg(p: _Adder) -> None:
    """``--storage-option KEY=VALUE`` (repeatable): fsspec options for remote shards and outputs."""
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE", type=_key_value,
                   help="fsspec option for remote shards and outputs, e.g. endpoint_url=http://... (repeatable)")


def _key_value(text: str) -> str:
    """An argparse type: ``KEY=VALUE`` with a key (a usage error, exit 2, otherwise)."""
    if not text.partition("=")[0] or "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    return text


def storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings -> fsspec options; JSON values (lists, objects, true/false) are
    parsed. Raises ``InputError`` (a one-line message) for a pair without ``=``."""
    opts: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InputError(f"--storage-option expects KEY=VALUE, got {pair!r}")
        opts[key] = json.loads(value) if value[:1] in "[{" or value in ("true", "false") else value
    return opts


def add_executor_args(p: _Adder, actors: str, executor_note: str = "") -> None:
    """``--executor ray|local``, ``--ray-address`` and ``--num-actors``; ``actors`` says what
    the actors do and their default count (e.g. "scoring actors (default: one per GPU...)")."""
    p.add_argument("--executor", choices=("ray", "local"), default="ray",
                   help="ray (default: a local Ray, or --ray-address" + (f"; {executor_note}" if executor_note else "")
                   + ") or local (this process only)")
    p.add_argument("--ray-address", default=None, help="existing Ray cluster (default: $RAY_ADDRESS, else start one here)")
    p.add_argument("--num-actors", type=positive_int, default=None, help=actors)


def add_threads_arg(p: _Adder, what: str) -> None:
    """``--threads N``: ``what`` names the threads it sets and their default."""
    p.add_argument("--threads", type=positive_int, default=None, help=what)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (``--threads -2`` ended in torch's
    traceback, ``--num-actors 0`` was taken)."""
    return _whole_at_least(text, 1)


def whole_at_least(least: int, most: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [least, most] (a usage error, one line, otherwise)."""
    def parse(text: str) -> int:
        value = _whole_at_least(text, least)
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"expected a whole number of at most {most:,}, not {text}")
        return value

    return parse


def caption_field_name(text: str) -> str:
    """An argparse type: a json field name, or ``.ext`` for a member (the REST API's rule:
    a letter, digit or ``_`` first, then at most 63 of those, ``.`` or ``-``). ``""`` was
    taken as a field and every sample failed "no txt member or json caption"."""
    if not re.fullmatch(r"\.?[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", text):
        raise argparse.ArgumentTypeError(f"expected a json field name or .ext, not {text!r}")
    return text


def device_name(text: str) -> str:
    """An argparse type: ``auto``, ``cpu``, ``mps``, ``cuda`` or ``cuda:N`` (``--device bogus``
    ended in torch's traceback, or was ignored where no model is loaded)."""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, mps, cuda or cuda:N, not {text!r}")
    return text


def _whole_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least {least}, not {text}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1] (a usage error, one line, otherwise)."""
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], not {text}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, not {text}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, not {text}")
    return value


def add_lock_ttl_arg(p: _Adder) -> None:
    """``--lock-ttl S``: when a crashed run's lock on the output folder is taken over."""
    p.add_argument("--lock-ttl", type=positive_seconds, default=None,
                   help="seconds without a heartbeat after which a crashed run's lock on the output folder is taken "
                        "over (default 60, or $PAIRCLEAN_LOCK_TTL_S)")


def seed(text: str) -> int:
    """An argparse type: a whole number of at least 0 (numpy's generators take no negative seed)."""
    return _whole_at_least(text, 0)


def add_seed_arg(p: _Adder, default: int | None = 0, what: str = "random seed") -> None:
    """``--seed N``; ``what`` says what it seeds."""
    p.add_argument("--seed", type=seed, default=default, help=what)
