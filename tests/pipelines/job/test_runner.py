"""``pairclean.job.runner``: real jobs through ``run_job`` with the local source, the tiny
real model and real shards cut from the bundled demo sample."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from pairclean import osa, schema
from pairclean.calibrate.calibration import Calibration
from pairclean.embed.estimators import Estimator
from pairclean.errors import ForeignOutputError, OutputBusyError, SpecMismatchError
from pairclean.job.lifecycle import EXIT_CODES, FAILED, PARTIAL, SUCCEEDED, state_for_exit
from pairclean.job.runner import JobReport, LocalSource, run_job, score_options
from pairclean.job.work import CalibrationOutcome, ShardOutcome
from pairclean.output.folder import OutputDir
from pairclean.spec import JobSpec
from pairclean.storage import sha256_file


class Watched:
    """The real ``LocalSource``, with a note of what the driver asked of it."""

    def __init__(self, source: LocalSource) -> None:
        self.source = source
        self.calibrated: list[list[str]] = []
        self.phase_shards: list[str] = []
        self.scored: list[str] = []

    def model_info(self) -> dict[str, Any]:
        return self.source.model_info()

    def calibrate(self, uris: Sequence[str]) -> CalibrationOutcome:
        self.calibrated.append(list(uris))
        outcome = self.source.calibrate(uris)
        self.phase_shards = [o.uri for o in outcome.outcomes]
        return outcome

    def results(self, uris: Sequence[str], calibration: Calibration) -> Iterator[ShardOutcome]:
        self.scored.extend(uris)
        return self.source.results(uris, calibration)


class Events:
    """A ``Progress`` that records its events."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def start(self, total_shards: int, already_done: int) -> None:
        self.events.append(("start", total_shards, already_done))

    def shard_done(self, record: Any) -> None:
        self.events.append(("done", record.stem, record.rows))

    def shard_failed(self, uri: str, error: str, attempts: int = 1) -> None:
        self.events.append(("failed", uri, error))


class Job:
    """One output folder and the sources built for it (one per run that had work)."""

    def __init__(self, estimator: Estimator, spec: JobSpec, out: Path) -> None:
        self.estimator, self.spec, self.out = estimator, spec, OutputDir(str(out))
        self.path = out
        self.sources: list[Watched] = []

    def make_source(self) -> Watched:
        source = Watched(LocalSource(self.estimator, self.spec, self.out, score_options(self.spec)))
        self.sources.append(source)
        return source

    def run(self, **kwargs: Any) -> JobReport:
        return run_job(self.spec, self.out, self.make_source, **kwargs)

    def table(self, stem: str) -> Any:
        return pq.read_table(self.path / f"{stem}.parquet")


@pytest.fixture
def job(tiny_estimator: Estimator, tmp_path: Path) -> Callable[[JobSpec], Job]:
    return lambda spec: Job(tiny_estimator, spec, tmp_path / "out")


def _stem(uri: str) -> str:
    return Path(uri).name[: -len(".tar")]


def test_a_job_commits_every_shard_with_the_calibration_it_froze(job, make_spec, write_shards) -> None:
    shards = write_shards([4, 4, 4, 4, 4])
    # a corpus recipe: the calibration phase scores shards in order until 6 ok pairs
    run = job(make_spec(shards, beta_recipe="shuffled", weighting="reference", calibration_pairs=6, embeddings=True))
    events = Events()
    report = run.run(progress=events)
    assert (report.state, report.committed, report.skipped, report.pairs, report.failed) == (SUCCEEDED, 5, 0, 20, [])
    assert report.statuses == {schema.STATUS_OK: 20}
    assert EXIT_CODES[report.state] == 0 and state_for_exit(0) == SUCCEEDED
    (source,) = run.sources
    assert source.calibrated == [shards]
    assert source.phase_shards == shards[:2]  # 4 < 6 ok pairs after one shard, 8 after two
    assert source.scored == shards[2:]
    # frozen once, in the folder, from exactly the first 6 ok pairs
    cal = report.calibration
    assert cal is not None and cal == run.out.read_calibration()
    assert (cal.recipe, cal.weighting, cal.calibration_pairs) == ("shuffled", "reference", 6)
    assert cal == Calibration(**json.loads(schema.local_side_path(run.path, schema.CALIBRATION_FILE).read_text()))
    # every table, from either phase, carries that calibration and is weighted with it
    for uri in shards:
        table = run.table(_stem(uri))
        meta = json.loads(table.schema.metadata[schema.META_KEY])
        assert meta["beta"]["value"] == cal.beta and meta["weighting"]["d_ref"] == cal.d_ref
        sims = table.column(schema.COL_SIMILARITY).to_numpy()
        expected = osa.apply_weighting(sims, cal.beta, cal.weighting_params())
        assert np.allclose(table.column(schema.COL_WEIGHT).to_numpy(), expected)
        assert table.column(schema.COL_KEY).to_pylist() == [f"p{i:04d}" for i in range(4 * shards.index(uri), 4 * shards.index(uri) + 4)]
        assert (schema.local_side_path(run.path, schema.EMB_DIR) / f"{_stem(uri)}.parquet").exists()
    # committed: the manifest names each table with its checksum; the lock is gone
    committed = run.out.committed()
    assert sorted(committed) == [_stem(u) for u in shards]
    for stem, record in committed.items():
        assert record.sha256 == sha256_file(run.path / record.output) and record.rows == 4
    assert run.out.store.list(schema.COMPLETIONS_DIR) == []  # compacted at the end
    assert not schema.local_side_path(run.path, schema.LOCK_FILE).exists()
    assert events.events[0] == ("start", 5, 0)
    assert sorted(e[1] for e in events.events[1:]) == [_stem(u) for u in shards]
    assert all(e[0] == "done" and e[2] == 4 for e in events.events[1:])


