"""Pseudo-pair queries on a Ray actor pool (``pairclean pseudo-pair --executor ray``).

The driver (``pairclean.pseudo.pairing.pseudo_pair``) builds each FAISS index once; ``RaySearcher``
serialises it (``faiss.serialize_index``: one numpy byte array), puts it in Ray's object
store once and hands each actor the reference. An actor deserialises an index the first
time it sees it and keeps it until the next one, so the index crosses the network once per
actor. A task is one query chunk of ``pairclean.pseudo.ann.query_chunks``: the names of the
sidecars holding its rows and the rows in them (``Pool.segments``); the actor reads those
query vectors from the output folder itself (local or object store), so no embedding
passes through the driver or the object store, and returns FAISS's top ``fetch`` ids and
scores. The driver re-ranks (IVF-PQ) and drops each query's own pair as the local path
does: same chunks, same FAISS inputs, same output.

Memory: every actor holds a whole copy of the index (64 bytes a vector for IVF-PQ), so the
default is one actor per Ray node, using the node's CPUs as FAISS threads. At most
``num_actors * tasks_per_actor`` chunks are in flight. A chunk whose actor dies is retried
on a fresh actor up to ``max_retries`` times (a search has no side effects); then the run
fails and a rerun starts over (``pseudo_pair`` writes nothing before the search ends).

Pools smaller than ``min_pool`` are searched in the driver: Ray's start-up would cost
more than the search (a flat index of 20,000 is seconds).
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from numpy.typing import NDArray

from pairclean.pseudo.ann import IndexPlan, RawSearch, query_chunks
from pairclean.errors import PaircleanError
from pairclean.output.folder import OutputDir
from pairclean.pseudo.pairing import Pool

if TYPE_CHECKING:  # ray_exec imports the estimators (torch): not needed to parse the CLI
    from .ray_exec import RayOptions

__all__ = ["RAY_MIN_POOL", "QuerySearcher", "RaySearcher"]

log = logging.getLogger(__name__)

#: Smallest pool whose queries go to Ray by default (``--ray-min-pool``).
RAY_MIN_POOL: Final = 20_000

Segments = list[tuple[str, NDArray[np.int64]]]


class QuerySearcher:
    """What one actor does: hold the current index; search query rows it reads from the
    sidecars of ``out``. A plain class, testable without Ray."""

    def __init__(self, out: OutputDir, threads: int | None) -> None:
        import faiss

        if threads:
            faiss.omp_set_num_threads(int(threads))  # Ray sets OMP_NUM_THREADS=1 in workers
        self.out = out
        self.key: str | None = None
        self.index: Any = None

    def load(self, key: str, blob: NDArray[np.uint8]) -> None:
        """Make the serialised index ``blob`` (named ``key``) the current one."""
        import faiss

        self.index, self.key = None, None  # free the old one before building the new one
        self.index, self.key = faiss.deserialize_index(np.asarray(blob)), key

    def search(self, key: str, blob_box: list[Any], segments: Segments, modality: str, fetch: int,
               nprobe: int | None) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
        """FAISS's top ``fetch`` ``(scores, ids)`` of the ``modality`` rows ``segments``.

        ``blob_box`` holds the index's object reference (boxed, so Ray does not fetch it
        for calls that find it loaded already).
        """
        from pairclean.pseudo.pairing import read_rows

        if self.key != key:
            import ray

            self.load(key, ray.get(blob_box[0]))
        if nprobe is not None:
            self.index.nprobe = nprobe
        # float16 as stored in the pool, then float32 as the local path hands it to FAISS.
        queries = np.ascontiguousarray(read_rows(self.out, segments, modality), dtype=np.float32)
        return self.index.search(queries, fetch)


class RaySearcher:
    """A ``pairclean.pseudo.pairing.PoolSearcher`` on a Ray actor pool; use as a context manager
    (the actors are started on the first large pool and killed on exit)."""

    name = "ray"  # what ``PseudoReport.executor`` says when the queries ran here

    def __init__(self, out: OutputDir, options: RayOptions, min_pool: int = RAY_MIN_POOL) -> None:
        self.out, self.options, self.min_pool = out, options, min_pool
        self.actors: list[Any] = []
        self._cls: Any = None
        self._threads: int | None = None

    def __enter__(self) -> RaySearcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the actors (Ray itself stays up for the rest of the process)."""
        if self.actors:
            import ray

            for actor in self.actors:
                ray.kill(actor)
            self.actors = []

    @property
    def num_actors(self) -> int:
        return len(self.actors)

    def _start(self) -> None:
        import ray

        from .ray_exec import init_ray

        init_ray(self.options)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        cpus = int(ray.cluster_resources().get("CPU", 1))
        n = self.options.num_actors or max(1, len(nodes))
        self._threads = self.options.threads_per_actor or max(1, cpus // n)
        self._cls = ray.remote(QuerySearcher)
        self.actors = [self._new_actor() for _ in range(n)]

    def _new_actor(self) -> Any:
        # SPREAD: one actor per node by default, each with its own copy of the index.
        opts: dict[str, Any] = {"num_cpus": self.options.cpus_per_actor, "max_restarts": 0, "scheduling_strategy": "SPREAD"}
        if self.options.actor_resources:
            opts["resources"] = dict(self.options.actor_resources)
        return self._cls.options(**opts).remote(self.out, self._threads)

    def __call__(self, pool: Pool, index: Any, plan: IndexPlan, modality: str) -> RawSearch | None:
        """The raw search of ``pool``'s ``modality`` rows against ``index`` on the actors, or
        None (search in the driver) for a pool below ``min_pool``."""
        if pool.size < self.min_pool:
            return None
        import faiss
        import ray

        if not self.actors:
            self._start()
        cpu_index = faiss.index_gpu_to_cpu(index) if plan.device == "gpu" else index
        # Boxed: a bare reference argument would be fetched for every call.
        box = [ray.put(faiss.serialize_index(cpu_index))]
        key = uuid.uuid4().hex

        def raw(fetch: int, chunk: int) -> Iterator[tuple[int, NDArray[np.float32], NDArray[np.int64]]]:
            tasks = [(start, pool.segments(start, stop)) for start, stop in query_chunks(pool.size, chunk)]
            yield from self._run(tasks, key, box, modality, fetch, plan.nprobe)

        return raw

    def _run(self, tasks: list[tuple[int, Segments]], key: str, box: list[Any], modality: str, fetch: int,
             nprobe: int | None) -> Iterator[tuple[int, NDArray[np.float32], NDArray[np.int64]]]:
        import ray

        from .ray_exec import get_result

        queue: deque[tuple[int, Segments, int]] = deque((start, seg, 1) for start, seg in tasks)
        running: dict[Any, tuple[int, Segments, int, int, Any]] = {}
        load = [0] * len(self.actors)
        # Same scheduling as refine_exec: least-loaded actor first, bounded chunks in flight.
        while queue or running:
            while queue and min(load) < self.options.tasks_per_actor:
                slot = load.index(min(load))
                start, seg, attempt = queue.popleft()
                ref = self.actors[slot].search.remote(key, box, seg, modality, fetch, nprobe)
                running[ref] = (start, seg, attempt, slot, self.actors[slot])
                load[slot] += 1
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                start, seg, attempt, slot, actor = running.pop(ref)
                load[slot] -= 1
                try:
                    d, i = get_result(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
                    if attempt > self.options.max_retries:
                        raise PaircleanError(f"searching pool rows from {start} lost its worker {attempt} times: {exc}") from exc
                    log.warning("worker lost while searching pool rows from %d (attempt %d): %s", start, attempt, exc)
                    if self.actors[slot] is actor:  # its other chunks fail too: replace it once
                        self.actors[slot] = self._new_actor()
                    queue.append((start, seg, attempt + 1))
                    continue
                yield start, d, i
