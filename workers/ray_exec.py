"""Scoring on Ray: a pool of actors that each load the estimator once and write their own outputs.

The shard is the unit of work. Each actor holds a ``pairclean.job.work.ShardWork``: it reads,
decodes (a thread pool sized to the CPUs Ray gives the actor) and embeds whole shards,
applies the frozen calibration and writes the score table and sidecar straight into the
output folder (local or object store). The driver (``pairclean.job.runner.run_job``) gets back
only a small ``ShardRecord`` per shard and writes the completion record, so every shard
is committed exactly once and no embedding passes through the driver or Ray's object store.

Fault tolerance: an actor that dies (its process, or its whole node) or overruns
``shard_timeout_s`` and is killed is replaced and its shard retried after an exponential
backoff, up to ``max_retries`` times; then the shard is quarantined with its last error. A
shard that is unreadable (an ``InputError`` raised by the reader) is quarantined at once:
retrying cannot help. A retried shard rewrites the same bytes, so a worker lost after
writing but before reporting leaves nothing half-done. At most ``num_actors *
tasks_per_actor`` shards are in flight, which bounds memory whatever the corpus size.

All Ray-specific options live in ``RayOptions``; ``ShardScorer`` is a plain class, so the
actor's logic is testable without Ray.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pairclean.embed.cpu_settings import process_env
from pairclean.errors import InputError, ModelLoadError, PaircleanError
from pairclean.embed.estimators import EstimatorSpec, load_estimator
from pairclean.calibrate.calibration import Calibration
from pairclean.spec import JobSpec
from pairclean.output.folder import OutputDir
from pairclean.embed.shard import ScoreOptions
from pairclean.job.work import CalibrationOutcome, ShardOutcome, ShardWork

__all__ = ["RayOptions", "ShardScorer", "RaySource", "init_ray"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RayOptions:
    """Where and how to run on Ray.

    ``address``: an existing cluster (``ray://`` or ``host:port``); None starts a local Ray
    sized to this machine (or joins ``$RAY_ADDRESS``). ``num_actors``: scoring actors
    (default: one per GPU, else one per 2 CPUs, at least 1). ``threads_per_actor``: torch
    threads in each actor (Ray sets OMP_NUM_THREADS=1, which would starve the model).
    ``tasks_per_actor``: shards handed to an actor at once (one running, the rest queued),
    which with the actor count bounds the shards in flight, and so memory.
    """

    address: str | None = None
    num_actors: int | None = None
    threads_per_actor: int | None = None
    cpus_per_actor: float = 1.0
    max_retries: int = 3
    backoff_s: float = 1.0
    shard_timeout_s: float | None = None
    tasks_per_actor: int = 2
    runtime_env: dict[str, Any] = field(default_factory=dict)
    #: Custom Ray resources each actor needs (e.g. ``{"scoring_node": 1}`` to keep actors
    #: off the head node).
    actor_resources: dict[str, float] = field(default_factory=dict)


class ShardScorer:
    """What one actor does: load the estimator once, then calibrate or score shards on request."""

    def __init__(self, estimator_spec: EstimatorSpec, spec: JobSpec, out: OutputDir, options: ScoreOptions, threads: int | None) -> None:
        import torch

        torch.set_num_threads(threads or os.cpu_count() or 1)
        self.work = ShardWork(load_estimator(estimator_spec), spec, out, options)
        self._warm_up()

    def _warm_up(self) -> None:
        """One small forward pass, so the first shard does not pay for kernel set-up."""
        import torch

        estimator = self.work.estimator
        size = estimator.image_size
        estimator.encode_images(torch.zeros((2, 3, size, size)))
        estimator.encode_texts(["warm up", "a photo"])

    def model_info(self) -> dict[str, Any]:
        return self.work.model_info

    def calibrate(self, uris: Sequence[str], time_limit_s: float | None = None) -> CalibrationOutcome:
        return self.work.calibrate(uris, time_limit_s)

    def score(self, uri: str, calibration: Calibration) -> Any:
        return self.work.score(uri, calibration)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def get_result(ref: Any) -> Any:
    """``ray.get(ref)``, except that a task that failed with a ``PaircleanError`` (a clear,
    one-line error about the input) raises that error itself, not Ray's wrapper with the
    remote traceback: the CLI prints it as one line."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, PaircleanError):
            raise cause from None
        raise


#: Ray settings for a local cluster pairclean starts itself: no idle Python workers
#: started ahead (the pool makes its own actors; each prestarted worker imports Ray's
#: Python side on a CPU the actors need: 1.3 CPU s per job on the 2-core benchmark).
LOCAL_RAY_ENV = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}
#: Ray's variable choosing its authentication mode ("token" or "disabled").
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"