def test_a_recipe_that_needs_no_corpus_scores_every_shard_in_the_scoring_phase(job, make_spec, write_shards) -> None:
    shards = write_shards([3, 3])
    run = job(make_spec(shards, beta_recipe="random-inputs", weighting="paper"))
    report = run.run()
    assert report.state == SUCCEEDED and report.committed == 2
    (source,) = run.sources
    assert source.phase_shards == [] and source.scored == shards
    assert report.calibration is not None and report.calibration.calibration_pairs == 0
    assert run.out.read_calibration() == report.calibration


def test_a_truncated_shard_is_quarantined_while_the_others_commit_and_a_rerun_resumes(job, make_spec, write_shards, corrupt) -> None:
    shards = write_shards([3, 3, 3, 3, 3])
    whole = corrupt(shards[3])  # a shard of the scoring phase
    run = job(make_spec(shards, beta_recipe="gmm", weighting="p-clean", calibration_pairs=5))
    events = Events()
    report = run.run(progress=events)
    assert report.state == FAILED and EXIT_CODES[FAILED] == 3 and state_for_exit(3) == FAILED
    assert report.committed == 4 and report.pairs == 12
    assert [uri for uri, _ in report.failed] == [shards[3]] and "unreadable tar" in report.failed[0][1]
    assert ("failed", shards[3], report.failed[0][1]) in events.events
    quarantined = run.out.quarantined()
    assert list(quarantined) == [_stem(shards[3])]
    assert quarantined[_stem(shards[3])]["shard"] == shards[3]
    assert quarantined[_stem(shards[3])]["state"] == schema.SHARD_QUARANTINED
    assert "unreadable tar" in quarantined[_stem(shards[3])]["error"]
    assert _stem(shards[3]) not in run.out.committed()
    assert not (run.path / f"{_stem(shards[3])}.parquet").exists()
    frozen = run.out.read_calibration()
    assert frozen is not None and frozen.calibration_pairs == 5
    checksums = {u: sha256_file(run.path / f"{_stem(u)}.parquet") for u in shards if u != shards[3]}
    # a rerun with the shard repaired: only that shard is scored, with the frozen calibration
    Path(shards[3]).write_bytes(whole)
    events = Events()
    again = run.run(progress=events)
    assert (again.state, again.skipped, again.committed, again.pairs, again.failed) == (SUCCEEDED, 4, 1, 3, [])
    assert events.events[0] == ("start", 5, 4)
    second = run.sources[1]
    assert second.calibrated == [] and second.scored == [shards[3]]  # calibration not recomputed
    assert again.calibration == frozen and run.out.read_calibration() == frozen
    meta = json.loads(run.table(_stem(shards[3])).schema.metadata[schema.META_KEY])
    assert meta["beta"]["value"] == frozen.beta
    assert run.out.quarantined() == {}  # the commit cleared the failure record
    assert {u: sha256_file(run.path / f"{_stem(u)}.parquet") for u in checksums} == checksums  # untouched
    assert sorted(run.out.committed()) == [_stem(u) for u in shards]
    # nothing left to do: the source (and its model) is not even built
    done = run.run()
    assert (done.state, done.skipped, done.committed) == (SUCCEEDED, 5, 0) and len(run.sources) == 2
    assert done.calibration == frozen


def test_a_failed_fraction_within_the_allowance_ends_partial(job, make_spec, write_shards, corrupt) -> None:
    shards = write_shards([2, 2, 2, 2])
    corrupt(shards[1])
    report = job(make_spec(shards)).run(max_failed_fraction=0.25)
    assert report.state == PARTIAL and EXIT_CODES[PARTIAL] == 4 and state_for_exit(4) == PARTIAL
    assert report.committed == 3 and len(report.failed) == 1
    assert JobReport(total_shards=4, failed=[("a", "e"), ("b", "e")], max_failed_fraction=0.25).state == FAILED


