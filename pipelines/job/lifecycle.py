"""The job lifecycle in one place: states, the transitions allowed between them, and the
batch CLI's exit codes for the end states.

    QUEUED ──> RUNNING ──> SUCCEEDED | PARTIAL | FAILED | CANCELLED
      │          └──> QUEUED (the service restarted: resume)
      └──> CANCELLED | FAILED (cancelled before it ran, or its process could not start)
    PARTIAL | FAILED ──> QUEUED (retry: only uncommitted shards are redone)

``pairclean_service`` stores these states and refuses any other move
(``JobStore.transition``); the runner maps the ``pairclean score`` exit code to a state
with ``state_for_exit``.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = [
    "QUEUED", "RUNNING", "SUCCEEDED", "PARTIAL", "FAILED", "CANCELLED",
    "State", "STATES", "TERMINAL", "ACTIVE", "TRANSITIONS", "EXIT_CODES", "EXIT_ERROR", "IllegalTransition",
    "can_move", "state_for_exit",
]

QUEUED: Final = "QUEUED"
RUNNING: Final = "RUNNING"
SUCCEEDED: Final = "SUCCEEDED"
PARTIAL: Final = "PARTIAL"
FAILED: Final = "FAILED"
CANCELLED: Final = "CANCELLED"
STATES: Final = (QUEUED, RUNNING, SUCCEEDED, PARTIAL, FAILED, CANCELLED)
#: The states as a type, for schemas (``typing.get_args(State) == STATES``, tested).
State = Literal["QUEUED", "RUNNING", "SUCCEEDED", "PARTIAL", "FAILED", "CANCELLED"]
TERMINAL: Final = frozenset({SUCCEEDED, PARTIAL, FAILED, CANCELLED})
#: States in which a job holds its output location.
ACTIVE: Final = (QUEUED, RUNNING)

TRANSITIONS: Final[dict[str, frozenset[str]]] = {
    QUEUED: frozenset({RUNNING, CANCELLED, FAILED}),
    RUNNING: frozenset({SUCCEEDED, PARTIAL, FAILED, CANCELLED, QUEUED}),
    PARTIAL: frozenset({QUEUED}),
    FAILED: frozenset({QUEUED}),
    SUCCEEDED: frozenset(),
    CANCELLED: frozenset(),
}

#: ``pairclean score`` exit codes of the end states (1 is a usage or input error).
EXIT_CODES: Final = {SUCCEEDED: 0, FAILED: 3, PARTIAL: 4}
#: The exit code of a job-level error before any end state (bad input, a model that cannot load).
EXIT_ERROR: Final = 1


class IllegalTransition(ValueError):
    """A state change the lifecycle does not allow (a bug in the caller, not user input)."""


def can_move(from_state: str, to_state: str) -> bool:
    """Whether a job may go from ``from_state`` to ``to_state``."""
    return to_state in TRANSITIONS.get(from_state, frozenset())


def state_for_exit(code: int) -> str:
    """The job state a ``pairclean score`` exit code means (anything unknown is FAILED)."""
    return next((state for state, exit_code in EXIT_CODES.items() if exit_code == code), FAILED)