def init_ray(options: RayOptions) -> None:
    """Connect to ``options.address`` / ``$RAY_ADDRESS``, or start a local Ray in-process."""
    address = options.address or os.environ.get("RAY_ADDRESS") or None
    if address is None and RAY_AUTH_MODE_ENV not in os.environ:
        _token_auth_for_local_ray()
    if address is None:
        for key, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(key, value)  # read by the raylet this process starts; a user's value wins
    import ray

    if ray.is_initialized():
        return
    if address is not None:
        _check_reachable(address)
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": False}
    runtime_env = _with_cpu_env(options.runtime_env)
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    ray.init(address=address, **kwargs)
    from pairclean_workers.signals import reinstall

    reinstall()  # Ray's own SIGTERM handler dumps native stacks: ours stops the run with one line


#: Seconds to wait for a TCP connection to a cluster's GCS before saying it cannot be reached.
CONNECT_TIMEOUT_S = 10.0


def _check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """``InputError`` (one line) when ``address`` (``host:port`` of a cluster's GCS) takes no
    TCP connection within ``timeout_s``. ``ray.init`` itself retries a wrong address without
    end, printing C++ warnings (a job would stay RUNNING forever). ``auto`` and ``ray://``
    addresses are left to Ray: the first is found locally, the second fails on its own."""
    import socket

    host, sep, port = address.rpartition(":")
    if address in ("auto", "local") or "://" in address or not sep or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except OSError as exc:
        raise InputError(f"cannot reach the Ray cluster at {address!r} ({exc.strerror or type(exc).__name__}); "
                         "check --ray-address or RAY_ADDRESS, or leave both unset for a local Ray") from None


def _token_auth_for_local_ray() -> None:
    """Say ``RAY_AUTH_MODE=token`` for a local cluster this process starts.

    Ray turns token authentication on by default for a new local cluster and warns about
    it on every start while the variable is unset. Setting it keeps exactly that (Ray
    creates ``~/.ray/auth_token`` when missing) without the warning; a user's own value
    (``disabled``) is never replaced. Ray reads the variable into its C++ config when
    ``ray`` is first imported: if it already was, the config is re-read, as Ray's own
    ``_enable_token_auth`` does; if that private call is gone, the variable is taken back
    (and Ray warns as before) rather than leaving the two disagreeing.
    """
    import sys

    os.environ[RAY_AUTH_MODE_ENV] = "token"
    if "ray._raylet" not in sys.modules:
        return
    try:
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError, RuntimeError):
        del os.environ[RAY_AUTH_MODE_ENV]