def test_a_shard_failing_in_the_calibration_phase_is_skipped_for_the_next(job, make_spec, write_shards, corrupt) -> None:
    shards = write_shards([3, 3, 3])
    corrupt(shards[0], keep=0.3)
    run = job(make_spec(shards, beta_recipe="gmm", weighting="paper", calibration_pairs=3))
    report = run.run()
    (source,) = run.sources
    assert source.phase_shards == shards[:2] and source.scored == shards[2:]
    assert [u for u, _ in report.failed] == [shards[0]] and report.committed == 2
    assert report.calibration is not None and report.calibration.calibration_pairs == 3
    # gmm on 3 pairs: the documented fallback, recorded in the frozen calibration
    assert report.calibration.recipe == "random-inputs" and report.calibration.extra["requested_recipe"] == "gmm"
    assert list(run.out.quarantined()) == [_stem(shards[0])]


def test_when_every_shard_fails_nothing_is_calibrated(job, make_spec, write_shards, corrupt) -> None:
    shards = write_shards([2, 2])
    for uri in shards:
        corrupt(uri)
    run = job(make_spec(shards, beta_recipe="shuffled"))
    report = run.run()
    assert report.state == FAILED and report.committed == 0 and report.calibration is None
    assert sorted(u for u, _ in report.failed) == shards
    assert run.out.read_calibration() is None and not schema.local_side_path(run.path, schema.CALIBRATION_FILE).exists()
    assert sorted(run.out.quarantined()) == [_stem(u) for u in shards]


def test_a_folder_held_by_a_live_run_is_refused_untouched(job, make_spec, write_shards, tmp_path: Path) -> None:
    run = job(make_spec(write_shards([2])))
    holder = {"run_id": "h" * 32, "host": "another-host", "pid": 1, "heartbeat": time.time(), "ttl_s": 60}
    run.out.store.put(schema.LOCK_FILE, json.dumps(holder).encode())
    with pytest.raises(OutputBusyError, match="another-host"):
        run.run()
    assert run.sources == []
    side = Path(f"{run.path}{schema.SIDE_SUFFIX}")  # OUT.pairclean: the holder's lock only; OUT untouched
    assert not run.path.exists() or not any(run.path.rglob("*"))
    assert sorted(p.relative_to(side).as_posix() for p in side.rglob("*") if p.is_file()) == ["state/lock.json"]


def test_a_folder_of_other_files_is_refused_without_writing(job, make_spec, write_shards) -> None:
    run = job(make_spec(write_shards([2])))
    run.path.mkdir()
    (run.path / "mine.txt").write_text("user data")
    with pytest.raises(ForeignOutputError, match="mine.txt"):
        run.run()
    assert [p.name for p in run.path.iterdir()] == ["mine.txt"] and run.sources == []


def test_a_different_spec_is_refused_and_overwrite_starts_over(job, make_spec, write_shards) -> None:
    shards = write_shards([2, 2])
    first = job(make_spec(shards))
    assert first.run().committed == 2
    other = job(make_spec(shards, seed=1))
    with pytest.raises(SpecMismatchError, match="seed"):
        other.run()
    assert other.sources == [] and first.out.read_spec() == first.spec
    report = other.run(overwrite=True)
    assert report.committed == 2 and report.skipped == 0
    assert other.out.read_spec() == other.spec
    cal = other.out.read_calibration()
    assert cal is not None and cal.seed == 1


def test_a_table_name_taken_during_the_calibration_phase_fails_that_shard_alone(job, make_spec, write_shards) -> None:
    """A file of someone else's that appears at a calibration shard's table name once the run
    has begun failed the whole job with nothing recorded, at every rerun; as in the scoring
    phase, that shard fails (naming the file, which is left as it was) and the rest commit."""
    shards = write_shards([4, 4, 4, 4])
    run = job(make_spec(shards, beta_recipe="shuffled", weighting="reference", calibration_pairs=100))  # every shard calibrates
    foreign = run.path / "part-00002.parquet"

    class Intruder(Events):
        def start(self, total_shards: int, already_done: int) -> None:
            super().start(total_shards, already_done)
            foreign.parent.mkdir(parents=True, exist_ok=True)
            foreign.write_bytes(b"someone else's table")

    report = run.run(progress=Intruder(), max_failed_fraction=0.5)
    assert report.state == PARTIAL and report.committed == 3 and report.calibration is not None
    ((uri, error),) = report.failed
    assert uri == shards[2] and "part-00002.parquet exists and was not written by pairclean" in error
    assert foreign.read_bytes() == b"someone else's table"
    assert sorted(run.out.committed()) == [_stem(u) for u in shards if u != shards[2]]
