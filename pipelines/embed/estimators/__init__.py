"""Building estimators: pairclean-lite (default), any open_clip architecture, a tiny test model.

``load_estimator(EstimatorSpec(...))`` is the one entry point. Loading never needs a
network: a named pretrained tag is tried once and, when the hub cannot be reached,
fails fast with a ``ModelLoadError`` that says how to point at a local checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from dataclasses import dataclass, replace
from importlib import resources
from collections.abc import Iterator
from typing import Any

from pairclean.errors import InputError, ModelLoadError, first_line
from pairclean.embed.estimators.base import BF16_MIN_COSINE, PRECISIONS, Estimator, ModelInfo, file_sha256, quiet_open_clip
from pairclean.embed.cpu_settings import keep_heap_memory
from pairclean.embed.estimators.engines import ENGINES, onnx_image_runner

__all__ = [
    "DEFAULT_MODEL",
    "TINY_TEST_MODEL",
    "EstimatorSpec",
    "Estimator",
    "ModelInfo",
    "load_estimator",
    "resolve_device",
    "default_beta_recipe",
]

log = logging.getLogger(__name__)

DEFAULT_MODEL = "pairclean-lite"
TINY_TEST_MODEL = "pairclean-tiny-test"

#: Architectures whose bf16-weight path was measured faster than fp32 on this project's
#: CPUs *and* agreeing with it (benchmarks/precision.py), so ``precision="auto"`` tries
#: bf16 for them on CPU (still checking agreement at load time). ViT-B/32: images 2.5x,
#: texts 2.2x, cosine 0.9999. pairclean-lite is 2.5x faster in bf16 too, but its image
#: embeddings agree only to cosine 0.995 (< 0.999), so it stays fp32.
#: Those speed-ups need AMX tiles: on a CPU with AVX512-BF16 but no AMX, bf16 ViT-B/32 ran
#: at 0.57x (images) and 0.65x (texts) of fp32 (benchmarks/precision.py, torch 2.14.1,
#: 2 threads), so ``auto`` takes bf16 on CPU only where ``cpu_has_amx()``.
BF16_FASTER_ON_CPU = frozenset({"ViT-B-32", "ViT-B-16", "ViT-L-14"})
#: Architectures whose bf16 embeddings were measured to disagree with fp32 (cosine < 0.999),
#: so ``precision="auto"`` keeps fp32 on any device without trying: pairclean-lite (0.995).
BF16_DISAGREES = frozenset({DEFAULT_MODEL})


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (what makes bf16 matmuls faster than fp32 on CPU)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private, hence guarded
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


#: Default beta recipe per estimator, chosen by measurement: the recipe whose noisy flag
#: was most accurate on the Flickr8k dev split averaged over 0, 20 and 50% shuffled
#: captions (benchmarks/detection.py; figures in pipelines/data/MODEL_CARD.md). For
#: pairclean-lite that is gmm (95.2%; random-inputs 94.3%, shuffled 90.1%). The paper's
#: random-inputs recipe relies on CLIP's cone effect and stays the default elsewhere.
DEFAULT_BETA_RECIPES = {DEFAULT_MODEL: "gmm"}


def default_beta_recipe(model: str) -> str:
    """The measured default beta recipe of ``model`` (``random-inputs`` when unmeasured)."""
    return DEFAULT_BETA_RECIPES.get(model, "random-inputs")


@dataclass(frozen=True)
class EstimatorSpec:
    """Which estimator to build.

    ``model``: ``pairclean-lite``, ``pairclean-tiny-test`` or an open_clip architecture.
    ``checkpoint``: a local open_clip state dict (.bin/.pt/.safetensors); for
    pairclean-lite, an alternative heads file. ``pretrained``: an open_clip tag, only
    where the hub is reachable. ``precision``: auto | fp32 | bf16. ``device``: auto | cpu | cuda[:i].
    ``engine``: auto (a measured-faster CPU engine where one agrees, ``estimators.engines``) | torch.
    """

    model: str = DEFAULT_MODEL
    checkpoint: str | None = None
    pretrained: str | None = None
    precision: str = "auto"
    device: str = "auto"
    engine: str = "auto"

    def validate(self) -> None:
        """Raise ``InputError`` for option combinations that cannot work."""
        if self.precision not in PRECISIONS:
            raise InputError(f"unknown precision {self.precision!r}; choose one of {PRECISIONS}")
        if self.engine not in ENGINES:
            raise InputError(f"unknown engine {self.engine!r}; choose one of {ENGINES}")
        if self.checkpoint and self.pretrained:
            raise InputError("give either --checkpoint or --pretrained, not both")
        if self.checkpoint and not os.path.isfile(self.checkpoint):
            raise InputError(f"checkpoint file not found: {self.checkpoint!r}", uri=self.checkpoint)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; other values pass through."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device {device!r} requested but no CUDA device is visible")
    return device


def load_estimator(spec: EstimatorSpec) -> Estimator:
    """Build the estimator of ``spec`` in eval mode on its device, precision resolved.

    Also sets this process's malloc to keep large freed blocks (``pairclean.embed.cpu_settings.keep_heap_memory``):
    without it, pairclean-lite spent a third of its CPU time in the kernel.
    """
    spec.validate()
    keep_heap_memory()
    spec = replace(spec, device=resolve_device(spec.device))
    if spec.model == DEFAULT_MODEL:
        from pairclean.embed.estimators.lite import build_lite

        fp32 = build_lite(spec.checkpoint, spec.device)
    else:
        fp32 = _build_open_clip(spec)
    return _choose_engine(_choose_precision(fp32, spec.precision), spec.engine)


def _register_config(name: str) -> None:
    import open_clip

    if name in open_clip.list_models():
        return
    path = resources.files("pairclean") / "data" / f"{name}.json"
    open_clip.add_model_config(str(path))


def _build_open_clip(spec: EstimatorSpec) -> Estimator:
    import open_clip
    import torch

    if spec.model == TINY_TEST_MODEL:
        _register_config(TINY_TEST_MODEL)
    elif spec.model not in open_clip.list_models():
        raise ModelLoadError(
            f"unknown model {spec.model!r}: use pairclean-lite or an open_clip architecture "
            "(python -c 'import open_clip; print(open_clip.list_models())')"
        )
    elif not spec.checkpoint and not spec.pretrained:
        raise ModelLoadError(
            f"model {spec.model!r} needs weights: pass --checkpoint /path/to/weights "
            "or --pretrained TAG (random weights give meaningless scores)"
        )
    pretrained = spec.checkpoint or spec.pretrained
    offline = bool(spec.pretrained) and not _hub_reachable()
    try:
        # Seeded so that the random-weight test model is the same in every process.
        torch.manual_seed(0)
        with quiet_open_clip(), _hub_offline(offline):
            model, _, preprocess = open_clip.create_model_and_transforms(
                spec.model, pretrained=pretrained, device=spec.device
            )
    except Exception as exc:
        raise _load_error(spec, exc, offline) from exc
    tokenizer = open_clip.get_tokenizer(spec.model)
    sha = file_sha256(spec.checkpoint) if spec.checkpoint else None
    pp = open_clip.get_model_preprocess_cfg(model)
    info = ModelInfo(
        model_id=spec.model if not spec.pretrained else f"{spec.model}/{spec.pretrained}",
        arch=spec.model,
        checkpoint=os.path.abspath(spec.checkpoint) if spec.checkpoint else spec.pretrained,
        checkpoint_sha256=sha,
        precision="fp32",
        device=spec.device,
        embed_dim=int(model.text_projection.shape[-1]) if hasattr(model, "text_projection") else _embed_dim(model),
        preprocess=_jsonable(pp),
        text_pooling="argmax (EOT token)",
    )
    context_length = int(getattr(tokenizer, "context_length", 77))
    return Estimator(model, tokenizer, preprocess, info, context_length)


def _embed_dim(model: Any) -> int:
    import torch

    with torch.inference_mode():
        device = next(model.parameters()).device
        return int(model.encode_text(torch.zeros((1, 8), dtype=torch.long, device=device)).shape[-1])


#: Seconds to wait for a TCP connection to the model hub before taking it as unreachable.
HUB_PROBE_TIMEOUT_S = 3.0


def _hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the model hub (``huggingface_hub``'s endpoint, ``HF_ENDPOINT``) answers a TCP
    connection within ``timeout`` seconds. Why a probe of our own: offline, the hub client
    retries each file with back-off (52 s measured before the error) where one refused or
    unresolvable connection says enough. True where it cannot tell (a proxy is configured:
    only the client knows how to reach the hub through it); False in offline mode."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.is_offline_mode():
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlsplit(str(getattr(constants, "ENDPOINT", "https://huggingface.co")))
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _hub_offline(on: bool) -> Iterator[None]:
    """Within the block (when ``on``), the hub client reads only its local cache: a tag
    downloaded before still loads, any other fails at once instead of retrying."""
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    if on:
        constants.HF_HUB_OFFLINE = True  # read at call time (constants.is_offline_mode)
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def _load_error(spec: EstimatorSpec, exc: Exception, offline: bool = False) -> ModelLoadError:
    if spec.pretrained:
        cause = ("the model hub cannot be reached and the tag is not in the local cache"
                 if offline and "download" in str(exc).lower() else f"{type(exc).__name__}: {first_line(exc)}")
        return ModelLoadError(
            f"could not load pretrained weights {spec.pretrained!r} for {spec.model!r} "
            f"({cause}). Without network access, download the checkpoint "
            "elsewhere and pass it with --checkpoint /path/to/open_clip_model.safetensors"
        )
    return ModelLoadError(f"could not build {spec.model!r} from {spec.checkpoint!r}: {exc}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _choose_precision(fp32: Estimator, requested: str) -> Estimator:
    if requested == "fp32":
        return fp32
    cpu = fp32.info.device == "cpu"
    if requested == "auto" and cpu and (fp32.info.arch not in BF16_FASTER_ON_CPU or not cpu_has_amx()):
        return fp32
    if requested == "auto" and fp32.info.arch in BF16_DISAGREES:
        return fp32  # measured: the probe below would copy the model only to refuse bf16
    bf16 = _to_bf16(fp32)
    agreement = _agreement(fp32, bf16)
    if agreement >= BF16_MIN_COSINE:
        return bf16
    if requested == "bf16":
        log.warning("bf16 embeddings agree with fp32 only to cosine %.5f", agreement)
        return bf16
    # ``auto`` (the only request left here) choosing fp32 is the rule working, not news: a
    # warning on every GPU job of pairclean-lite would teach users to ignore warnings.
    log.info("bf16 embeddings agree with fp32 only to cosine %.5f < %.3f: staying with fp32", agreement, BF16_MIN_COSINE)
    return fp32


def _choose_engine(est: Estimator, requested: str) -> Estimator:
    """``est`` with its image tower on ONNX Runtime where that was measured faster
    (pairclean-lite, fp32, CPU: ``estimators.engines``) and agrees with PyTorch on the
    probe (cosine >= 0.999, as for bf16); else ``est`` unchanged."""
    import torch

    info = est.info
    if requested == "torch" or info.arch != DEFAULT_MODEL or info.device != "cpu" or info.precision != "fp32":
        return est
    built = onnx_image_runner(est.model.visual, est.image_size, torch.get_num_threads())
    if built is None:
        return est
    runner, engine = built
    candidate = Estimator(est.model, est.tokenizer, est.preprocess, replace(info, engine=engine), est.context_length, runner)
    agreement = _agreement(est, candidate)
    if agreement >= BF16_MIN_COSINE:
        return candidate
    log.warning("ONNX Runtime embeddings agree with PyTorch only to cosine %.5f < %.3f: staying with PyTorch",
                agreement, BF16_MIN_COSINE)
    return est


def _to_bf16(fp32: Estimator) -> Estimator:
    import torch

    model = copy.deepcopy(fp32.model).to(torch.bfloat16)
    info = replace(fp32.info, precision="bf16")
    return Estimator(model, fp32.tokenizer, fp32.preprocess, info, fp32.context_length)


def _agreement(a: Estimator, b: Estimator) -> float:
    """Smallest cosine between the embeddings of two estimators of one model (fp32 against
    bf16, or PyTorch against another engine) on a fixed probe."""
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(1234)
    size = a.image_size
    # Smooth random images (upsampled noise) look more like photos than white noise.
    coarse = torch.rand((8, 3, 8, 8), generator=gen)
    pixels = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear")
    pixels = (pixels - 0.5) / 0.25
    texts = [
        "a dog running on the grass",
        "two children playing in the snow",
        "a man riding a bicycle down a city street",
        "a plate of food on a wooden table",
    ]
    cos_img = (a.encode_images(pixels) * b.encode_images(pixels)).sum(axis=1)
    cos_txt = (a.encode_texts(texts) * b.encode_texts(texts)).sum(axis=1)
    return float(np.minimum(cos_img.min(), cos_txt.min()))
