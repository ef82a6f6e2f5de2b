"""Measuring whole commands: wall time and the user / system CPU seconds of a process tree.

Shared by ``throughput.py``, ``engines.py`` and ``peer_clip_retrieval.py``. The CPU split
comes from ``/proc/<pid>/stat`` of the command and every descendant, polled while it
runs: Ray's actors are not children the command waits for, so ``getrusage`` of the child
would miss them. Linux only (these benchmarks describe Linux CPU machines). A process's
last 0.2 s before it exits can be missed; on runs of minutes that is noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import flickr_root

__all__ = ["Measured", "run_measured", "flickr_shards", "random_checkpoint", "cpu_split", "json_line", "warm_beta_cache"]

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Measured:
    """One command: exit status, wall seconds, CPU seconds of its whole process tree
    (``by_name``: per executable name, e.g. ``raylet``), and its combined output."""

    rc: int
    wall_s: float
    user_s: float
    sys_s: float
    output: str
    by_name: dict[str, list[float]] = field(default_factory=dict)


def _proc_table() -> dict[int, list[tuple[int, str, float, float]]]:
    """parent pid -> [(pid, name, user s, sys s)] for every process now alive."""
    table: dict[int, list[tuple[int, str, float, float]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited between listdir and read
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        table.setdefault(int(fields[1]), []).append((int(entry), name, int(fields[11]) / _TICK, int(fields[12]) / _TICK))
    return table


def _descendants(root: int) -> dict[int, tuple[str, float, float]]:
    """pid -> (name, user s, sys s) of ``root`` and every process below it."""
    table = _proc_table()
    found = {pid: (name, u, s) for children in table.values() for pid, name, u, s in children if pid == root}
    stack = [root]
    while stack:
        for pid, name, user, sys_ in table.get(stack.pop(), []):
            found[pid] = (name, user, sys_)
            stack.append(pid)
    return found


def run_measured(cmd: list[str], env: dict[str, str] | None = None, interval: float = 0.2) -> Measured:
    """Run ``cmd`` to the end; its wall time and its process tree's CPU seconds."""
    seen: dict[int, tuple[str, float, float]] = {}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    while proc.poll() is None:
        seen.update(_descendants(proc.pid))
        time.sleep(interval)
    wall = time.perf_counter() - t0
    reader.join()
    by_name: dict[str, list[float]] = {}
    for name, user, sys_ in seen.values():
        acc = by_name.setdefault(name, [0.0, 0.0])
        acc[0] += user
        acc[1] += sys_
    return Measured(
        proc.returncode, wall, sum(v[1] for v in seen.values()), sum(v[2] for v in seen.values()), "".join(chunks),
        {k: [round(v[0], 1), round(v[1], 1)] for k, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))},
    )


def cpu_split(m: Measured, pairs: int) -> dict[str, float]:
    """User and system CPU seconds per 1,000 pairs, and the system share of CPU time."""
    per = 1000 / max(1, pairs)
    total = m.user_s + m.sys_s
    return {
        "user_s_per_1k": round(m.user_s * per, 2),
        "sys_s_per_1k": round(m.sys_s * per, 2),
        "sys_fraction": round(m.sys_s / total, 3) if total else 0.0,
    }


def flickr_shards(folder: Path, pairs: int, per_shard: int, noise: float = 0.2) -> list[str]:
    """Shards of ``pairs`` real Flickr8k pairs (``noise`` of them with shuffled captions).

    Past the 7,090 photos, photos repeat with their next caption (new keys, new pairs).
    Reuses ``folder`` when it already holds the same shards (a ``shards.json`` says so).
    """
    from pairclean.lite.evaldata import load_flickr8k, noisy_pairing, write_pair_shards

    marker = folder / "shards.json"
    want = {"pairs": pairs, "per_shard": per_shard, "noise": noise}
    if marker.is_file():
        have = json.loads(marker.read_text())
        if have.get("params") == want and all(Path(u).is_file() for u in have["shards"]):
            return list(have["shards"])
    images = load_flickr8k(flickr_root())
    items: list[tuple[str, Path, str]] = []
    round_ = 0
    while len(items) < pairs:
        paired = noisy_pairing(images, noise, seed=round_, caption_index=round_ % 5)
        items += [(f"{len(items) + i:08d}", img.path, cap) for i, (img, cap) in enumerate(zip(paired.images, paired.captions))]
        round_ += 1
    folder.mkdir(parents=True, exist_ok=True)
    shards = write_pair_shards(folder, items[:pairs], per_shard, "bench")
    marker.write_text(json.dumps({"params": want, "shards": shards}))
    return shards


def random_checkpoint(folder: Path, arch: str = "ViT-B-32", seed: int = 0) -> str:
    """An open_clip state dict of ``arch`` with random weights (seeded), saved once as
    ``folder/<arch>-random-<seed>.safetensors``: the same checkpoint for every tool."""
    path = folder / f"{arch}-random-{seed}.safetensors"
    if path.is_file():
        return str(path)
    import open_clip
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = open_clip.create_model(arch, pretrained=None)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
    tmp.replace(path)
    return str(path)


def warm_beta_cache(model: str, checkpoint: str | None) -> None:
    """Compute (and cache on disk) the random-inputs beta that ``pairclean score`` with its
    default options needs for ``model``, so that no timed run pays for it: a model's first
    job computes it once, every later job reads it (``pairclean.calibrate.calibration.cached_random_beta``)."""
    from pairclean import osa
    from pairclean.embed.estimators import EstimatorSpec, default_beta_recipe, load_estimator
    from pairclean.job.work import random_beta_fn

    if default_beta_recipe(model) == "random-inputs":
        random_beta_fn(load_estimator(EstimatorSpec(model, checkpoint)), osa.DEFAULT_K, 0)()


def json_line(record: dict[str, Any]) -> None:
    """Print one JSON line, flushed (benchmarks are read while they run)."""
    print(json.dumps(record), flush=True)