def _with_cpu_env(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """``runtime_env`` plus pairclean's CPU environment (``pairclean.embed.cpu_settings``) in its
    ``env_vars``; variables the caller sets there win. The actors' libgomp reads them when
    they import torch, which an environment variable set in ``__init__`` would be too late for."""
    # the service's limits last: a runtime_env the caller passes cannot lift them
    env_vars = {**process_env(), **dict(runtime_env.get("env_vars") or {}), **_guard_env()}
    return {**runtime_env, "env_vars": env_vars} if env_vars else dict(runtime_env)


def _guard_env() -> dict[str, str]:
    """The limits a service put on this job process (allow-lists of local paths and of HTTP
    redirects, the shard count), for the actors too: they open the shards and write the
    tables, and on a cluster they do not inherit this process's environment."""
    from pairclean.uris import HTTP_ALLOWED_ENV, LOCAL_READ_ROOTS_ENV, LOCAL_WRITE_ROOTS_ENV, MAX_SHARDS_ENV

    return {name: os.environ[name] for name in (HTTP_ALLOWED_ENV, LOCAL_READ_ROOTS_ENV, LOCAL_WRITE_ROOTS_ENV, MAX_SHARDS_ENV)
            if os.environ.get(name)}


@dataclass
class _Task:
    uri: str
    attempt: int
    slot: int  # index of the actor in the pool
    actor: Any  # the handle it was sent to (the slot may have been refilled since)
    ref: Any
    started: float  # when it began running (or was queued behind nothing)


class RaySource:
    """A ``pairclean.job.runner.ShardSource`` backed by a pool of Ray actors.

    Each actor holds up to ``tasks_per_actor`` shards: one running and the next queued in
    its mailbox, so it never idles while the driver commits. A queued shard's timeout
    clock starts when the shard before it finishes.
    """

    def __init__(self, estimator_spec: EstimatorSpec, spec: JobSpec, out: OutputDir, score_opts: ScoreOptions, options: RayOptions) -> None:
        import ray

        init_ray(options)
        self.ray = ray
        self.options = options
        self.estimator_spec = estimator_spec
        self.spec = spec
        self.out = out
        # Decode on as many threads as the CPUs Ray reserves for the actor.
        self.score_opts = replace(score_opts, decode_workers=max(1, int(options.cpus_per_actor)))
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        cpus = int(resources.get("CPU", 1))
        self.use_gpu = gpus > 0 and estimator_spec.device in ("auto", "cuda")
        # Leave a CPU for the driver and the readers' threads on small machines.
        default_actors = gpus if self.use_gpu else max(1, cpus // 2)
        self.num_actors = options.num_actors or default_actors
        self.threads = options.threads_per_actor or max(1, min(os.cpu_count() or 1, cpus // self.num_actors))
        self.tasks_per_actor = max(1, options.tasks_per_actor)
        self.actor_cls = ray.remote(ShardScorer)
        self.retries = 0  # shard retries so far (workers lost, timeouts, unexpected errors)
        self._loading: dict[int, Any] = {}  # id(actor) -> its readiness ref, until it resolves
        self.actors: list[Any] = [self._new_actor() for _ in range(self.num_actors)]
        self.load: list[int] = [0] * self.num_actors
        try:
            self._info = ray.get(self.actors[0].model_info.remote())
        except ray.exceptions.RayActorError as exc:
            # The actor's __init__ (the model load) failed: that is a job-level error.
            raise ModelLoadError(f"the scoring actor could not load the estimator: {exc}") from exc

    def _new_actor(self) -> Any:
        opts: dict[str, Any] = {"num_cpus": self.options.cpus_per_actor, "max_restarts": 0, "max_concurrency": 1}
        # Also per actor: Ray may have been started by someone else (merged with the job's env).
        env = _with_cpu_env({"env_vars": self.options.runtime_env.get("env_vars") or {}})
        if env.get("env_vars"):
            opts["runtime_env"] = env
        if self.use_gpu:
            opts["num_gpus"] = 1
        if self.options.actor_resources:
            opts["resources"] = dict(self.options.actor_resources)
        actor = self.actor_cls.options(**opts).remote(self.estimator_spec, self.spec, self.out, self.score_opts, self.threads)
        # Resolves once the actor's __init__ (the model load) is done: no shard's clock runs before.
        self._loading[id(actor)] = actor.pid.remote()
        return actor

    def _ready(self, actor: Any) -> bool:
        """Whether ``actor`` has finished loading (checked without waiting)."""
        ref = self._loading.get(id(actor))
        if ref is None:
            return True
        done, _ = self.ray.wait([ref], timeout=0)
        if done:
            del self._loading[id(actor)]
        return bool(done)

    def _replace(self, task: _Task) -> None:
        """Refill the slot of a lost actor, once (its other tasks fail the same way)."""
        if self.actors[task.slot] is task.actor:
            self.actors[task.slot] = self._new_actor()

    def model_info(self) -> dict[str, Any]:
        return self._info

    def calibrate(self, uris: Sequence[str]) -> CalibrationOutcome:
        """The calibration phase on one actor; retried (from the start: it is deterministic)
        when the actor is lost."""
        ray = self.ray
        for attempt in range(1, self.options.max_retries + 2):
            actor = self.actors[0]
            try:
                # The calibration reads its shards in one task: each is held to --shard-timeout by
                # the reader itself (killing the task would retry the whole phase), as under the
                # local executor; without it a huge first shard was read whole, and calibrated on.
                return get_result(actor.calibrate.remote(list(uris), self.options.shard_timeout_s))
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError) as exc:
                log.warning("worker lost during calibration (attempt %d): %s", attempt, exc)
                if self.actors[0] is actor:
                    self.actors[0] = self._new_actor()
                self.retries += 1
                time.sleep(self.options.backoff_s * 2 ** (attempt - 1))
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if hasattr(exc, "cause") else exc
                if isinstance(cause, InputError):
                    raise cause from None
                raise
        raise ModelLoadError(f"the calibration phase lost its worker {self.options.max_retries + 1} times")

    def actor_pids(self) -> list[int]:
        """PIDs of the pool's actor processes (for fault-injection tests)."""
        return [self.ray.get(a.pid.remote()) for a in self.actors]

    def results(self, uris: Sequence[str], calibration: Calibration) -> Iterator[ShardOutcome]:
        """Score ``uris`` on the pool with the frozen ``calibration``; yields one outcome per
        URI as shards finish."""
        self._calibration = self.ray.put(calibration)
        ray = self.ray
        queue: deque[tuple[str, int, float]] = deque((u, 1, 0.0) for u in uris)  # uri, attempt, not-before
        running: dict[Any, _Task] = {}
        while queue or running:
            self._submit_ready(queue, running)
            if not running:
                time.sleep(0.05)  # everything queued is backing off
                continue
            done, _ = ray.wait(list(running), num_returns=1, timeout=self._wait_timeout(running))
            for ref in done:
                task = running.pop(ref)
                self.load[task.slot] -= 1
                self._restart_clock(task, running)
                outcome = self._collect(task, queue)
                if outcome is not None:
                    yield outcome
            yield from self._expire(running, queue)

    def _restart_clock(self, finished: _Task, running: dict[Any, _Task]) -> None:
        now = time.monotonic()
        for task in running.values():
            if task.actor is finished.actor:
                task.started = now

    def _wait_timeout(self, running: dict[Any, _Task]) -> float:
        """Wake up no later than the nearest shard deadline, so stragglers are caught on time."""
        limit = self.options.shard_timeout_s
        if limit is None:
            return 0.5
        nearest = min(task.started for task in running.values()) + limit
        return max(0.005, min(0.5, nearest - time.monotonic()))

    def _submit_ready(self, queue: deque[tuple[str, int, float]], running: dict[Any, _Task]) -> None:
        now = time.monotonic()
        for _ in range(len(queue)):
            slot = min(range(self.num_actors), key=self.load.__getitem__)
            if self.load[slot] >= self.tasks_per_actor:
                return
            uri, attempt, not_before = queue.popleft()
            if not_before > now:
                queue.append((uri, attempt, not_before))
                continue
            actor = self.actors[slot]
            ref = actor.score.remote(uri, self._calibration)
            self.load[slot] += 1
            running[ref] = _Task(uri, attempt, slot, actor, ref, now)

    def _collect(self, task: _Task, queue: deque[tuple[str, int, float]]) -> ShardOutcome | None:
        ray = self.ray
        try:
            result = ray.get(task.ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if hasattr(exc, "cause") else exc
            if isinstance(cause, InputError):
                return ShardOutcome(task.uri, None, str(cause), task.attempt)
            if isinstance(cause, KeyboardInterrupt):
                # Ctrl-C reaches the actors too (one process group), and one may report
                # before the driver sees its own: the run is being stopped, the shard is
                # healthy. It stays pending (never quarantined); the CLI exits 130.
                raise KeyboardInterrupt from None
            return self._retry(task, queue, f"{type(cause).__name__}: {cause}")
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError) as exc:
            log.warning("worker lost while scoring %s (attempt %d): %s", task.uri, task.attempt, exc)
            self._replace(task)
            return self._retry(task, queue, f"worker died: {type(exc).__name__}")
        return ShardOutcome(task.uri, result, None, task.attempt)

    def _retry(self, task: _Task, queue: deque[tuple[str, int, float]], error: str) -> ShardOutcome | None:
        if task.attempt > self.options.max_retries:
            return ShardOutcome(task.uri, None, f"{error} (after {task.attempt} attempts)", task.attempt)
        self.retries += 1
        delay = self.options.backoff_s * 2 ** (task.attempt - 1)
        queue.append((task.uri, task.attempt + 1, time.monotonic() + delay))
        return None

    def _expire(self, running: dict[Any, _Task], queue: deque[tuple[str, int, float]]) -> list[ShardOutcome]:
        """Kill the workers of shards running longer than the timeout; retry or give up.

        A shard's clock runs only while it runs: not while its actor is still loading the
        model (a replacement's start), nor while it waits behind another shard on the same
        actor (each actor runs one at a time, in the order sent). Shards waiting behind a
        killed one go back to the queue without an attempt charged.
        """
        limit = self.options.shard_timeout_s
        if limit is None:
            return []
        now, given_up = time.monotonic(), []
        heads: set[int] = set()
        for ref, task in list(running.items()):  # in the order sent: the first per actor is the one running
            if ref not in running:
                continue
            head = id(task.actor) not in heads
            heads.add(id(task.actor))
            if not head or not self._ready(task.actor):
                task.started = now  # not running yet: its clock has not started
                continue
            if now - task.started <= limit:
                continue
            log.warning("shard %s exceeded %.0f s: killing its worker", task.uri, limit)
            running.pop(ref)
            self.load[task.slot] -= 1
            self.ray.kill(task.actor, no_restart=True)
            for other_ref, other in list(running.items()):
                if other.actor is task.actor:  # waited behind it: lost with the actor, through no fault of its own
                    running.pop(other_ref)
                    self.load[other.slot] -= 1
                    queue.appendleft((other.uri, other.attempt, 0.0))
            self._replace(task)
            outcome = self._retry(task, queue, f"timed out after {limit:.0f} s")
            if outcome is not None:
                given_up.append(outcome)
        return given_up
