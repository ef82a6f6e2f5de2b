"""What unlocking the towers' top layers would buy pairclean-lite (LiT's locked-or-not question).

pairclean-lite trains two linear heads on locked towers. This trains, on Flickr8k train with
the shipped recipe (symmetric InfoNCE, T = 0.1, AdamW one-cycle, batch 256, same-photo
captions masked, seed 0), three variants and prints their figures on dev after each epoch:

- ``locked``: the heads only (the shipped recipe, on cached pooled features);
- ``text-top2``: the heads and MiniLM's last two layers (lr ``--text-lr``; the lower four
  layers' outputs are computed once and cached);
- ``image-head``: the heads and EfficientNet-Lite0's last 1x1 conv and batch norm
  (``conv_head``/``bn2``, lr ``--image-lr``) on the cached 7x7 regions of the judge's
  feature cache (``pairclean train-judge --features-cache DIR`` builds it).

Figures, dev only (one pair per photo, its first caption): AUC of the cosine against
another photo's caption (``random``), the first caption of the most alike other photo
(``near-image``) and the caption most alike the own caption (``near-text``), neighbours by
the shipped model's embeddings (``benchmarks/_embed_dev.py``; the same pairs for every
variant), and R@1 both ways. Usage:
``python benchmarks/unlock.py --judge-cache DIR [--variants locked text-top2 image-head]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from _common import flickr_root
from _embed_dev import embed_dev

from pairclean.calibrate.calibration import cache_dir as _default_cache

VARIANTS = ("locked", "text-top2", "image-head")
UNLOCKED_TEXT_LAYERS = 2


def _auc(pos: np.ndarray, neg: np.ndarray) -> float:
    from pairclean.lite.train import roc_auc

    return roc_auc(np.r_[pos, neg].astype(np.float64), np.r_[np.ones(len(pos), bool), np.zeros(len(neg), bool)])


def _mask_bias(mask: Any) -> Any:
    """The additive attention bias (N, 1, 1, L) of a (N, L) bool mask, as BERT layers take it."""
    return (1.0 - mask[:, None, None, :].float()) * -1e4


def lower_text_states(bert: Any, tokenizer: Any, texts: list[str], frozen: int, path: Path) -> tuple[Any, Any]:
    """(N, L, 384) float16 outputs of MiniLM's first ``frozen`` layers and (N, L) masks (cached at ``path``)."""
    import torch

    if path.exists():
        saved = torch.load(path)
        return saved["states"], saved["mask"]
    ids = tokenizer(texts)
    mask = ids != 0
    width = int(mask.any(0).nonzero().max()) + 1
    ids, mask = ids[:, :width], mask[:, :width]
    parts = []
    with torch.inference_mode():
        for s in range(0, len(ids), 512):
            x = bert.embeddings(input_ids=ids[s : s + 512])
            bias = _mask_bias(mask[s : s + 512])
            for layer in bert.encoder.layer[:frozen]:
                out = layer(x, attention_mask=bias)
                x = out[0] if isinstance(out, tuple) else out
            parts.append(x.half())
    states = torch.cat(parts)
    torch.save({"states": states, "mask": mask}, path)
    return states, mask


def evaluate(image: np.ndarray, text: np.ndarray, owner: np.ndarray, neighbours: dict[str, np.ndarray]) -> dict[str, float]:
    """Dev figures of normalised (I, D) image and (C, D) caption embeddings (``owner``: photo of each caption)."""
    n = len(image)
    first = np.unique(owner, return_index=True)[1]
    own = text[first]
    pos = (image * own).sum(1)
    rand = (image * own[np.random.default_rng(0).permutation(n)]).sum(1)
    per_photo = text.reshape(n, 5, -1)
    near_img = (image * own[neighbours["image"]]).sum(1)
    near_txt = (image * per_photo[neighbours["text_image"], neighbours["text_caption"]]).sum(1)
    sims = image @ own.T
    return {"random": _auc(pos, rand), "near_image": _auc(pos, near_img), "near_text": _auc(pos, near_txt),
            "r1_i2t": float((sims.argmax(1) == np.arange(n)).mean()), "r1_t2i": float((sims.argmax(0) == np.arange(n)).mean())}


def dev_neighbours(cache: Path) -> dict[str, np.ndarray]:
    """The hard-noise benchmark's neighbours of each dev photo (shipped model's embeddings)."""
    import hard_noise

    emb = embed_dev(cache / "dev_lite.npz")
    image = hard_noise._nearest(emb["img"])
    text_image, text_caption = hard_noise._near_text(emb["txt"])
    return {"image": image, "text_image": text_image, "text_caption": text_caption}


