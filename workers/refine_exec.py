"""Applying fitted refine heads on a Ray actor pool (``pairclean refine --executor ray``).

Each actor loads the heads once and applies them to whole shards
(``pairclean.refine.run.apply_shard``), writing the rewritten score table straight into
the output folder; the driver gets back a small ``ShardApplied`` and writes the refine
record. At most ``num_actors * tasks_per_actor`` shards are in flight. A shard whose actor
dies is retried on a fresh actor (the rewrite is deterministic, so a retry writes the
same bytes) up to ``max_retries`` times; then the refine fails and a rerun resumes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

from pairclean.errors import PaircleanError
from pairclean.output.folder import OutputDir, ShardRecord
from pairclean.refine.run import Executor, ShardApplied

from .ray_exec import RayOptions, get_result, init_ray

__all__ = ["ShardRefiner", "ray_executor"]

log = logging.getLogger(__name__)


class ShardRefiner:
    """What one actor does: hold the heads, apply them to shards on request."""

    def __init__(self, out: OutputDir, heads: bytes, doc: dict[str, Any], threads: int | None) -> None:
        import torch

        from pairclean.refine import heads_from_bytes

        torch.set_num_threads(threads or 1)
        self.out, self.doc = out, doc
        self.heads = heads_from_bytes(heads)

    def apply(self, record: ShardRecord) -> ShardApplied:
        from pairclean.refine.run import apply_shard

        return apply_shard(self.out, record, self.heads, self.doc)


def ray_executor(out: OutputDir, options: RayOptions) -> Executor:
    """An ``Executor`` that spreads shards over a pool of ``ShardRefiner`` actors."""

    def run(records: list[ShardRecord], heads: bytes, doc: dict[str, Any]) -> Iterator[ShardApplied]:
        import ray

        init_ray(options)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        n = options.num_actors or max(1, min(len(records), cpus))
        threads = options.threads_per_actor or max(1, cpus // n)
        cls = ray.remote(ShardRefiner)
        heads_ref = ray.put(heads)

        def new_actor() -> Any:
            return cls.options(num_cpus=options.cpus_per_actor, max_restarts=0).remote(out, heads_ref, doc, threads)

        actors = [new_actor() for _ in range(n)]
        queue: deque[tuple[ShardRecord, int]] = deque((r, 1) for r in records)
        running: dict[Any, tuple[ShardRecord, int, int]] = {}
        load = [0] * n
        try:
            while queue or running:
                while queue and min(load) < options.tasks_per_actor:
                    slot = load.index(min(load))
                    record, attempt = queue.popleft()
                    running[actors[slot].apply.remote(record)] = (record, attempt, slot)
                    load[slot] += 1
                done, _ = ray.wait(list(running), num_returns=1)
                for ref in done:
                    record, attempt, slot = running.pop(ref)
                    load[slot] -= 1
                    try:
                        yield get_result(ref)
                    except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
                        if attempt > options.max_retries:
                            raise PaircleanError(f"refining {record.stem} lost its worker {attempt} times: {exc}") from exc
                        log.warning("worker lost while refining %s (attempt %d): %s", record.stem, attempt, exc)
                        actors[slot] = new_actor()
                        queue.append((record, attempt + 1))
        finally:
            for actor in actors:
                ray.kill(actor)

    return run
