"""pairclean-lite: real pretrained towers, offline, with the shipped heads."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pairclean.embed.estimators import EstimatorSpec, load_estimator

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lite():
    return load_estimator(EstimatorSpec("pairclean-lite", precision="fp32", device="cpu"))


def test_towers_load_offline_in_a_fresh_process() -> None:
    code = (
        "from pairclean.embed.estimators import EstimatorSpec, load_estimator;"
        "e = load_estimator(EstimatorSpec('pairclean-lite', device='cpu'));"
        "print(e.info.model_id, e.info.embed_dim, e.encode_texts(['a dog']).shape)"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME="/nonexistent-hf-home")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "pairclean-lite"


def test_image_tower_recognises_imagenet_classes_on_real_photos(lite) -> None:
    """The EfficientNet-Lite0 trunk as the estimator loaded it (``_load_image_tower``'s
    mapping, not a copy of it) must classify real photos correctly: the file's own ImageNet
    classifier (``_fc``, which the estimator drops) is put back on top of that trunk."""
    skimage_data = pytest.importorskip("skimage.data")
    from PIL import Image

    from pairclean.embed.estimators.lite import LITE_PREPROCESS, tower_paths

    trunk = lite.model.visual.trunk
    source = torch.load(tower_paths()[0], map_location="cpu", weights_only=True)
    fc_weight, fc_bias = source["_fc.weight"].float(), source["_fc.bias"].float()
    mean = torch.tensor(LITE_PREPROCESS["mean"])[:, None, None]
    std = torch.tensor(LITE_PREPROCESS["std"])[:, None, None]
    # ImageNet classes: 281-285 domestic cats, 967 espresso / 968 cup / 504 coffee mug
    expected = {"chelsea": set(range(281, 286)), "coffee": {967, 968, 504}}
    for name, classes in expected.items():
        img = Image.fromarray(getattr(skimage_data, name)()).convert("RGB").resize((224, 224), Image.Resampling.BICUBIC)
        x = (torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255 - mean) / std
        with torch.inference_mode():
            features = trunk(x[None].contiguous(memory_format=torch.channels_last)).float()
            assert features.shape == (1, fc_weight.shape[1]), features.shape  # pooled, classifier dropped
            top = int((features @ fc_weight.T + fc_bias).argmax())
        assert top in classes, f"{name}: predicted class {top}"


def test_embeddings_are_deterministic(lite) -> None:
    again = load_estimator(EstimatorSpec("pairclean-lite", precision="fp32", device="cpu"))
    texts = ["A dog runs through the snow .", "Two children play on a swing ."]
    np.testing.assert_array_equal(lite.encode_texts(texts), again.encode_texts(texts))
    x = torch.rand((2, 3, 224, 224), generator=torch.Generator().manual_seed(0))
    np.testing.assert_array_equal(lite.encode_images(x), again.encode_images(x))


def test_real_dev_pairs_score_above_their_shuffled_counterparts(lite, dev_images: list) -> None:
    from PIL import Image

    images = dev_images[:64]
    pixels = torch.stack([lite.preprocess(Image.open(i.path).convert("RGB")) for i in images])
    img = lite.encode_images(pixels)
    txt = lite.encode_texts([i.captions[0] for i in images])
    true = (img * txt).sum(1)
    shuffled = (img * np.roll(txt, 1, axis=0)).sum(1)
    assert (true > shuffled).mean() > 0.85
    assert true.mean() - shuffled.mean() > 0.1


def test_image_tower_runs_on_onnx_runtime_and_agrees_with_pytorch(lite, dev_images: list) -> None:
    """Where onnxruntime is installed, ``auto`` puts the image tower on it (measured 1.8x
    faster, benchmarks/engines.py); its embeddings match PyTorch's; ``engine="torch"`` opts out."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from PIL import Image

    assert lite.image_runner is not None
    assert lite.info.engine.startswith("onnxruntime ") and "(image tower)" in lite.info.engine
    assert lite.info.as_dict()["engine"] == lite.info.engine  # what the Parquet metadata records
    plain = load_estimator(EstimatorSpec("pairclean-lite", precision="fp32", device="cpu", engine="torch"))
    assert plain.image_runner is None and plain.info.engine == "torch"
    pixels = torch.stack([lite.preprocess(Image.open(i.path).convert("RGB")) for i in dev_images[:16]])
    cosine = (lite.encode_images(pixels) * plain.encode_images(pixels)).sum(1)
    assert cosine.min() > 0.9999
    # Odd batch sizes run too (the exported graph has a dynamic batch axis).
    assert lite.encode_images(pixels[:3]).shape == (3, lite.info.embed_dim)
    texts = ["A dog runs through the snow ."]
    np.testing.assert_array_equal(lite.encode_texts(texts), plain.encode_texts(texts))  # the text tower is PyTorch in both


def test_an_engine_that_disagrees_or_is_missing_leaves_pytorch(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import pairclean.embed.estimators as estimators

    def wrong(visual, image_size, threads):  # an engine whose embeddings are unrelated
        return (lambda x: torch.randn((x.shape[0], 512), generator=torch.Generator().manual_seed(0)), "broken 1.0")

    monkeypatch.setattr(estimators, "onnx_image_runner", wrong)
    est = load_estimator(EstimatorSpec("pairclean-lite", precision="fp32", device="cpu"))
    assert est.image_runner is None and est.info.engine == "torch"
    assert "staying with PyTorch" in caplog.text
    monkeypatch.setattr(estimators, "onnx_image_runner", lambda *a: None)  # onnxruntime not installed
    assert load_estimator(EstimatorSpec("pairclean-lite", precision="fp32", device="cpu")).info.engine == "torch"
    with pytest.raises(estimators.InputError, match="unknown engine"):
        load_estimator(EstimatorSpec("pairclean-lite", engine="openvino"))
