"""Hostile and damaged output folders through the real ``pairclean`` CLI (subprocesses) and
the trainer-facing readers: NaN embeddings, non-finite weights, corrupt Parquet, a cut or
edited ``job.json``, duplicate keys, a table copied under another shard's name.

Every case is refused with one line naming the file (exit 1, no traceback, nothing
rewritten) or, where the rest of the input is usable, excluded and counted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairclean import schema

from pairclean.errors import InputError

STEM = "demo-000000"


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "pairclean_service.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample scored once (tiny real model, embedding sidecars on)."""
    from pairclean_workers.cli import sample_shard

    out = tmp_path_factory.mktemp("scored") / "out"
    r = _cli("score", sample_shard(), "--out", str(out), "--model", "pairclean-tiny-test", "--executor", "local", "--no-progress")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def folder(scored: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(scored, out)
    # a job is its folder and the sibling holding its state and sidecars (OUT.pairclean)
    shutil.copytree(schema.side_folder(str(scored)), schema.side_folder(str(out)))
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _rewrite(path: Path, column: str, change) -> None:  # type: ignore[no-untyped-def]
    table = pq.read_table(path)
    i = table.column_names.index(column)
    pq.write_table(table.set_column(i, table.schema.field(i).with_nullable(True), change(table.column(column))), path)


def _nan_embeddings(rows: list[int]):  # type: ignore[no-untyped-def]
    def change(col: pa.ChunkedArray) -> pa.Array:
        values = col.combine_chunks()
        dim = values.type.list_size
        flat = values.flatten().to_numpy(zero_copy_only=False).copy().reshape(-1, dim)
        valid = np.flatnonzero(values.is_valid().to_numpy(zero_copy_only=False))
        for r in rows:
            flat[valid[r], :] = np.nan
        return pa.FixedSizeListArray.from_arrays(pa.array(flat.ravel(), type=values.type.value_type), dim,
                                                 mask=pa.array(~values.is_valid().to_numpy(zero_copy_only=False)))
    return change


def test_refine_refuses_nan_embeddings_and_rewrites_nothing(folder: Path) -> None:
    """A few NaN rows once gave every table one constant p_clean (exit 0); more crashed in
    scikit-learn with its traceback."""
    table = folder / f"{STEM}.parquet"
    before = _sha(table)
    _rewrite(schema.local_side_path(folder, f"{schema.EMB_DIR}/{STEM}.parquet"), "image_emb", _nan_embeddings([1, 4]))
    r = _cli("refine", str(folder), "--executor", "local")
    _one_line_error(r, f"emb/{STEM}.parquet", "2 of", "NaN or infinite embeddings")
    assert _sha(table) == before


def test_pseudo_pair_leaves_nan_rows_out_of_its_pool(folder: Path) -> None:
    ok = pq.read_table(folder / f"{STEM}.parquet", columns=["key", "status"]).to_pylist()
    ok_keys = [row["key"] for row in ok if row["status"] == "ok"]
    _rewrite(schema.local_side_path(folder, f"{schema.EMB_DIR}/{STEM}.parquet"), "text_emb", _nan_embeddings([0, 3]))
    r = _cli("pseudo-pair", str(folder), "--pool", "all", "--executor", "local", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.splitlines()[-1])
    assert report["excluded_nonfinite"] == 2 and report["pool_size"] == len(ok_keys) - 2
    written = pa.concat_tables([pq.read_table(p) for p in schema.local_side_path(folder, schema.PSEUDO_DIR).glob("*.parquet")])
    used = set(written.column("key").to_pylist()) if "key" in written.column_names else set()
    assert not {ok_keys[0], ok_keys[3]} & used


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5, 1e30, None])
def test_export_refuses_non_finite_or_foreign_weights(folder: Path, bad: float | None) -> None:
    def change(col: pa.ChunkedArray) -> pa.Array:
        values = col.to_pylist()
        values[2] = bad
        return pa.array(values, type=pa.float32())

    _rewrite(folder / f"{STEM}.parquet", "weight", change)
    r = _cli("export", str(folder))
    _one_line_error(r, f"{STEM}.parquet", "outside [0, 1]")
    assert not schema.local_side_path(folder, f"{schema.EXPORT_DIR}/shard_weights.json").exists()


