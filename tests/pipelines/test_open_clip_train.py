"""``python -m pairclean.open_clip_train``: open_clip's own, unedited ``open_clip_train.main``
with pairclean's weights. The weighted loss on 2 real processes (gloo) against one process
on the same batch and against open_clip's ``ClipLoss``; then whole training runs of a few
steps on the bundled sample with a tiny model (no downloads), in each mode."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pairclean

torch = pytest.importorskip("torch")
pytest.importorskip("open_clip_train")

SAMPLE = Path(pairclean.__file__).parent / "data" / "sample" / "demo-000000.tar"
TINY_CONFIG = Path(pairclean.__file__).parent / "data" / "pairclean-tiny-test.json"
B, D = 8, 6  # global batch, feature width

# One process of the gloo check: the global batch is made from a seed on every rank, each
# rank takes its half, computes the loss, backpropagates into a shared linear layer and
# averages the gradient over ranks as DDP does. Writes {loss, grad} per rank as JSON.
_RANK = textwrap.dedent('''
    import json, os, sys
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    from open_clip.loss import ClipLoss
    from pairclean.open_clip_train import WeightHolder, WeightedClipLoss

    rank, world, port, kind, local, with_grad, path = sys.argv[1:8]
    rank, world = int(rank), int(world)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    B, D = 8, 6
    x_img, x_txt = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    weights = torch.rand(B, generator=g) if kind == "weighted" else torch.ones(B)
    layer = torch.nn.Linear(D, D, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(D, D, generator=g))
    n = B // world
    part = slice(rank * n, (rank + 1) * n)
    img = F.normalize(layer(x_img[part]), dim=-1)
    txt = F.normalize(layer(x_txt[part]), dim=-1)
    common = dict(local_loss=local == "1", gather_with_grad=with_grad == "1", cache_labels=True, rank=rank, world_size=world)
    if kind == "clip":
        loss_fn = ClipLoss(**common)
    else:
        holder = WeightHolder()
        holder.put(weights[part])
        loss_fn = WeightedClipLoss(holder, **common)
    out = loss_fn(img, txt, torch.tensor(10.0), output_dict=True)["contrastive_loss"]
    out.backward()
    grad = layer.weight.grad.clone()
    if world > 1:
        dist.all_reduce(grad)
        grad /= world  # DDP averages gradients over processes
    json.dump({"loss": out.item(), "grad": grad.flatten().tolist()}, open(f"{path}.{rank}", "w"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()  # a clean gloo teardown (leaving it to exit can abort the process)
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp_path: Path, kind: str, world: int, local: bool, with_grad: bool) -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    path = tmp_path / f"{kind}-{world}-{int(local)}{int(with_grad)}"
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), port, kind, str(int(local)), str(int(with_grad)), str(path)],
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    return [json.loads(Path(f"{path}.{r}").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("local", [False, True])
def test_weighted_loss_on_two_gloo_processes_equals_one_process_on_the_same_batch(tmp_path: Path, local: bool) -> None:
    single = _run(tmp_path, "weighted", 1, local, True)[0]
    ranks = _run(tmp_path, "weighted", 2, local, True)
    # the loss: every rank's equals the one-process loss (gathered logits), or with
    # local_loss each rank's share averages to it; gradients (averaged as DDP does) equal it
    assert np.mean([r["loss"] for r in ranks]) == pytest.approx(single["loss"], rel=1e-5)
    if not local:
        assert [r["loss"] for r in ranks] == pytest.approx([single["loss"]] * 2, rel=1e-5)
    for r in ranks:
        assert r["grad"] == pytest.approx(single["grad"], rel=1e-4, abs=1e-6)
    # the weights matter: the same batch unweighted is another loss
    assert _run(tmp_path, "ones", 1, local, True)[0]["loss"] != pytest.approx(single["loss"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(("local", "with_grad"), [(False, False), (True, False), (False, True), (True, True)])
def test_weighted_loss_with_unit_weights_is_open_clips_clip_loss_on_two_processes(tmp_path: Path, local: bool, with_grad: bool) -> None:
    ours, theirs = _run(tmp_path, "ones", 2, local, with_grad), _run(tmp_path, "clip", 2, local, with_grad)
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad"] == pytest.approx(b["grad"], rel=1e-4, abs=1e-6)


# -- whole runs of open_clip_train --------------------------------------------------------------

@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample scored by the tiny estimator."""
    from pairclean_workers.cli import main

    out = tmp_path_factory.mktemp("oct") / "weights"
    assert main(["score", str(SAMPLE), "--out", str(out), "--model", "pairclean-tiny-test", "--executor", "local", "--no-progress"]) == 0
    return out


