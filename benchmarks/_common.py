"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["flickr_root", "bench_spec", "timed_run"]


def flickr_root() -> Path:
    """The Flickr8k folder, or exit with how to provide it."""
    from pairclean.lite.evaldata import find_flickr8k

    root = find_flickr8k(Path(__file__))
    if root is None:
        sys.exit("Flickr8k not found: set PAIRCLEAN_FLICKR8K or keep ../shared beside the repo")
    return root


def bench_spec(shards: list[str], model: str, batch_size: int, precision: str = "auto") -> Any:
    """A job spec with the reference recipe (random-inputs beta, paper weighting)."""
    from pairclean.spec import JobSpec

    return JobSpec(tuple(shards), model, None, None, precision, "random-inputs", 256, "paper", 0, batch_size, 64_000_000, None, True, 4096)


class _Timer:
    """Progress sink: from the first shard's start (model loaded, beta known) to the last commit."""

    first = last = 0.0

    def start(self, total_shards: int, already_done: int) -> None:
        self.first = time.perf_counter()

    def shard_done(self, record: Any) -> None:
        self.last = time.perf_counter()

    def shard_failed(self, uri: str, error: str, attempts: int = 1) -> None:
        raise RuntimeError(error)


def timed_run(spec: Any, out: Path, make_source: Callable[[Any], Any]) -> tuple[float, int, Any]:
    """Run a job into ``out``; ``make_source(output_dir)`` builds the source. Returns
    (pairs/s of the scoring loop, pairs, the job report)."""
    from pairclean.output.folder import OutputDir

    from pairclean.job.runner import run_job

    timer = _Timer()
    folder = OutputDir(str(out))
    report = run_job(spec, folder, lambda: make_source(folder), progress=timer)
    return report.pairs / (timer.last - timer.first), report.pairs, report