def test_export_writes_strict_json(folder: Path) -> None:
    assert _cli("export", str(folder)).returncode == 0
    text = schema.local_side_path(folder, f"{schema.EXPORT_DIR}/shard_weights.json").read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in shard_weights.json"))


@pytest.mark.parametrize("verb", [["export"], ["refine", "--executor", "local"], ["pseudo-pair", "--executor", "local", "--pool", "all"]])
@pytest.mark.parametrize("damage", ["cut parquet", "wrong schema", "cut job.json", "edited spec"])
def test_damaged_folders_are_one_line_errors_naming_the_file(folder: Path, verb: list[str], damage: str) -> None:
    table, job = folder / f"{STEM}.parquet", schema.local_side_path(folder, schema.JOB_FILE)
    if damage == "cut parquet":
        table.write_bytes(table.read_bytes()[:-100])
        named = f"{STEM}.parquet"
    elif damage == "wrong schema":
        pq.write_table(pa.table({"something": [1, 2, 3]}), table)
        named = f"{STEM}.parquet"
    elif damage == "cut job.json":
        job.write_bytes(job.read_bytes()[:40])
        named = "job.json"
    else:
        doc = json.loads(job.read_text())
        doc["spec"]["seed"] = doc["spec"]["seed"] + 1  # a spec edited by hand: no longer the one the data was made under
        job.write_text(json.dumps(doc))
        named = "job.json"
    r = _cli(verb[0], str(folder), *verb[1:])
    _one_line_error(r, named)


# -- the trainer's readers (a library, used inside training loops) ------------------------------

