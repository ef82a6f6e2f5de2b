"""Compare judge training recipes on the cached Flickr8k features (train/dev only).

Trains one recipe on the features `pairclean train-judge` caches (``--cache``, default
``pairclean train-judge --features-cache`` style: images-*.npz, texts-*.npz; see pairclean.lite.judge_data) and
prints, after each epoch, the same dev evaluation as train-judge's report: AUC of the
judge's logit, clean first captions against each noise kind, and the plain cosine's AUC.
Nothing is written; image features are never recomputed. A wall-clock ``--budget`` bounds
the run (the epoch in progress is cut and evaluated).

Recipes:
- ``xattn``: the shipped model (pairclean.judge.model.Judge) and sampling (judge_train);
- ``xattn_pair``: the same, plus a ranking loss softplus(s(img, edit) - s(img, own caption))
  on every one-word edit in the batch (the edit's source caption scored on the same photo);
  ``--edit-rep 2`` repeats the edit negatives;
- ``late``: FILIP-like late interaction (per caption token, the max cosine over projected
  regions, attention-weighted mean) plus an MLP over [pooled tokens, pooled regions, product,
  |difference|, cosine].

    python benchmarks/judge_recipes.py xattn_pair --epochs 1 --lr 1e-3 --budget 380
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pairclean.calibrate.calibration import cache_dir
from pairclean.judge.model import Judge, JudgeConfig
from pairclean.lite import judge_train as jt
from pairclean.lite.judge_data import SplitFeatures, load_split


class LateInteraction(nn.Module):
    """Per token: max cosine over regions in a learned space; weighted mean; plus a pooled MLP head."""

    def __init__(self, text_dim: int = 384, image_dim: int = 320, width: int = 128) -> None:
        super().__init__()
        self.t = nn.Sequential(nn.LayerNorm(text_dim), nn.Linear(text_dim, width))
        self.i = nn.Sequential(nn.LayerNorm(image_dim), nn.Linear(image_dim, width))
        self.token_weight = nn.Linear(text_dim, 1)
        self.scale = nn.Parameter(torch.tensor(10.0))
        self.cos_scale = nn.Parameter(torch.tensor(10.0))
        self.bias = nn.Parameter(torch.tensor(-2.0))
        self.mlp = nn.Sequential(nn.Linear(4 * width + 1, 256), nn.GELU(), nn.Linear(256, 1))

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, regions: torch.Tensor, cosine: torch.Tensor) -> torch.Tensor:
        t = nn.functional.normalize(self.t(tokens.float()), dim=-1)
        r = nn.functional.normalize(self.i(regions.float()), dim=-1)
        best = torch.einsum("nlw,nrw->nlr", t, r).max(-1).values
        a = self.token_weight(tokens.float()).squeeze(-1).masked_fill(~mask, -1e4).softmax(-1)
        m = mask.unsqueeze(-1).float()
        pt, pr = (t * m).sum(1) / m.sum(1).clamp_min(1), r.mean(1)
        pooled = self.mlp(torch.cat([pt, pr, pt * pr, (pt - pr).abs(), cosine.float()[:, None]], -1)).squeeze(-1)
        out: torch.Tensor = self.scale * (a * best).sum(-1) + self.cos_scale * cosine.float() + self.bias + pooled
        return out


def run(model: nn.Module, train: SplitFeatures, dev: SplitFeatures, args: argparse.Namespace) -> None:
    """Train ``model`` (BCE as judge_train, optional edit ranking loss) and print dev AUCs per epoch."""
    rec = jt.JudgeRecipe(epochs=args.epochs, lr=args.lr, batch=args.batch)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    real = np.nonzero(train.kind == "")[0]
    edit_of = {int(s): int(r) for r, s in enumerate(train.source) if s >= 0}
    n_img = len(train.image_emb)
    t2i = jt._topk_excluding(train.text_emb[real], train.image_emb, train.image[real], np.arange(n_img), rec.top_k)
    i2t = jt._topk_excluding(train.image_emb, train.text_emb[real], np.arange(n_img), train.image[real], rec.top_k)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    pairs = jt.dev_pairs(dev)
    started, step = time.perf_counter(), 0
    report: dict[str, dict[str, float]] = {}
    for epoch in range(args.epochs):
        img, txt, lab = jt._epoch_pairs(train, real, edit_of, t2i, i2t, rec, rng)
        if args.edit_rep > 1:  # repeat the edit negatives
            extra = np.repeat(np.nonzero(train.source[txt] >= 0)[0], args.edit_rep - 1)
            img, txt, lab = np.r_[img, img[extra]], np.r_[txt, txt[extra]], np.r_[lab, lab[extra]]
            order = rng.permutation(len(lab))
            img, txt, lab = img[order], txt[order], lab[order]
        total = math.ceil(len(lab) / args.batch) * args.epochs
        pos_w = float((lab == 0).sum() / (lab == 1).sum())
        model.train()
        for s in range(0, len(lab), args.batch):
            lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / total)) * min(1.0, (step + 1) / 100)
            for group in opt.param_groups:
                group["lr"] = lr
            y = torch.from_numpy(lab[s : s + args.batch])
            logits = model(*jt._tensors(train, img[s : s + args.batch], txt[s : s + args.batch]))
            w = torch.where(y > 0, torch.tensor(pos_w), torch.tensor(1.0))
            loss = nn.functional.binary_cross_entropy_with_logits(logits, y, weight=w) / (0.5 * (1 + pos_w))
            # own caption above its edit, same photo (the shipped recipe's term)
            loss = loss + jt.ranking_loss(model, train, img[s : s + args.batch], txt[s : s + args.batch], logits, args.pair_weight)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if time.perf_counter() - started > args.budget:
                break
        report = jt.evaluate(model, dev, pairs)
        row: dict[str, Any] = {"epoch": epoch + 1, "seconds": round(time.perf_counter() - started),
                               "mean": round(jt._selection_score(report), 4)}
        print({**row, **{k: round(v["judge_auc"], 3) for k, v in report.items()}}, flush=True)
        if time.perf_counter() - started > args.budget:
            break
    print("cosine", {k: round(v["cosine_auc"], 3) for k, v in report.items()}, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", choices=["xattn", "xattn_pair", "late"])
    p.add_argument("--cache", default=str(cache_dir() / "judge" / "lite0"))
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--edit-rep", type=int, default=1)
    p.add_argument("--pair-weight", type=float, default=None, help="default: 1 for xattn_pair, else 0")
    p.add_argument("--budget", type=float, default=380.0, help="wall-clock seconds")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.pair_weight is None:
        args.pair_weight = 1.0 if args.recipe == "xattn_pair" else 0.0
    torch.set_num_threads(args.threads)
    train, dev = load_split(Path(args.cache), "train"), load_split(Path(args.cache), "dev")
    if args.recipe == "late":
        model: nn.Module = LateInteraction(train.tokens.shape[2], train.regions.shape[2])
    else:
        model = Judge(JudgeConfig(text_dim=train.tokens.shape[2], image_dim=train.regions.shape[2],
                                  regions=train.regions.shape[1], width=128, layers=1, heads=4))
    run(model, train, dev, args)


if __name__ == "__main__":
    main()
