"""The GPU path: the towers, the judge and batched JPEG decoding on CUDA agree with the CPU.

Skipped without a CUDA device (CI has none); run it on a GPU machine. It needs no
conftest fixture: ``pytest --noconftest tests/pipelines/device`` works with only
pairclean and its scoring packages installed.
"""

from __future__ import annotations

from importlib import resources

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none; run on a GPU machine)")


def _sample() -> tuple[list[bytes], list[str]]:
    from pairclean.read.shards import iter_pairs

    shard = resources.files("pairclean") / "data" / "sample" / "demo-000000.tar"
    pairs = [p for p in iter_pairs(str(shard)) if p.status == "ok"]
    return [p.image for p in pairs], [p.text for p in pairs]  # type: ignore[misc]


def test_lite_and_its_judge_on_cuda_match_the_cpu() -> None:
    """Before this test, the judge's probes and inputs stayed on the CPU while the towers
    were on the GPU: every `pairclean score --device cuda` failed at start-up."""
    from pairclean.embed.estimators import EstimatorSpec, load_estimator
    from pairclean.judge.runner import JudgeRunner, load_judge
    from pairclean.read.decode import decode_and_preprocess

    images, texts = _sample()
    out = {}
    for device in ("cpu", "cuda"):
        est = load_estimator(EstimatorSpec("pairclean-lite", precision="fp32", engine="torch", device=device))
        pixels = torch.stack([decode_and_preprocess(b, 10**8, est.preprocess, draft_size=est.image_size) for b in images])
        batch = JudgeRunner(load_judge(), est).encode_batch(pixels, texts)
        assert all(e is None for e in batch.errors)
        out[device] = batch
    cpu, gpu = out["cpu"], out["cuda"]
    sim_cpu = (cpu.image_emb * cpu.text_emb).sum(1)
    sim_gpu = (gpu.image_emb * gpu.text_emb).sum(1)
    # float32 stays float32 on the GPU (no TF32: that moved similarities by up to 7e-4 and
    # the judge's score by 6e-3 on an H100; without it 1e-6 and 5e-6)
    assert np.abs(sim_cpu - sim_gpu).max() < 1e-4
    assert np.isfinite(gpu.llr).all() and np.abs(cpu.llr - gpu.llr).max() < 1e-3


def test_batched_jpeg_decoding_on_cuda_matches_the_cpu_path() -> None:
    from pairclean.embed.estimators import EstimatorSpec, load_estimator
    from pairclean.read.decode import DecodeFailure, decode_and_preprocess, decode_jpeg_batch

    est = load_estimator(EstimatorSpec("pairclean-lite", precision="fp32", engine="torch", device="cpu"))
    images, _ = _sample()
    broken = images[0][: len(images[0]) // 2]  # truncated: the CPU path's decode_error
    pp = est.info.preprocess
    got = decode_jpeg_batch([*images, broken], 10**8, est.image_size, pp["mean"], pp["std"], "cuda")
    assert isinstance(got[-1], DecodeFailure) and got[-1].status == "decode_error"
    for data, tensor in zip(images, got):
        ref = decode_and_preprocess(data, 10**8, est.preprocess, draft_size=est.image_size)
        assert isinstance(tensor, torch.Tensor) and tensor.is_cuda
        # nvJPEG's IDCT and a tensor resize differ from PIL's by a few grey levels
        assert (tensor.cpu() - ref).abs().mean() < 0.05
