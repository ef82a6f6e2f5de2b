"""Estimators: the tiny real open_clip model, checkpoints, offline failures, precision."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pairclean.errors import InputError, ModelLoadError
from pairclean.embed.estimators import EstimatorSpec, load_estimator

TINY = "pairclean-tiny-test"


@pytest.fixture(scope="module")
def tiny():
    return load_estimator(EstimatorSpec(TINY, precision="fp32", device="cpu"))


def test_tiny_model_embeds_deterministically_and_normalised(tiny) -> None:
    again = load_estimator(EstimatorSpec(TINY, precision="fp32", device="cpu"))
    texts = ["a dog on the beach", "two people riding bikes"]
    a, b = tiny.encode_texts(texts), again.encode_texts(texts)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-5)
    pixels = torch.rand((3, 3, tiny.image_size, tiny.image_size), generator=torch.Generator().manual_seed(0))
    img = tiny.encode_images(pixels)
    assert img.shape == (3, tiny.info.embed_dim) and img.dtype == np.float32
    assert tiny.encode_texts([]).shape == (0, tiny.info.embed_dim)


def test_random_input_embeddings_are_seeded(tiny) -> None:
    i1, t1 = tiny.random_input_embeddings(8, seed=5)
    i2, t2 = tiny.random_input_embeddings(8, seed=5)
    i3, _ = tiny.random_input_embeddings(8, seed=6)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(t1, t2)
    assert not np.array_equal(i1, i3)


def test_local_checkpoint_loads_and_is_identified_by_sha256(tiny, tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny.pt"
    state = {k: v * 0.5 if v.is_floating_point() else v for k, v in tiny.model.state_dict().items()}
    torch.save(state, ckpt)
    est = load_estimator(EstimatorSpec(TINY, checkpoint=str(ckpt), precision="fp32", device="cpu"))
    assert est.info.checkpoint_sha256 and len(est.info.checkpoint_sha256) == 64
    assert not np.allclose(est.encode_texts(["a cat"]), tiny.encode_texts(["a cat"]))


def _closed_port() -> int:
    """A local TCP port nothing listens on (a connection to it is refused at once)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_named_pretrained_tag_fails_fast_where_the_hub_cannot_be_reached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Offline, the hub client retried each file with back-off: 52 s before the error (and two
    log lines of its own before ours). One refused connection now says enough; the process's
    offline setting is left as it was."""
    import time

    from huggingface_hub import constants

    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    started = time.monotonic()
    with pytest.raises(ModelLoadError, match="the model hub cannot be reached and the tag is not in the local cache.*--checkpoint"):
        load_estimator(EstimatorSpec("ViT-B-32", pretrained="laion2b_s34b_b79k", precision="fp32", device="cpu"))
    assert time.monotonic() - started < 20
    assert constants.HF_HUB_OFFLINE is False
    # in offline mode no connection is tried at all
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="cannot be reached"):
        load_estimator(EstimatorSpec("ViT-B-32", pretrained="laion2b_s34b_b79k", precision="fp32", device="cpu"))


def test_the_hub_probe_says_reachable_where_a_server_listens_or_a_proxy_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from huggingface_hub import constants

    from pairclean.embed.estimators import _hub_reachable

    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert _hub_reachable(timeout=2)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    assert not _hub_reachable(timeout=2)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # only the client knows the way through it
    assert _hub_reachable(timeout=2)


def test_bad_estimator_options_are_clear_errors() -> None:
    with pytest.raises(InputError, match="checkpoint file not found"):
        load_estimator(EstimatorSpec(TINY, checkpoint="/nonexistent/file.pt"))
    with pytest.raises(ModelLoadError, match="unknown model"):
        load_estimator(EstimatorSpec("NoSuchArch-1", device="cpu"))
    with pytest.raises(ModelLoadError, match="needs weights"):
        load_estimator(EstimatorSpec("ViT-B-32", device="cpu"))


def test_bf16_path_agrees_with_fp32(tiny) -> None:
    bf16 = load_estimator(EstimatorSpec(TINY, precision="bf16", device="cpu"))
    assert bf16.info.precision == "bf16"
    texts = ["a dog on the beach", "a red car"]
    cos = (bf16.encode_texts(texts) * tiny.encode_texts(texts)).sum(1)
    assert cos.min() > 0.99


def test_auto_takes_bf16_on_cpu_only_where_amx_makes_it_faster(monkeypatch) -> None:
    """bf16 ViT-B/32 ran at 0.57x of fp32 on a CPU without AMX (benchmarks/precision.py)."""
    import pairclean.embed.estimators as estimators

    monkeypatch.setattr(estimators, "BF16_FASTER_ON_CPU", frozenset({TINY}))
    monkeypatch.setattr(estimators, "cpu_has_amx", lambda: False)
    assert load_estimator(EstimatorSpec(TINY, precision="auto", device="cpu")).info.precision == "fp32"
    monkeypatch.setattr(estimators, "cpu_has_amx", lambda: True)
    assert load_estimator(EstimatorSpec(TINY, precision="auto", device="cpu")).info.precision == "bf16"


def test_auto_keeps_fp32_without_a_probe_where_bf16_was_measured_to_disagree(monkeypatch) -> None:
    """pairclean-lite's bf16 agrees only to cosine 0.995: on a GPU every job copied the model
    and ran the probe to learn that again."""
    import pairclean.embed.estimators as estimators

    monkeypatch.setattr(estimators, "BF16_FASTER_ON_CPU", frozenset({TINY}))
    monkeypatch.setattr(estimators, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(estimators, "BF16_DISAGREES", frozenset({TINY}))

    def no_probe(*_: object) -> float:
        raise AssertionError("the bf16 probe ran")

    monkeypatch.setattr(estimators, "_agreement", no_probe)
    assert load_estimator(EstimatorSpec(TINY, precision="auto", device="cpu")).info.precision == "fp32"


def test_exact_fp32_turns_tf32_off_while_any_pass_is_inside_and_restores_the_process_setting() -> None:
    """Passes overlapping in two threads (A in, B in, A out, B out) once left B running
    with TF32 and the process's setting lost. Only flags are touched: no GPU needed."""
    import torch

    from pairclean.embed.estimators.base import exact_fp32

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.allow_tf32, matmul.allow_tf32)
    try:
        cudnn.allow_tf32, matmul.allow_tf32 = True, True
        a, b = exact_fp32(torch.device("cuda"), torch.float32), exact_fp32(torch.device("cuda"), torch.float32)
        a.__enter__()
        b.__enter__()
        a.__exit__(None, None, None)
        assert (cudnn.allow_tf32, matmul.allow_tf32) == (False, False)
        b.__exit__(None, None, None)
        assert (cudnn.allow_tf32, matmul.allow_tf32) == (True, True)
        with exact_fp32(torch.device("cpu"), torch.float32), exact_fp32(torch.device("cuda"), torch.bfloat16):
            assert cudnn.allow_tf32  # only float32 work on a GPU is affected
    finally:
        cudnn.allow_tf32, matmul.allow_tf32 = saved
