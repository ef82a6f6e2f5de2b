"""Shared fixtures: real Flickr8k shards (skipped without ../shared), a tiny real open_clip model."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pairclean.lite.evaldata import find_flickr8k, load_flickr8k, noisy_pairing, write_shard

REPO = Path(__file__).resolve().parents[1]
TINY = "pairclean-tiny-test"


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # beta caches and features must not leak between test sessions or into ~/.cache
    os.environ["PAIRCLEAN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def flickr_root() -> Path:
    root = find_flickr8k(REPO)
    if root is None:
        pytest.skip("Flickr8k not found: tests on real photos need ../shared/data/flickr8k beside the repository")
    return root


@pytest.fixture(scope="session")
def dev_images(flickr_root: Path) -> list[Any]:
    return load_flickr8k(flickr_root, "dev")


ShardMaker = Callable[..., list[Path]]


@pytest.fixture
def make_shards(tmp_path: Path, dev_images: list[Any]) -> ShardMaker:
    """Write ``n_shards`` shards of ``per_shard`` real dev pairs (a fraction shuffled)."""

    def make(n_shards: int = 2, per_shard: int = 8, noise: float = 0.25, prefix: str = "part", folder: Path | None = None, extra: dict[int, dict[str, Any]] | None = None, offset: int = 0) -> list[Path]:
        total = n_shards * per_shard
        pairs = noisy_pairing(dev_images[offset : offset + total], noise, seed=0)
        out = folder or tmp_path / "shards"
        paths = []
        for s in range(n_shards):
            samples = []
            for i in range(s * per_shard, (s + 1) * per_shard):
                sample: dict[str, Any] = {
                    "__key__": f"{prefix}{s:03d}/{pairs.images[i].image[:-4]}",
                    "jpg": pairs.images[i].path.read_bytes(),
                    "txt": pairs.captions[i],
                    "json": {"uid": f"uid-{i}", "url": f"https://example.org/{i}.jpg", "noisy": bool(pairs.noisy[i])},
                }
                if extra and i in extra:
                    sample.update(extra[i])
                    sample = {k: v for k, v in sample.items() if v is not None}
                samples.append(sample)
            paths.append(write_shard(out / f"{prefix}-{s:05d}.tar", samples))
        return paths

    return make


def kill_after_commits(cmd: list[str], out: Any, commits: int, timeout: float = 180) -> None:
    """Run ``cmd`` (a ``pairclean score`` into ``out``) and SIGKILL it, with its process
    group, once ``commits`` shards are committed: a crash in the middle of a job. ``out`` is
    a local folder or an ``OutputDir`` (for object stores)."""
    import os
    import signal
    import subprocess
    import time

    from pairclean.output.folder import OutputDir

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if isinstance(out, OutputDir):
            if len(out.committed()) >= commits:
                break
        elif (Path(f"{out}.pairclean") / "state").exists() and len(OutputDir(str(out)).committed()) >= commits:
            break
        time.sleep(0.05)
    if proc.poll() is not None:
        raise AssertionError(f"the job ended (exit {proc.returncode}) before {commits} commits: {cmd}")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture
def crash_mid_job() -> Callable[..., None]:
    """``kill_after_commits``, as a fixture (test modules do not import each other)."""
    return kill_after_commits


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A loopback S3 server (moto's real HTTP server; no S3-compatible server binary installs
    from the registries reachable here). Yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


#: Words of the bundled sample's captions (and some), the tiny word grounding's vocabulary.
SAMPLE_CAPTION_WORDS = ("dog", "cat", "man", "woman", "red", "blue", "two", "runs", "sits", "grass", "street", "beach",
                        "ball", "car", "tree", "photo", "sample", "image", "of", "a", "the")


@pytest.fixture
def tiny_judge() -> Callable[..., Path]:
    """Writes a judge with random weights shaped for ``pairclean-tiny-test`` (issue 21 tests)."""

    def make(path: Path, seed: int = 0, platt_fine: tuple[float, float] | None = None, colour_bins: int = 0,
             fine_rates: tuple[float, float] | None = None, words: float | None = None,
             fine_mixture: dict[str, object] | None = None) -> Path:
        """``platt_fine``: a near-miss map (the judge is then combined with OSA, not in its place);
        ``fine_rates``: its dev pass rates (the near-miss prior is then an adjusted count);
        ``colour_bins``: it also reads the regions' colour make-up; ``words``: the weight of a
        word grounding (random weights, the bundled sample's caption words) in its logit;
        ``fine_mixture``: its near-miss mixture record (``posterior.FineMixture.to_doc``)."""
        import torch

        from pairclean.judge.model import Judge, JudgeConfig
        from pairclean.judge.runner import save_judge
        from pairclean.judge.words import WordConfig, WordGrounding, WordModel, WordVocab

        torch.manual_seed(seed)
        config = JudgeConfig(text_dim=64, image_dim=64, regions=16, width=16, layers=1, heads=2, colour_bins=colour_bins)
        extra: dict[str, object] = {"note": "random weights, for tests"}
        if platt_fine is not None:
            extra["platt_fine"] = list(platt_fine)
        if fine_rates is not None:
            extra["fine_rates"] = list(fine_rates)
        if fine_mixture is not None:
            extra["fine_mixture"] = fine_mixture
        grounding = None
        if words is not None:
            vocab = WordVocab.of(list(SAMPLE_CAPTION_WORDS), 1)
            model = WordModel(WordConfig(vocab=len(vocab), image_dim=64, regions=16, width=16, layers=1, heads=2))
            grounding = WordGrounding(model.eval(), vocab, words)
        save_judge(str(path), Judge(config), (1.0, 0.0), TINY, extra, grounding)
        return path

    return make


def commit_tables(folder: Path) -> Path:
    """Record every ``*.parquet`` in ``folder`` as a committed shard of its job, as a run's
    completion records do, for tests that write score tables by hand: the trainer-side
    readers serve only committed tables, each checked against its record's SHA-256."""
    import hashlib
    from dataclasses import replace

    import pyarrow.parquet as pq

    from pairclean.output.folder import OutputDir, ShardRecord

    out = OutputDir(str(folder))
    known = out.committed()
    for table in sorted(folder.glob("*.parquet")):
        data = table.read_bytes()
        now = {"rows": pq.read_metadata(table).num_rows, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        record = known.get(table.stem)  # a table a test rewrote keeps its record, with the new bytes (as a rescore's)
        out.record_completion(replace(record, **now) if record is not None else
                              ShardRecord(shard=f"/data/{table.stem}.tar", stem=table.stem, size=None, output=table.name,
                                          statuses={}, **now))
    return folder


@pytest.fixture(scope="session")
def committed() -> Callable[[Path], Path]:
    """``commit_tables``, as a fixture (test modules do not import each other)."""
    return commit_tables


@pytest.fixture
def img2dataset_folder(tmp_path: Path) -> Path:
    """``write_img2dataset_folder(tmp_path / "img2dataset")``."""
    return write_img2dataset_folder(tmp_path / "img2dataset")


@pytest.fixture(scope="session")
def img2dataset_writer() -> Callable[[Path], Path]:
    """``write_img2dataset_folder``, for fixtures of a wider scope."""
    return write_img2dataset_folder


def write_img2dataset_folder(folder: Path) -> Path:
    """A demo-like img2dataset output (DataComp-style 32-hex uids, keys ``000NNNNNN``), built
    from the bundled sample: ``00000.tar`` empty (every download failed: it sorts first),
    ``00001.tar`` json members only, ``00002.tar`` and ``00003.tar`` 10 pairs each (the
    sample's, its swapped captions included), and img2dataset's ``<shard>.parquet`` and
    ``<shard>_stats.json`` beside them."""
    import hashlib
    import json
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pairclean.read.shards import iter_raw_samples

    sample = REPO / "pipelines" / "data" / "sample" / "demo-000000.tar"
    pairs = [(s.files["jpg"], s.files["txt"].decode()) for s in iter_raw_samples(str(sample))]
    folder.mkdir(parents=True)
    tarfile.open(folder / "00000.tar", "w").close()  # a valid tar with no members
    for shard in range(1, 4):
        samples = []
        for i, (jpg, caption) in enumerate(pairs):
            uid = hashlib.md5(f"{shard}-{i}".encode()).hexdigest()
            meta = {"uid": uid, "url": f"https://example.org/{shard}/{i}.jpg", "status": "success"}
            key = f"{shard:05d}{i:04d}"
            if shard == 1:
                samples.append({"__key__": key, "json": {**meta, "status": "failed_to_download"}})
            else:
                samples.append({"__key__": key, "jpg": jpg, "txt": caption, "json": meta})
        write_shard(folder / f"{shard:05d}.tar", samples)
    for shard in range(4):
        ok = 0 if shard < 2 else len(pairs)
        pq.write_table(pa.table({"key": pa.array([], pa.string()), "status": pa.array([], pa.string())}), folder / f"{shard:05d}.parquet")
        (folder / f"{shard:05d}_stats.json").write_text(json.dumps({"count": 0 if shard == 0 else len(pairs), "successes": ok}))
    return folder


@pytest.fixture
def loopback_http() -> Any:
    """``start(handler) -> base URL``: a threaded HTTP server on 127.0.0.1 (a free port)
    serving ``handler`` (a ``BaseHTTPRequestHandler`` class or factory); every server
    started is shut down when the test ends."""
    import http.server
    import threading

    servers: list[http.server.ThreadingHTTPServer] = []

    def start(handler: Any) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