def _output_folder(folder: Path) -> Path:
    """An empty folder that WeightStage takes as a job's output (its side folder's job.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    job = Path(f"{folder}.pairclean/state/job.json")
    job.parent.mkdir(parents=True, exist_ok=True)
    job.write_text("{}")
    return folder


def _weights_table(folder: Path, weights: list[float | None], keys: list[str] | None = None, shard: str | None = None,
                   commit: Callable[[Path], Path] | None = None) -> Path:
    """A hand-made score table ``s-000.parquet`` in a job's folder, recorded as committed by
    ``commit`` (the ``committed`` fixture) when given."""
    _output_folder(folder)
    keys = keys or [f"k{i}" for i in range(len(weights))]
    columns = {"key": keys, "weight": pa.array(weights, type=pa.float32()), "noisy": [False] * len(keys)}
    if shard is not None:
        columns["shard"] = [shard] * len(keys)
    pq.write_table(pa.table(columns), folder / "s-000.parquet")
    return folder if commit is None else commit(folder)


@pytest.mark.parametrize("weights,keys,shard,message", [
    ([0.5, float("nan")], None, None, "outside [0, 1]"),
    ([0.5, None], None, None, "null"),
    ([0.5, float("inf")], None, None, "outside [0, 1]"),
    ([0.5, -1.0], None, None, "outside [0, 1]"),
    ([0.5, 1e30], None, None, "outside [0, 1]"),
    ([0.5, 0.7], ["k0", "k0"], None, "more than once"),
    ([0.5, 0.7], None, "/data/s-999.tar", "belong to shard"),
])
def test_weight_stage_refuses_damaged_tables(tmp_path: Path, weights: list[float | None], keys: list[str] | None,
                                             shard: str | None, message: str, committed: Callable[[Path], Path]) -> None:
    from pairclean.sampler import WeightStage

    stage = WeightStage(_weights_table(tmp_path / "w", weights, keys, shard, committed), "sample")
    with pytest.raises(InputError, match="s-000.parquet") as info:
        list(stage([{"__key__": "k0", "__url__": "/data/s-000.tar"}]))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_key_the_shard_held_twice_is_weighted_zero_not_a_broken_table(tmp_path: Path, committed: Callable[[Path], Path]) -> None:
    """A shard with a repeated ``__key__`` scores as an ``ok`` row and a ``duplicate_key``
    row under that key; the trainer meets both samples and cannot tell them apart."""
    from pairclean.sampler import WEIGHT_KEY, WeightStage

    folder = _output_folder(tmp_path / "w")
    pq.write_table(pa.table({"key": ["k0", "k1", "k0"], "weight": pa.array([0.9, 0.8, 0.0], type=pa.float32()),
                             "noisy": [False, False, True], "status": ["ok", "ok", "duplicate_key"]}), folder / "s-000.parquet")
    committed(folder)
    samples = [{"__key__": k, "__url__": "/data/s-000.tar"} for k in ("k0", "k1", "k0")]
    assert [s[WEIGHT_KEY] for s in WeightStage(folder, "loss")(samples)] == [0.0, pytest.approx(0.8), 0.0]
    assert [s["__key__"] for s in WeightStage(folder, "keep")(samples)] == ["k1"]


def test_weight_stage_accepts_its_own_shard_and_clamps_rounding(tmp_path: Path, committed: Callable[[Path], Path]) -> None:
    from pairclean.sampler import WEIGHT_KEY, WeightStage

    stage = WeightStage(_weights_table(tmp_path / "w", [1.0000001, 0.25], shard="s3://b/s-000.tar", commit=committed))
    got = [s[WEIGHT_KEY] for s in stage([{"__key__": "k0", "__url__": "/x/s-000.tar"}, {"__key__": "k1", "__url__": "/x/s-000.tar"}])]
    assert got == [1.0, 0.25]


def test_stage_and_sampler_parameters_must_be_finite(tmp_path: Path) -> None:
    from pairclean.sampler import WeightedSampler, WeightStage

    folder = _weights_table(tmp_path / "w", [0.5])
    for kwargs in ({"w_cap": math.nan}, {"w_cap": math.inf}, {"w_cap": -1.0}, {"default": math.nan}, {"default": -0.1}):
        with pytest.raises(ValueError):
            WeightStage(folder, "sample", **kwargs)  # type: ignore[arg-type]
    for n in (-1, 2.5, True):
        with pytest.raises(ValueError, match="num_samples"):
            WeightedSampler([1.0, 2.0], num_samples=n)  # type: ignore[arg-type]
    for bad in ([1.0, math.nan], [1.0, -1.0], [1.0, math.inf]):
        with pytest.raises(ValueError):
            WeightedSampler(bad)
    assert len(WeightedSampler([1.0, 2.0], num_samples=0)) == 0


def test_the_api_process_never_loads_torch(tmp_path: Path) -> None:
    """Building the app and the ``pairclean`` parser (what ``pairclean serve`` does) must
    not import torch: it held 600 MB in an API process that never runs a model."""
    from pairclean.embed.estimators import DEFAULT_MODEL
    from pairclean_workers import cli

    assert cli.DEFAULT_MODEL == DEFAULT_MODEL  # the parser's spelled-out default is the library's
    code = f"""
import sys
from collections.abc import Callable
from pairclean_service.app import create_app
from pairclean_service.cli import add_service_parsers
from pairclean_service.settings import ServiceSettings
from pairclean_workers.cli import build_parser
create_app(ServiceSettings(database_url="sqlite:///{tmp_path / 'j.db'}"), state_dir="{tmp_path / 'state'}")
build_parser(add_service_parsers).parse_args(["serve"])
heavy = sorted(m for m in ("torch", "open_clip", "sklearn", "faiss", "ray") if m in sys.modules)
print(",".join(heavy) or "none")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "none", r.stdout


def test_a_write_over_the_file_size_limit_names_the_file(tmp_path: Path) -> None:
    """EFBIG (or ENOSPC) from a write carries no file name: the error said only "File too
    large". Now the file it was writing is named."""
    import resource

    from pairclean_workers.cli import sample_shard

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))  # Python ignores SIGXFSZ: writes fail with EFBIG

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "pairclean_service.cli", "score", sample_shard(), "--out", str(out), "--model",
                        "pairclean-tiny-test", "--executor", "local", "--no-progress"], capture_output=True, text=True,
                       timeout=300, preexec_fn=small_files)
    _one_line_error(r, "File too large", str(out))
