"""Training pairclean-lite's projection heads on frozen tower features (the LiT recipe).

1. ``extract_features``: run both locked towers once over Flickr8k (cached on disk):
   (I, 1280) pooled EfficientNet-Lite0 features and (C, 384) mean-pooled MiniLM features.
2. ``train_heads``: train ``visual.head`` and ``text.proj`` (built from the open_clip config,
   so their keys are the model's) with a symmetric InfoNCE loss on the train split.
3. ``evaluate``: on the dev split, ROC-AUC of true against shuffled captions and
   retrieval recall, which select the recipe.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pairclean.lite.evaldata import FlickrImage, load_flickr8k

__all__ = [
    "Features",
    "HeadRecipe",
    "extract_features",
    "train_heads",
    "evaluate",
    "lite_config",
    "save_heads",
    "roc_auc",
]

log = logging.getLogger(__name__)


@dataclass
class Features:
    """Frozen tower features of a Flickr8k split.

    ``image``: (I, 1280) float32; ``text``: (C, 384) float32; ``caption_image``: (C,) index
    into ``image`` of each caption's photo.
    """

    image: NDArray[np.float32]
    text: NDArray[np.float32]
    caption_image: NDArray[np.int64]
    names: list[str]


@dataclass(frozen=True)
class HeadRecipe:
    """One training recipe for the heads (all choices recorded in the heads file)."""

    proj: str = "linear"  # linear | mlp
    embed_dim: int = 512
    temperature: float = 0.1  # initial value; learnable if learn_temperature
    learn_temperature: bool = False
    epochs: int = 3  # the heads overfit Flickr8k quickly: 10 epochs lost 0.02 AUC
    lr: float = 1e-3
    weight_decay: float = 0.1
    batch_size: int = 256
    all_captions: bool = True  # all five captions per image, else the first only
    mask_same_image: bool = True  # other captions of the same photo are not negatives
    seed: int = 0


def lite_config(recipe: HeadRecipe) -> dict[str, Any]:
    """The open_clip model config of pairclean-lite with the heads of ``recipe``."""
    base = json.loads((resources.files("pairclean") / "data" / "pairclean-lite.json").read_text())
    cfg = copy.deepcopy(base)
    cfg["embed_dim"] = recipe.embed_dim
    cfg["vision_cfg"]["timm_proj"] = recipe.proj
    cfg["text_cfg"]["hf_proj_type"] = recipe.proj
    return dict(cfg)


def _batched_image_features(model: Any, preprocess: Any, paths: list[Path], batch: int) -> NDArray[np.float32]:
    import torch
    from PIL import Image

    out = []
    for start in range(0, len(paths), batch):
        imgs = []
        for p in paths[start : start + batch]:
            with Image.open(p) as im:
                imgs.append(preprocess(im.convert("RGB")))
        with torch.inference_mode():
            x = torch.stack(imgs).contiguous(memory_format=torch.channels_last)
            out.append(model.visual.trunk(x).float().numpy())
        if start // batch % 20 == 0:
            log.info("image features %d/%d", start + len(imgs), len(paths))
    return np.concatenate(out)


def _batched_text_features(model: Any, tokenizer: Any, texts: list[str], batch: int) -> NDArray[np.float32]:
    import torch

    out = []
    pad = model.text.config.pad_token_id
    for start in range(0, len(texts), batch):
        ids = tokenizer(texts[start : start + batch])
        mask = (ids != pad).long()
        with torch.inference_mode():
            hidden = model.text.transformer(input_ids=ids, attention_mask=mask)
            out.append(model.text.pooler(hidden, mask).float().numpy())
    return np.concatenate(out)


def extract_features(root: Path, cache: Path, batch: int = 64) -> dict[str, Features]:
    """Features of every Flickr8k split, computed once and cached in ``cache`` (npz per split)."""
    import open_clip
    import torch
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from pairclean.embed.estimators.base import file_sha256
    from pairclean.embed.estimators.lite import TrimmedTokenizer, build_lite_model, tower_paths

    image_path, text_dir = tower_paths()
    tag = hashlib.sha256(f"{file_sha256(str(image_path))}:{file_sha256(str(Path(text_dir) / 'model.safetensors'))}".encode()).hexdigest()[:12]
    cache.mkdir(parents=True, exist_ok=True)
    result: dict[str, Features] = {}
    model = tokenizer = preprocess = None
    for split in ("train", "dev"):
        path = cache / f"flickr8k-{split}-{tag}.npz"
        if path.exists():
            data = np.load(path, allow_pickle=False)
            result[split] = Features(data["image"], data["text"], data["caption_image"], list(data["names"]))
            continue
        if model is None:
            model = build_lite_model(lite_config(HeadRecipe()), "cpu")
            model.visual.to(memory_format=torch.channels_last)  # measured 1.7x faster on CPU
            pp = open_clip.get_model_preprocess_cfg(model)
            preprocess = image_transform_v2(PreprocessCfg(**pp), is_train=False)
            tokenizer = TrimmedTokenizer(open_clip.tokenizer.HFTokenizer(text_dir, context_length=64))
        images = load_flickr8k(root, split)
        feats = _features_of(images, model, preprocess, tokenizer, batch)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, image=feats.image, text=feats.text, caption_image=feats.caption_image, names=np.array(feats.names))
        tmp.replace(path)
        result[split] = feats
    return result


def _features_of(images: list[FlickrImage], model: Any, preprocess: Any, tokenizer: Any, batch: int) -> Features:
    t0 = time.perf_counter()
    img = _batched_image_features(model, preprocess, [i.path for i in images], batch)
    texts = [c for i in images for c in i.captions]
    owner = np.array([k for k, i in enumerate(images) for _ in i.captions], dtype=np.int64)
    txt = _batched_text_features(model, tokenizer, texts, 256)
    log.info("features of %d images / %d captions in %.0f s", len(images), len(texts), time.perf_counter() - t0)
    return Features(img.astype(np.float32), txt.astype(np.float32), owner, [i.image for i in images])


def _heads(recipe: HeadRecipe) -> tuple[Any, Any]:
    """Fresh ``visual.head`` and ``text.proj`` modules exactly as open_clip builds them."""
    import torch
    from pairclean.embed.estimators.lite import build_lite_model

    torch.manual_seed(recipe.seed)
    model = build_lite_model(lite_config(recipe), "cpu")
    return model.visual.head, model.text.proj


def train_heads(train: Features, recipe: HeadRecipe, weights: NDArray[np.float32] | None = None) -> dict[str, Any]:
    """Train both heads on ``train`` with symmetric InfoNCE; returns the heads' state dict.

    ``weights``: optional (C,) per-caption weights (pairclean weights, 0 drops a pair):
    each pair's loss in both directions is multiplied by its weight and the batch mean is
    over the batch size, as OSA trains (see ``pairclean.losses.weighted_clip_loss``).
    Keys are prefixed ``visual.head.`` and ``text.proj.`` (the open_clip model's names).
    """
    import torch
    import torch.nn.functional as F

    vhead, tproj = _heads(recipe)
    gen = torch.Generator().manual_seed(recipe.seed)
    img = torch.from_numpy(train.image)
    txt = torch.from_numpy(train.text)
    owner = torch.from_numpy(train.caption_image)
    w_all = torch.from_numpy(np.asarray(weights, dtype=np.float32)) if weights is not None else torch.ones(len(txt))
    if not recipe.all_captions:
        first = np.unique(train.caption_image, return_index=True)[1]
        txt, owner, w_all = txt[first], owner[first], w_all[first]
    log_t = torch.nn.Parameter(torch.tensor(float(np.log(recipe.temperature))), requires_grad=recipe.learn_temperature)
    params = list(vhead.parameters()) + list(tproj.parameters()) + ([log_t] if recipe.learn_temperature else [])
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    steps = recipe.epochs * ((len(txt) + recipe.batch_size - 1) // recipe.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=max(1, steps), pct_start=0.1)
    vhead.train()
    tproj.train()
    for _ in range(recipe.epochs):
        order = torch.randperm(len(txt), generator=gen)
        for start in range(0, len(order), recipe.batch_size):
            idx = order[start : start + recipe.batch_size]
            owners = owner[idx]
            zi = F.normalize(vhead(img[owners]), dim=-1)
            zt = F.normalize(tproj(txt[idx]), dim=-1)
            logits = zi @ zt.T / log_t.exp().clamp(min=0.01)
            if recipe.mask_same_image:
                same = owners[:, None] == owners[None, :]
                logits = logits.masked_fill(same & ~torch.eye(len(idx), dtype=torch.bool), float("-inf"))
            target = torch.arange(len(idx))
            per_pair = F.cross_entropy(logits, target, reduction="none") + F.cross_entropy(logits.T, target, reduction="none")
            loss = (w_all[idx] * per_pair).sum() / (2 * len(idx))
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
    state = {f"visual.head.{k}": v.detach().clone().contiguous() for k, v in vhead.state_dict().items()}
    state.update({f"text.proj.{k}": v.detach().clone().contiguous() for k, v in tproj.state_dict().items()})
    return state


def roc_auc(scores: NDArray[np.float64], labels: NDArray[np.bool_]) -> float:
    """ROC-AUC of ``scores`` for the positive ``labels`` (rank formulation, ties averaged)."""
    from scipy.stats import rankdata

    pos = labels.astype(bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(scores)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _project(state: dict[str, Any], recipe: HeadRecipe, feats: Features) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    import torch
    import torch.nn.functional as F

    vhead, tproj = _heads(recipe)
    vhead.load_state_dict({k[len("visual.head."):]: v for k, v in state.items() if k.startswith("visual.head.")})
    tproj.load_state_dict({k[len("text.proj."):]: v for k, v in state.items() if k.startswith("text.proj.")})
    vhead.eval()
    tproj.eval()
    with torch.inference_mode():
        zi = F.normalize(vhead(torch.from_numpy(feats.image)), dim=-1).numpy()
        zt = F.normalize(tproj(torch.from_numpy(feats.text)), dim=-1).numpy()
    return zi, zt


def evaluate(state: dict[str, Any], recipe: HeadRecipe, dev: Features, seed: int = 0) -> dict[str, float]:
    """Dev metrics: AUC true vs shuffled caption (first caption of every image), R@1/5 both ways."""
    zi, zt = _project(state, recipe, dev)
    first = np.unique(dev.caption_image, return_index=True)[1]
    t1 = zt[first]  # (I, D) the first caption of each image
    n = len(zi)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    shuffled = t1[np.roll(perm, 1)][np.argsort(perm)]  # a derangement: never the own caption
    true_sim = (zi * t1).sum(1)
    false_sim = (zi * shuffled).sum(1)
    auc = roc_auc(np.concatenate([true_sim, false_sim]), np.r_[np.ones(n, bool), np.zeros(n, bool)])
    sims = zi @ t1.T
    rank_i2t = (sims > np.diag(sims)[:, None]).sum(1)
    rank_t2i = (sims > np.diag(sims)[None, :]).sum(0)
    metrics = {"auc_true_vs_shuffled": auc}
    for k in (1, 5, 10):
        metrics[f"i2t_r{k}"] = float((rank_i2t < k).mean())
        metrics[f"t2i_r{k}"] = float((rank_t2i < k).mean())
    return metrics


def save_heads(path: Path, state: dict[str, Any], recipe: HeadRecipe, metrics: dict[str, Any]) -> str:
    """Write the heads as safetensors with config, recipe and metrics in the metadata; returns sha256."""
    from safetensors.torch import save_file

    from pairclean.storage import sha256_file

    meta = {
        "open_clip_config": json.dumps(lite_config(recipe), sort_keys=True),
        "recipe": json.dumps(asdict(recipe), sort_keys=True),
        "dev_metrics": json.dumps(metrics, sort_keys=True),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(tmp), metadata=meta)
    tmp.replace(path)
    return sha256_file(path)