def train_variant(variant: str, data: dict[str, Any], args: argparse.Namespace, neighbours: dict[str, np.ndarray]) -> None:
    """Train one variant and print a JSON line of dev figures after each epoch."""
    import copy

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    vhead, tproj = torch.nn.Linear(1280, 512, bias=False), torch.nn.Linear(384, 512, bias=False)
    groups = [{"params": [*vhead.parameters(), *tproj.parameters()], "lr": 1e-3, "weight_decay": 0.1}]
    top = torch.nn.ModuleList()
    conv, bn = copy.deepcopy(data["conv_head"]), copy.deepcopy(data["bn2"])
    if variant == "text-top2":
        top = copy.deepcopy(data["top_layers"])
        groups.append({"params": list(top.parameters()), "lr": args.text_lr, "weight_decay": 0.01})
    if variant == "image-head":
        groups.append({"params": [*conv.parameters(), *bn.parameters()], "lr": args.image_lr, "weight_decay": 0.01})

    def encode_text(split: str, idx: Any) -> Any:
        if variant != "text-top2":
            return F.normalize(tproj(data[f"pooled_text_{split}"][idx]), dim=-1)
        states, mask = data[f"states_{split}"][idx], data[f"mask_{split}"][idx]
        width = int(mask.any(0).nonzero().max()) + 1
        x, mask = states[:, :width].float(), mask[:, :width]
        for layer in top:
            out = layer(x, attention_mask=_mask_bias(mask))
            x = out[0] if isinstance(out, tuple) else out
        m = mask.unsqueeze(-1).float()
        return F.normalize(tproj((x * m).sum(1) / m.sum(1).clamp(min=1)), dim=-1)

    def encode_image(split: str, idx: Any) -> Any:
        if variant != "image-head":
            return F.normalize(vhead(data[f"pooled_image_{split}"][idx]), dim=-1)
        regions = data[f"regions_{split}"][idx].float().transpose(1, 2).reshape(len(idx), 320, 7, 7)
        return F.normalize(vhead(bn(conv(regions)).mean((2, 3))), dim=-1)

    owner = data["owner_train"]
    opt = torch.optim.AdamW(groups)
    batch = 256
    steps = args.epochs * ((len(owner) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[g["lr"] for g in groups], total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(0)
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        top.train()
        bn.train()
        order = torch.randperm(len(owner), generator=gen)
        for s in range(0, len(owner), batch):
            idx = order[s : s + batch]
            logits = encode_image("train", owner[idx]) @ encode_text("train", idx).T / 0.1
            same = (owner[idx][:, None] == owner[idx][None, :]) & ~torch.eye(len(idx), dtype=torch.bool)
            logits = logits.masked_fill(same, -1e4)  # another caption of the same photo is no negative
            target = torch.arange(len(idx))
            loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        seconds = time.perf_counter() - t0
        top.eval()
        bn.eval()
        with torch.no_grad():
            dev_images = torch.arange(len(data["pooled_image_dev"]))
            image = encode_image("dev", dev_images).numpy()
            text = torch.cat([encode_text("dev", torch.arange(s, min(s + 500, len(data["owner_dev"]))))
                              for s in range(0, len(data["owner_dev"]), 500)]).numpy()
        row = {k: round(v, 4) for k, v in evaluate(image, text, data["owner_dev"].numpy(), neighbours).items()}
        print(json.dumps({"variant": variant, "epoch": epoch + 1, "train_seconds": round(seconds, 1), **row}), flush=True)


def load_data(args: argparse.Namespace, variants: list[str]) -> dict[str, Any]:
    """Pooled features, the towers' unlockable parts, and what each variant reads, per split."""
    import open_clip
    import torch

    from pairclean.embed.estimators.lite import build_lite_model, tower_paths
    from pairclean.lite.evaldata import load_flickr8k
    from pairclean.lite.train import HeadRecipe, extract_features, lite_config

    root = flickr_root()
    cache = Path(args.cache)
    feats = extract_features(root, cache / "features")
    model = build_lite_model(lite_config(HeadRecipe()), "cpu")
    bert = model.text.transformer
    frozen = len(bert.encoder.layer) - UNLOCKED_TEXT_LAYERS
    data: dict[str, Any] = {"conv_head": model.visual.trunk.conv_head, "bn2": model.visual.trunk.bn2,
                            "top_layers": torch.nn.ModuleList(bert.encoder.layer[frozen:])}
    tokenizer = open_clip.tokenizer.HFTokenizer(tower_paths()[1], context_length=64)
    for split in ("train", "dev"):
        f = feats[split]
        data[f"pooled_image_{split}"] = torch.from_numpy(f.image)
        data[f"pooled_text_{split}"] = torch.from_numpy(f.text)
        data[f"owner_{split}"] = torch.from_numpy(f.caption_image)
        if "text-top2" in variants:
            texts = [c for image in load_flickr8k(root, split) for c in image.captions]
            data[f"states_{split}"], data[f"mask_{split}"] = lower_text_states(
                bert, tokenizer, texts, frozen, cache / f"unlock-minilm-{frozen}-{split}.pt")
        if "image-head" in variants:
            regions = np.load(Path(args.judge_cache) / f"images-{split}.npz", allow_pickle=False)
            if list(regions["names"]) != list(f.names):
                raise SystemExit(f"{args.judge_cache}: images-{split}.npz lists other photos than the pooled features")
            data[f"regions_{split}"] = torch.from_numpy(regions["regions"])
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--judge-cache", default=None, help="the judge's feature cache (regions), for image-head")
    ap.add_argument("--cache", default=str(_default_cache() / "unlock"))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--text-lr", type=float, default=3e-5)
    ap.add_argument("--image-lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    if "image-head" in args.variants and not args.judge_cache:
        raise SystemExit("image-head needs --judge-cache DIR (built by `pairclean train-judge --features-cache DIR`)")
    torch.set_num_threads(args.threads)
    data = load_data(args, args.variants)
    neighbours = dev_neighbours(Path(args.cache).parent / "hard_noise")
    for variant in args.variants:
        train_variant(variant, data, args, neighbours)


if __name__ == "__main__":
    main()
