"""pairclean-lite: real pretrained towers, offline, with the shipped heads."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pairclean.estimators import EstimatorSpec, load_estimator

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lite():
    return load_estimator(EstimatorSpec("pairclean-lite", precision="fp32", device="cpu"))


def test_towers_load_offline_in_a_fresh_process() -> None:
    code = (
        "from pairclean.estimators import EstimatorSpec, load_estimator;"
        "e = load_estimator(EstimatorSpec('pairclean-lite', device='cpu'));"
        "print(e.info.model_id, e.info.embed_dim, e.encode_texts(['a dog']).shape)"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME="/nonexistent-hf-home")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "pairclean-lite"


def test_image_tower_recognises_imagenet_classes_on_real_photos() -> None:
    """The mapped EfficientNet-Lite0 weights must classify real photos correctly."""
    skimage_data = pytest.importorskip("skimage.data")
    import timm
    from PIL import Image

    from pairclean.estimators.lite import LITE_PREPROCESS, _load_image_tower, tower_paths

    model = timm.create_model("efficientnet_lite0", pretrained=False).eval()
    trunk_keys = [k for k in model.state_dict() if not k.startswith("classifier.")]
    state = torch.load(tower_paths()[0], map_location="cpu", weights_only=True)
    mapped = dict(zip(trunk_keys + ["classifier.weight", "classifier.bias"], [v for k, v in state.items() if not k.startswith("_fc.")] + [state["_fc.weight"], state["_fc.bias"]]))
    model.load_state_dict(mapped)
    mean = torch.tensor(LITE_PREPROCESS["mean"])[:, None, None]
    std = torch.tensor(LITE_PREPROCESS["std"])[:, None, None]
    # ImageNet classes: 281-285 domestic cats, 967 espresso / 968 cup / 504 coffee mug
    expected = {"chelsea": set(range(281, 286)), "coffee": {967, 968, 504}}
    for name, classes in expected.items():
        img = Image.fromarray(getattr(skimage_data, name)()).convert("RGB").resize((224, 224), Image.Resampling.BICUBIC)
        x = (torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255 - mean) / std
        with torch.inference_mode():
            top = int(model(x[None]).argmax())
        assert top in classes, f"{name}: predicted class {top}"
    _ = _load_image_tower  # the estimator uses the same in-order mapping


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
