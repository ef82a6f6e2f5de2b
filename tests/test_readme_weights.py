"""Every call in README's "Using the weights in training" runs, as written, on a demo-like
img2dataset folder (an empty shard first, a json-only shard, two of real pairs) scored by
pairclean-lite: ``/data/shards`` and ``/data/weights`` are replaced by those folders. Only
these are adapted, each for a stated reason: the open_clip training call gets a tiny model
on CPU (ViT-B-32 on 2 CPU cores would take minutes), ``pip`` builds the wheel without build
isolation and installs it with ``--no-deps`` into a folder (no package index in tests), and
DataComp's ``resharder.py`` is not run (it needs DataComp's environment): its reading of the
keep file is checked instead."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "pipelines" / "data" / "pairclean-tiny-test.json"
ROWS, OK = 30, 20  # the demo-like folder: 0 + 10 json-only + 10 + 10 rows


def _blocks() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Using the weights in training", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(bash|python)\n(.*?)```", section, re.S)


BLOCKS = _blocks()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, img2dataset_writer: Callable[[Path], Path]) -> dict[str, Path]:
    from pairclean_workers.cli import main

    root = tmp_path_factory.mktemp("readme")
    shards = img2dataset_writer(root / "shards")
    weights = root / "weights"
    assert main(["score", str(shards), "--out", str(weights), "--executor", "local", "--no-progress"]) == 0  # pairclean-lite
    return {"shards": shards, "weights": weights, "root": root}


def _paths(code: str, job: dict[str, Path]) -> str:
    for name in ("shards-kept", "shards", "weights", "logs"):
        code = code.replace(f"/data/{name}", str(job["root"] / name) if name not in job else str(job[name]))
    return code


def _commands(block: str) -> list[list[str]]:
    """The shell commands of a bash block (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if shlex.split(line, comments=True)]


def _env(job: dict[str, Path]) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(job["root"] / "hf-cache"), "RAY_AUTH_MODE": "disabled"}


def _run(cmd: list[str], job: dict[str, Path], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(job), cwd=cwd or job["root"])
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done


def test_the_section_has_each_tools_call() -> None:
    text = "\n".join(code for _, code in BLOCKS)
    for call in ("pip wheel", "pairclean score /data/shards", "pairclean export", "ds.dataset(", "pd.read_parquet(",
                 "duckdb.sql(", "pl.scan_parquet(", "datasets.load_dataset(", "ray.data.read_parquet(",
                 "python -m pairclean.open_clip_train", "WeightStage(", "ScorePairs", "pairclean.read_scores(",
                 "score_pairs(", "resharder.py"):
        assert call in text, call
    assert "pip install pairclean" not in text  # not on any index