def _train(weights: Path, logs: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The command README shows, for 3 steps of a tiny open_clip model on CPU (no downloads)."""
    cmd = [sys.executable, "-m", "pairclean.open_clip_train", "--pairclean-weights", str(weights),
           "--pairclean-model-config", str(TINY_CONFIG), *extra,
           "--model", "pairclean-tiny-test", "--train-data", str(SAMPLE), "--dataset-type", "webdataset",
           "--batch-size", "4", "--epochs", "1", "--workers", "0", "--device", "cpu", "--precision", "fp32",
           "--lr", "1e-4", "--warmup", "1", "--save-frequency", "0", "--zeroshot-frequency", "0", "--val-frequency", "0",
           "--report-to", "", "--log-every-n-steps", "1", "--seed", "0", "--logs", str(logs), "--name", "run"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


def _losses(run: subprocess.CompletedProcess[str]) -> list[float]:
    return [float(m) for m in re.findall(r"Contrastive_loss: ([0-9.e+-]+) \(", run.stdout + run.stderr)]


@pytest.mark.slow
def test_open_clip_train_runs_unedited_with_the_weights_in_each_mode(weights: Path, tmp_path: Path,
                                                                     committed: Callable[[Path], Path]) -> None:
    table = pq.read_table(weights / "demo-000000.parquet")
    kept = sum(1 for r in table.to_pylist() if r["status"] == "ok" and not r["noisy"])
    for mode in ("weight", "keep", "sample"):
        run = _train(weights, tmp_path / mode, "--pairclean-mode", mode)
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        losses = _losses(run)
        assert losses and all(np.isfinite(losses)), mode
        summary = re.search(r"pairclean: (\d+) batches, (\d+) pairs", run.stderr)
        assert summary and int(summary.group(1)) == len(losses) and int(summary.group(2)) == 4 * len(losses)
        if mode == "keep":
            assert f"--train-num-samples {kept} (keep mode" in run.stderr
    # The loss is the weighted one: with every weight 0, every step's loss is exactly 0.
    # (recorded as the job's, as a rewrite by pairclean is: an edited table is refused)
    original = (weights / "demo-000000.parquet").read_bytes()
    zeroed = table.set_column(table.schema.get_field_index("weight"), "weight", pa.array(np.zeros(table.num_rows, np.float32)))
    pq.write_table(zeroed, weights / "demo-000000.parquet")
    try:
        run = _train(weights, tmp_path / "edited")
        assert run.returncode != 0 and "demo-000000.parquet changed since pairclean wrote it" in run.stderr
        committed(weights)
        run = _train(weights, tmp_path / "zero")
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        assert _losses(run) and all(v == 0.0 for v in _losses(run))
    finally:
        (weights / "demo-000000.parquet").write_bytes(original)
        committed(weights)


def test_refusals_are_one_line_before_training(weights: Path, tmp_path: Path) -> None:
    run = _train(weights, tmp_path / "a", "--accum-freq", "2")
    assert run.returncode != 0 and "does not support --accum-freq" in run.stderr and "Traceback" not in run.stderr
    run = _train(tmp_path / "nowhere", tmp_path / "b")
    assert run.returncode != 0 and "not a folder" in run.stderr and "Traceback" not in run.stderr
    # a table someone replaced with a Parquet file of their own: one line naming it (a pyarrow traceback)
    import shutil

    foreign = tmp_path / "foreign"
    shutil.copytree(weights, foreign)
    shutil.copytree(f"{weights}.pairclean", f"{foreign}.pairclean")
    pq.write_table(pa.table({"note": ["mine"]}), foreign / "demo-000000.parquet")
    run = _train(foreign, tmp_path / "c")
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "demo-000000.parquet changed since pairclean wrote it" in run.stderr
    # ... and a folder of tables without a job's record beside it is no job's output
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(weights / "demo-000000.parquet", bare)
    run = _train(bare, tmp_path / "d")
    assert run.returncode != 0 and "Traceback" not in run.stderr and "is not a pairclean output folder" in run.stderr


def test_the_launcher_refuses_a_worker_deal_that_never_fills_a_batch() -> None:
    """open_clip's with_epoch repeats a worker's shards until it has made its batches: a
    worker holding only the empty shard of an img2dataset folder looped for ever."""
    from pairclean.open_clip_train import starving_workers

    counts = {"00000": 0, "00001": 0, "00002": 20, "00003": 20}  # empty, json-only, two of 20 pairs
    why = starving_workers(counts, loaders=4, batch_size=4)
    assert why is not None and "00000 (0)" in why and "fewer samples than one batch of 4" in why
    assert starving_workers(counts, loaders=2, batch_size=4) is not None  # a worker may get both empty shards
    assert starving_workers(counts, loaders=1, batch_size=4) is None
    assert starving_workers(counts, loaders=1, batch_size=256) is not None  # 40 pairs never make a batch of 256
    assert starving_workers({f"{i:05d}": 20 for i in range(8)}, loaders=4, batch_size=32) is None  # 2 shards a worker: 40


def test_the_launchers_counts_are_what_the_stage_yields(tmp_path: Path) -> None:
    """``--train-num-samples`` came from counts that ignored a key the shard holds twice (both
    copies get weight 0 and are not kept) and counted ok rows only in mode weight, where the
    loader also yields an empty caption: 9 against 8 in mode keep, 17 against 19 in mode weight."""
    import io
    import tarfile

    import webdataset as wds

    from pairclean.open_clip_train import shard_samples
    from pairclean.read.shards import iter_raw_samples
    from pairclean.sampler import WeightStage
    from pairclean_workers.cli import main

    pairs = [(s.files["jpg"], s.files["txt"]) for s in iter_raw_samples(str(SAMPLE))]
    members = [(f"{i:04d}", pairs[i]) for i in range(8)] + [("dupk", pairs[8]), ("empty", (pairs[9][0], b"   ")),
                                                            ("dupk", pairs[9])]
    shard = tmp_path / "shards" / "00000.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w") as tar:
        for key, (jpg, txt) in members:
            for ext, data in (("jpg", jpg), ("txt", txt)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "weights"
    assert main(["score", str(shard), "--out", str(out), "--model", "pairclean-tiny-test", "--no-progress",
                 "--executor", "local"]) == 0
    for mode, stage_mode in (("keep", "keep"), ("weight", "loss")):
        pipeline = wds.DataPipeline(wds.SimpleShardList(str(shard)), wds.tarfile_to_samples(),
                                    wds.select(lambda s: "txt" in s and "jpg" in s),  # open_clip's filter
                                    WeightStage(str(out), mode=stage_mode))
        assert shard_samples(out, str(shard), mode)["00000"] == sum(1 for _ in pipeline), mode
    # a table no run recorded (a killed run's) is not counted, as the stage does not serve it
    import shutil

    for folder in ("manifest", "completions"):
        shutil.rmtree(f"{out}.pairclean/state/{folder}", ignore_errors=True)
    with pytest.raises(FileNotFoundError, match="no committed table for shard '00000' .* not recorded as committed"):
        shard_samples(out, str(shard), "keep")