# Python blocks: what each one's result must be, by a call it makes.
CHECKS = {
    "ds.dataset(": "assert table.num_rows == ROWS and table.column_names[:2] == ['key', 'shard'] and 'uid' in table.column_names",
    "pd.read_parquet(": "assert len(frame) == ROWS and frame['uid'].notna().sum() == ROWS",
    "duckdb.sql(": "assert len(per_shard) == 3",
    "pl.scan_parquet(": "assert 0 < clean.height <= OK and 'uid' in clean.columns",
    "datasets.load_dataset(": "assert scores.num_rows == ROWS and 'weight' in scores.column_names",
    "ray.data.read_parquet(": "assert scores.count() == ROWS and 'uid' in scores.schema().names",
    "WeightStage(": "got = list(pipeline); assert len(got) == OK and all(0 <= w <= 1 for _, _, w in got)",
    "ScorePairs": ("rows = scored.take_all(); ok = [r for r in rows if r['status'] == 'ok']\n"
                   "assert len(ok) == OK and all(0 <= r['weight'] <= 1 for r in ok)"),
    "pairclean.read_scores(": "assert len(scores) == ROWS and len(r.weight) == len(images) and r.calibration.recipe",
}
# The notebook block scores pairs it is given: the demo-like folder's.
PREAMBLE = f"""
ROWS, OK = {ROWS}, {OK}
from pairclean.read.shards import iter_raw_samples
images, captions = [], []
for s in iter_raw_samples({{shard!r}}):
    images.append(s.files["jpg"]); captions.append(s.files["txt"].decode())
"""


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(BLOCKS) if lang == "python"])
def test_each_python_block_runs_as_written(job: dict[str, Path], index: int) -> None:
    code = BLOCKS[index][1]
    check = next(check for call, check in CHECKS.items() if call in code)
    if "ray" in code:
        pytest.importorskip("ray")
    script = PREAMBLE.format(shard=str(job["shards"] / "00002.tar")) + _paths(code, job) + "\n" + check + "\nprint('ok')\n"
    assert _run([sys.executable, "-c", script], job).stdout.strip().endswith("ok")


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(BLOCKS) if lang == "bash"])
def test_each_bash_block_runs_as_written(job: dict[str, Path], index: int, tmp_path: Path) -> None:
    pairclean = str(Path(sys.executable).parent / "pairclean")
    for cmd in _commands(_paths(BLOCKS[index][1], job)):
        if cmd[:2] == ["pip", "install"] and cmd[2].startswith("./pairclean"):
            continue  # from a clone, with its dependencies from the index: the wheel below is installed instead
        if cmd[:2] == ["pip", "wheel"]:
            built = _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", *[REPO.as_posix() if a == "./pairclean" else a for a in cmd[2:]]], job, cwd=tmp_path)
            assert "Successfully built pairclean" in built.stdout
        elif cmd[:2] == ["pip", "install"]:
            target = tmp_path / "site"
            _run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), *cmd[2:]], job, cwd=tmp_path)
            probe = "import pairclean.sampler, pairclean.open_clip_train, pairclean.ray_data; print(pairclean.__file__)"
            where = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                                   env={**_env(job), "PYTHONPATH": str(target)}, timeout=300)
            assert where.returncode == 0 and where.stdout.startswith(str(target)), where.stderr[-2000:]
        elif cmd[0] == "pairclean":
            if cmd[1] == "score":
                cmd = [*cmd, "--executor", "local", "--no-progress"]  # the job exists: a resume, nothing to redo
            done = _run([pairclean, *cmd[1:]], job)
            if cmd[1] == "export":
                assert "kept pairs (ok, not noisy):" in done.stdout
                if "--sizes-beside-shards" in cmd:
                    sizes = json.loads((job["shards"] / "sizes.json").read_text())
                    assert sizes == {"00000.tar": 0, "00001.tar": 10, "00002.tar": 10, "00003.tar": 10}
        elif cmd[:3] == ["python", "-m", "pairclean.open_clip_train"]:
            _train(cmd[3:], job)
        elif cmd[:2] == ["python", "resharder.py"]:
            _check_keep_file_as_the_resharder_reads_it(Path(cmd[cmd.index("-s") + 1]), job)
        else:
            raise AssertionError(f"README block {index}: no rule to run {cmd}")


def _train(args: list[str], job: dict[str, Path]) -> None:
    """open_clip_train for a few steps with a tiny model on CPU: the README's ViT-B-32, batch
    256 and 4 workers are swapped for what this machine runs in seconds."""
    swap = {"--model": "pairclean-tiny-test", "--batch-size": "4", "--workers": "0"}
    out = [swap.get(args[i - 1], a) if i else a for i, a in enumerate(args)]
    out += ["--pairclean-model-config", str(TINY_CONFIG), "--device", "cpu", "--precision", "fp32", "--warmup", "1",
            "--save-frequency", "0", "--zeroshot-frequency", "0", "--val-frequency", "0", "--log-every-n-steps", "1"]
    done = _run([sys.executable, "-m", "pairclean.open_clip_train", *out], job)
    assert f"--train-num-samples {OK} (weight mode" in done.stderr
    assert re.search(r"pairclean: \d+ batches, \d+ pairs", done.stderr) and "Contrastive_loss" in done.stdout + done.stderr


def _check_keep_file_as_the_resharder_reads_it(path: Path, job: dict[str, Path]) -> None:
    """DataComp's resharder: ``np.load(subset, mmap_mode="r")``, ``dtype == u8,u8``, then per
    sample ``divmod(int(uid, 16), 2**64)`` looked up with ``searchsorted`` (left and right)."""
    import pyarrow.parquet as pq

    subset = np.load(path, mmap_mode="r")
    assert subset.dtype == np.dtype("u8,u8")
    rows = pq.read_table(job["weights"], columns=["uid", "status", "noisy"]).to_pylist()
    for row in rows:
        key = np.array([divmod(int(row["uid"], 16), 2**64)], np.dtype("u8,u8"))[0]
        count = np.searchsorted(subset, key, "right") - np.searchsorted(subset, key, "left")
        assert count == int(row["status"] == "ok" and not row["noisy"]), row
