"""Does training on noisy pairs get better with pairclean's weights? (Flickr8k, one split)

Setup, all on frozen pairclean-lite tower features (cached by ``pairclean train-lite``, or
by the first run of this script, ~10 minutes on 2 cores):

- The train split's photos are split in two halves by a seeded permutation. The
  *estimator* is pairclean-lite's recipe trained on half A (clean), so it has never seen
  half B's pairs; the *student* trains on half B (all five captions per photo, 15,000
  pairs) in which a fraction of captions (0%, 20%, 50%, 80%) is moved to other photos.
- Half B is scored with the pairclean library itself, as a job would be: estimator
  embeddings (stored float16, as the sidecars are), beta by the estimator's default recipe
  (gmm), calibrated on the first 4,096 pairs; ``noisy = similarity <= beta``; weights by
  the ``paper`` and ``reference`` weightings and ``p_clean`` (the calibration's pinned
  mixture, what every score table carries). (Photos are not re-decoded: the features are
  exactly what the towers give; ``detection.py`` exercises the score command.)
- Learned estimators (issue 12), the label-free way ``pairclean refine`` does it:
  ``pairclean.refine.fit`` on the noisy half B's own float16 embeddings (all 15,000 pairs,
  below the 500,000-pair sample bound), seed 0, default settings, then ``apply``; a refined
  table's ``weight`` is ``p_clean`` and ``noisy`` is ``p_clean <= 0.5``. The ensemble is
  fitted once and its members' heads (fitted inside it with the same seed and settings as a
  lone fit) give the NCR, DisNCL and SDCMR rows. ``--heads-cache DIR`` keeps fitted heads.
- The student (same head recipe, same budget: 3 epochs) trains with no weights, each
  weight in the loss (``weighted_clip_loss``'s rule: weight times both directions' cross
  entropy, mean over the batch size), each ``noisy`` flag as a hard filter (weight 0/1),
  and only the truly clean pairs (oracle). Retrieval on the dev split (1,000 photos, first
  caption), averaged over ``--student-seeds`` seeds of the student (init and batch order).
- Pseudo-pairs (issue 13), at ``--pseudo-noise`` (50% and 80%): RCSL nearest-neighbour
  pairing as ``pairclean pseudo-pair`` does it, with ``pairclean.pseudo.ann`` (FAISS, exact index
  at this size) in the estimator's space. Pool = the pairs the job flags noisy: their photos
  (each photo once: Flickr has five captions per photo, a web corpus one) and their
  captions. Each pool photo gets its nearest pool caption and each pool caption its nearest
  pool photo (a pseudo-pair found both ways is *mutual*, kept once); a photo's own flagged
  captions are never its pseudo-caption (they were judged mismatched, the multi-caption
  form of "own caption excluded"). Similarity is the exact cosine of the float16 vectors
  (``pairclean.pseudo.pairing.exact_cosine``) and the weight the job's own OSA calibration of it, in
  the same weighting as the base weights. Pseudo-pairs are *added* to half B as extra
  training rows with their weights (a flagged pair's own weight is 0 under ``paper`` and
  small under ``p_clean``, so this is close to the sampler's substitution, plus the t2i
  pairs; an epoch has more steps). Losses: ``infonce`` (the student's weighted loss for every row) or ``rcm``
  (``pairclean.losses.rcm_loss``, RCSL's robust loss, weighted, for the pseudo rows of a
  batch; the weighted InfoNCE for the real rows). Filters, fixed before looking at dev:
  ``all``; ``mutual`` (the ``--mutual`` option); ``minw`` (``--min-weight`` set to the
  median base weight of the pairs the job keeps, a label-free threshold). Control
  ``shuffled``: the ``all`` rows with their captions shuffled among them (same photos, same
  weights): does the nearest-neighbour choice matter, or only the extra weighted rows?

Hard noise (issue 21, ``--kinds near-image edit``): at each ``--noise`` rate the chosen
captions are not moved at random but become near-misses: ``near-image`` moves a photo's
caption to the photo most alike it (cosine of the image tower's pooled features, among half
B), so that photo carries a caption written for a similar-looking image; ``edit`` replaces
the caption with a one-word edit of itself (``pairclean.judge.edits``: object, colour,
count, action, roles, cycling; the text tower runs on the edited captions, ~2 minutes per
3,000). Variants there: ``none``, ``osa_p_clean`` (what a job writes today: the corpus
contrast and the corpus-mixture ``p_clean`` curve, ``docs/methods.md``), ``osa_p_clean_plain``
(the curve on the plain similarity, ``--contrast off``), ``osa_filter`` (the job's noisy
flag) and ``oracle``; R@1 of the weighted student against the clean-only one is the row
pair ``osa_p_clean`` / ``oracle``.

Prints one JSON line per (noise, variant): retrieval R@1/5/10 both ways (mean over the
student seeds), ``r1`` (mean of the two R@1) and its spread over seeds (``r1_sd``), pairs
used, the weight's clean share (truth is used for reporting only), and for pseudo-pair
rows their count, mutual count and the share that are right. Variants: ``none``,
``osa_paper``, ``osa_reference``, ``osa_p_clean``, ``osa_filter``, ``<method>_p_clean``,
``<method>_filter``, ``oracle``, and ``osa_<base>+pseudo_<filter>_<loss>`` (``--pseudo-base``,
default ``paper`` and ``p_clean``). Results: README, "Refining with learned estimators" and
"Pseudo-pairs". Time on the 2-core CPU: 15-30 minutes (idle to shared) with the heads cached, plus
about 10 minutes per noise level to fit them.

    python benchmarks/downstream.py --kinds near-image edit --noise 0.2 --methods --pseudo-noise
    OPENBLAS_CORETYPE=SkylakeX python benchmarks/downstream.py [--noise 0 0.2 0.5 0.8]
        [--methods ncr disncl sdcmr ensemble] [--pseudo-noise 0.5 0.8] [--student-seeds 5]
        [--heads-cache DIR] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from _common import flickr_root

import numpy as np

OSA_WEIGHTS = ("paper", "reference", "p_clean")
PSEUDO_FILTERS = ("all", "mutual", "minw")
PSEUDO_LOSSES = ("infonce", "rcm")


def _subset(feats, image_idx: np.ndarray):
    from pairclean.lite.train import Features

    remap = -np.ones(len(feats.image), dtype=np.int64)
    remap[image_idx] = np.arange(len(image_idx))
    keep = remap[feats.caption_image] >= 0
    return Features(feats.image[image_idx], feats.text[keep], remap[feats.caption_image[keep]], [feats.names[i] for i in image_idx])


def _add_noise(feats, rate: float, seed: int):
    """Move ``rate`` of the captions to other photos (never their own); returns feats, noisy mask."""
    from pairclean.lite.train import Features

    rng = np.random.default_rng(seed)
    owner = feats.caption_image.copy()
    noisy = np.zeros(len(owner), dtype=bool)
    chosen = rng.choice(len(owner), size=int(round(rate * len(owner))), replace=False)
    if len(chosen) >= 2:
        new = owner[rng.permutation(chosen)]
        clash = np.nonzero(new == owner[chosen])[0]
        for i in clash:  # swap with a partner so both land on a foreign photo
            for j in rng.permutation(len(chosen)):
                if new[j] != owner[chosen[i]] and new[i] != owner[chosen[j]]:
                    new[i], new[j] = new[j], new[i]
                    break
        owner[chosen] = new
        noisy[chosen] = owner[chosen] != feats.caption_image[chosen]
    return Features(feats.image, feats.text, owner, feats.names), noisy


def _near_image_noise(feats, rate: float, seed: int):
    """Move ``rate`` of the captions to the photo most alike their own (image tower
    features; never the own photo); returns feats, noisy mask."""
    from pairclean.lite.train import Features

    rng = np.random.default_rng(seed)
    z = feats.image / np.linalg.norm(feats.image, axis=1, keepdims=True)
    sims = z @ z.T
    np.fill_diagonal(sims, -np.inf)
    nearest = sims.argmax(1)
    owner = feats.caption_image.copy()
    chosen = rng.choice(len(owner), size=int(round(rate * len(owner))), replace=False)
    owner[chosen] = nearest[owner[chosen]]
    noisy = owner != feats.caption_image
    return Features(feats.image, feats.text, owner, feats.names), noisy


def _edit_noise(feats, rate: float, seed: int, captions: list[str]):
    """Replace ``rate`` of the captions by a one-word edit of themselves (kinds cycled;
    a caption no kind applies to is skipped); the text tower embeds the edits."""
    import open_clip

    from pairclean.judge.edits import EDIT_KINDS, edit_caption
    from pairclean.embed.estimators.lite import TrimmedTokenizer, build_lite_model, tower_paths
    from pairclean.lite.train import Features, HeadRecipe, _batched_text_features, lite_config

    rng = np.random.default_rng(seed)
    rows, texts = [], []
    for n, r in enumerate(rng.permutation(len(captions))):
        if len(rows) >= int(round(rate * len(captions))):
            break
        for k in range(len(EDIT_KINDS)):
            edited = edit_caption(captions[r], EDIT_KINDS[(n + k) % len(EDIT_KINDS)], rng)
            if edited is not None:
                rows.append(int(r))
                texts.append(edited)
                break
    _, text_dir = tower_paths()
    model = build_lite_model(lite_config(HeadRecipe()), "cpu")
    tokenizer = TrimmedTokenizer(open_clip.tokenizer.HFTokenizer(text_dir, context_length=64))
    text = feats.text.copy()
    text[rows] = _batched_text_features(model, tokenizer, texts, 256)
    noisy = np.zeros(len(captions), dtype=bool)
    noisy[rows] = True
    return Features(feats.image, text, feats.caption_image, feats.names), noisy


def _job_p_clean(estimator_state, recipe, feats, contrast: bool) -> tuple[np.ndarray, np.ndarray]:
    """(p_clean, noisy) as ``pairclean score`` writes them today (no judge): the corpus-mixture
    curve, with the corpus contrast (``--contrast on``, the default; its owners searched as if
    the pairs were one shard) or on the plain similarity."""
    from pairclean import osa
    from pairclean.calibrate.calibration import calibrate
    from pairclean.calibrate.contrast import fit_contrast, table_columns
    from pairclean.job.work import as_recorded
    from pairclean.output.tables import scores_table
    from pairclean.lite.train import _project

    zi, zt = _project(estimator_state, recipe, feats)
    f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731 - what the sidecars store
    img, txt = f16(zi[feats.caption_image]), f16(zt)
    sims = osa.cosine_rows(img, txt)
    n = 4096
    con = fit_contrast(img[:n], txt[:n]) if contrast else None
    cal = calibrate(beta_recipe="gmm", k=256, seed=0, weighting="p-clean", batch_size=64, similarities=sims[:n],
                    image_emb=img[:n], text_emb=txt[:n], random_beta=lambda: float("nan"), contrast=con)
    con = as_recorded(cal, con)  # calibrate may have refitted it (a junk-heavy sample): the tables use the recorded one
    n_all = len(sims)
    adjusted, owner = table_columns(con, sims, img, txt, np.ones(n_all, bool))
    # the job's own table code, so these weights are what a score table would hold
    table = scores_table("downstream", [str(i) for i in range(n_all)], np.arange(n_all), ["ok"] * n_all, [None] * n_all,
                         sims, cal, {}, adjusted=adjusted, owner_margin=owner)
    return table.column("p_clean").to_numpy(), table.column("noisy").to_numpy(zero_copy_only=False)


def _hard_rows(kind: str, rate: float, half_b, captions_b: list[str], estimator, recipe, dev, seeds: list[int], seed: int) -> None:
    """The ``--kinds`` rows of one hard-noise kind and rate (see the module docstring)."""
    noisy_b, truth = _near_image_noise(half_b, rate, seed) if kind == "near-image" else _edit_noise(half_b, rate, seed, captions_b)
    p_contrast, flags = _job_p_clean(estimator, recipe, noisy_b, True)
    p_plain, _ = _job_p_clean(estimator, recipe, noisy_b, False)
    variants = {"none": None, "osa_p_clean": p_contrast, "osa_p_clean_plain": p_plain,
                "osa_filter": (~flags).astype(np.float32), "oracle": (~truth).astype(np.float32)}
    for name, w in variants.items():
        row = {"benchmark": "downstream", "kind": kind, "noise": rate, "pairs": int(len(truth)), "variant": name,
               **_weight_stats(w, truth)}
        if name.startswith("osa_p_clean") and w is not None:
            row["p_clean_clean"], row["p_clean_noisy"] = round(float(w[~truth].mean()), 4), round(float(w[truth].mean()), 4)
        row.update(_student(noisy_b, recipe, dev, seeds, w))
        print(json.dumps(row), flush=True)


@dataclass
class Scored:
    """Half B as a scored job holds it: per-photo and per-caption float16 embeddings (as
    float32 arrays), each pair's similarity, the calibration and the OSA weightings."""

    photo: np.ndarray  # (I, D) estimator image embeddings, float16 values
    text: np.ndarray  # (C, D) estimator text embeddings, float16 values
    owner: np.ndarray  # (C,) photo of each (noisy) pair
    sims: np.ndarray  # (C,) float32 cosine, as scoring computes it
    cal: Any
    d_ref: float

    def weight(self, kind: str, sims: np.ndarray | None = None) -> np.ndarray:
        """The job's OSA ``kind`` (paper | reference | p_clean) of ``sims`` (default: the pairs')."""
        from pairclean import osa

        s = self.sims if sims is None else sims
        if kind == "p_clean":
            e = self.cal.extra
            return osa.mixture_posterior_clean(s, tuple(e["gmm_means"]), tuple(e["gmm_stds"]), e["gmm_noise_weight"])
        return osa.apply_weighting(s, self.cal.beta, osa.WeightingParams(kind, self.d_ref if kind == "reference" else None))

    @property
    def flags(self) -> np.ndarray:
        from pairclean import osa

        return osa.noisy_flags(self.sims, self.cal.beta)


def _score(estimator_state, recipe, feats) -> Scored:
    """Score (image, caption) pairs through the library, as ``pairclean score`` does."""
    from pairclean import osa
    from pairclean.calibrate.calibration import calibrate
    from pairclean.lite.train import _project

    zi, zt = _project(estimator_state, recipe, feats)
    img, txt = zi[feats.caption_image], zt
    sims = osa.cosine_rows(img, txt)
    n = 4096
    f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731 - what the sidecars store
    cal = calibrate(
        beta_recipe="gmm", k=256, seed=0, weighting="paper", batch_size=64, similarities=sims[:n],
        image_emb=f16(img[:n]), text_emb=f16(txt[:n]), random_beta=lambda: float("nan"),
    )
    d_ref = osa.weighting_params("reference", sims[:n], cal.beta, 64).d_ref
    return Scored(f16(zi), f16(zt), feats.caption_image, sims, cal, float(d_ref))


def _refined(scored: Scored, methods: list[str], seed: int, cache: Path | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(raw score, p_clean) of every pair under each method, fitted on the pairs themselves."""
    from pairclean import refine
    from pairclean.refine import ensemble

    img, txt = scored.photo[scored.owner], scored.text
    heads = None
    path = None
    if cache is not None:
        digest = hashlib.sha256(img.tobytes() + txt.tobytes()).hexdigest()[:16]
        path = cache / f"ensemble-seed{seed}-{digest}.safetensors"
        if path.exists():
            heads = refine.heads_from_bytes(path.read_bytes())
    if heads is None:
        heads = refine.fit("ensemble", img, txt, seed)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(refine.heads_bytes(heads))
            tmp.replace(path)
    out = {}
    for method in methods:
        # A member's heads inside the ensemble are its lone fit (same seed, default settings).
        member = heads if method == "ensemble" else ensemble._member_heads(heads, method)
        out[method] = refine.apply(member, img, txt)
    return out


@dataclass
class Pseudo:
    """Pseudo-pairs: photo ``img[r]`` with caption ``cap[r]`` (indices into half B)."""

    img: np.ndarray
    cap: np.ndarray
    sim: np.ndarray
    mutual: np.ndarray


def _nearest(data: np.ndarray, queries: np.ndarray, k: int, seed: int) -> np.ndarray:
    from pairclean.pseudo import ann

    plan = ann.choose_index(len(data), data.shape[1], "auto", seed=seed)
    index, plan, _ = ann.build_index(plan, data)
    return ann.search(index, queries, min(k, len(data)), data=data, refine_k=plan.refine_k)[1]


def _first_not_own(ids: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Per row, the first neighbour id (>= 0) for which ``own`` (same shape) is False, or -1."""
    ok = (ids >= 0) & ~own
    first = ok.argmax(axis=1)
    return np.where(ok.any(axis=1), ids[np.arange(len(ids)), first], -1)


def _pseudo_pairs(scored: Scored, flagged: np.ndarray, seed: int) -> Pseudo:
    """RCSL pseudo-pairs among the flagged pairs (see the module docstring)."""
    from pairclean.pseudo.pairing import exact_cosine

    caps = np.flatnonzero(flagged)
    photos = np.unique(scored.owner[caps])
    pos = -np.ones(len(scored.photo), dtype=np.int64)
    pos[photos] = np.arange(len(photos))
    # i2t: a photo's own flagged captions (at most 5) are skipped, so 6 neighbours suffice.
    k = 1 + int(np.bincount(scored.owner[caps]).max())
    ids = _nearest(scored.text[caps], scored.photo[photos], k, seed)
    i2t = _first_not_own(ids, scored.owner[caps[ids.clip(0)]] == photos[:, None])  # pool caption row
    # t2i: a caption's nearest pool photo other than the one it is attached to.
    ids = _nearest(scored.photo[photos], scored.text[caps], 2, seed)
    t2i = _first_not_own(ids, photos[ids.clip(0)] == scored.owner[caps][:, None])  # pool photo row
    img_i, cap_i = np.arange(len(photos))[i2t >= 0], i2t[i2t >= 0]
    has = t2i >= 0
    img_t, cap_t = t2i[has], np.flatnonzero(has)
    mutual_i = t2i[cap_i] == img_i
    new_t = ~(i2t[img_t] == cap_t)  # a t2i pair that is also the photo's i2t pair is written once
    img = np.concatenate([photos[img_i], photos[img_t[new_t]]])
    cap = np.concatenate([caps[cap_i], caps[cap_t[new_t]]])
    mutual = np.concatenate([mutual_i, np.zeros(int(new_t.sum()), bool)])
    sim = exact_cosine(scored.photo, scored.text, img, cap)
    return Pseudo(img, cap, sim, mutual)


def _train(train, recipe, weights, pseudo: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, loss: str = "infonce") -> dict[str, Any]:
    """The student's heads: ``train_heads`` on half B, plus pseudo rows (photo, caption, weight)."""
    from pairclean.lite.train import Features, train_heads

    if pseudo is None:
        return train_heads(train, recipe, weights=weights)
    p_img, p_cap, p_w = pseudo
    rows = np.concatenate([np.arange(len(train.text)), p_cap])
    aug = Features(train.image, train.text[rows], np.concatenate([train.caption_image, p_img]), train.names)
    w = np.concatenate([np.ones(len(train.text), np.float32) if weights is None else weights, p_w]).astype(np.float32)
    if loss == "infonce":
        return train_heads(aug, recipe, weights=w)
    is_pseudo = np.r_[np.zeros(len(train.text), bool), np.ones(len(p_cap), bool)]
    return _train_rcm(aug, recipe, w, is_pseudo)


def _train_rcm(train, recipe, weights: np.ndarray, is_pseudo: np.ndarray) -> dict[str, Any]:
    """``train_heads``'s loop (same init, order, optimiser, schedule) where a batch's pseudo
    rows get ``rcm_loss`` (weighted, among themselves) and its real rows the weighted
    InfoNCE among themselves; both sums are over the batch size, as in ``train_heads``.
    (Written here: ``train_heads`` has one loss for all rows and is the product's recipe.)"""
    import torch
    import torch.nn.functional as F

    from pairclean.lite.train import _heads
    from pairclean.losses import rcm_loss

    vhead, tproj = _heads(recipe)
    gen = torch.Generator().manual_seed(recipe.seed)
    img, txt = torch.from_numpy(train.image), torch.from_numpy(train.text)
    owner, w_all = torch.from_numpy(train.caption_image), torch.from_numpy(weights)
    pseudo_all = torch.from_numpy(is_pseudo)
    temperature = recipe.temperature
    opt = torch.optim.AdamW(list(vhead.parameters()) + list(tproj.parameters()), lr=recipe.lr, weight_decay=recipe.weight_decay)
    steps = recipe.epochs * ((len(txt) + recipe.batch_size - 1) // recipe.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=max(1, steps), pct_start=0.1)
    vhead.train()
    tproj.train()
    for _ in range(recipe.epochs):
        order = torch.randperm(len(txt), generator=gen)
        for start in range(0, len(order), recipe.batch_size):
            idx = order[start : start + recipe.batch_size]
            b = len(idx)
            zi = F.normalize(vhead(img[owner[idx]]), dim=-1)
            zt = F.normalize(tproj(txt[idx]), dim=-1)
            p = pseudo_all[idx]
            # Zero with a graph: a batch with no term (the last batch can be one pseudo row)
            # still steps the optimiser (weight decay), as train_heads does with a 1-row batch.
            loss = 0.0 * (zi.sum() + zt.sum())
            real = ~p
            if real.any():
                o = owner[idx][real]
                logits = zi[real] @ zt[real].T / temperature
                same = o[:, None] == o[None, :]
                logits = logits.masked_fill(same & ~torch.eye(len(o), dtype=torch.bool), float("-inf"))
                t = torch.arange(len(o))
                per = F.cross_entropy(logits, t, reduction="none") + F.cross_entropy(logits.T, t, reduction="none")
                loss = loss + (w_all[idx][real] * per).sum() / (2 * b)
            if p.sum() >= 2:  # a softmax over one pair is 1 whatever the heads do
                loss = loss + rcm_loss(zi[p], zt[p], weights=w_all[idx][p]) * (int(p.sum()) / b)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    state = {f"visual.head.{k}": v.detach().clone().contiguous() for k, v in vhead.state_dict().items()}
    state.update({f"text.proj.{k}": v.detach().clone().contiguous() for k, v in tproj.state_dict().items()})
    return state


def _student(noisy_b, recipe, dev, seeds: list[int], weights, **pseudo_kw: Any) -> dict[str, float]:
    """Dev retrieval of the student, mean over ``seeds``; ``r1`` = mean of both R@1, ``r1_sd``."""
    from pairclean.lite.train import evaluate

    runs = []
    for s in seeds:
        state = _train(noisy_b, replace(recipe, seed=s), weights, **pseudo_kw)
        m = evaluate(state, recipe, dev)
        m.pop("auc_true_vs_shuffled")
        m["r1"] = (m["i2t_r1"] + m["t2i_r1"]) / 2
        runs.append(m)
    out = {k: round(float(np.mean([r[k] for r in runs])), 4) for k in runs[0]}
    out["r1_sd"] = round(float(np.std([r["r1"] for r in runs])), 4)
    return out


def _weight_stats(w: np.ndarray | None, truth: np.ndarray) -> dict[str, Any]:
    if w is None:
        w = np.ones(len(truth), np.float32)
    clean = ~truth
    return {"pairs_used": int((w > 0).sum()), "weight_mean": round(float(w.mean()), 4),
            "clean_share_of_weight": round(float((w * clean).sum() / max(w.sum(), 1e-12)), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.2, 0.5, 0.8])
    parser.add_argument("--methods", nargs="*", default=["ncr", "disncl", "sdcmr", "ensemble"])
    parser.add_argument("--pseudo-noise", type=float, nargs="*", default=[0.5, 0.8])
    parser.add_argument("--pseudo-base", nargs="+", default=["paper", "p_clean"], choices=OSA_WEIGHTS,
                        help="OSA weights the pseudo-pair rows add to (and weigh the pseudo-pairs by)")
    parser.add_argument("--kinds", nargs="+", default=["random"], choices=["random", "near-image", "edit"],
                        help="noise kinds: random (captions moved at random; every variant) and the hard kinds")
    parser.add_argument("--student-seeds", type=int, default=5)
    parser.add_argument("--heads-cache", type=Path, default=None, help="keep fitted refine heads here")
    parser.add_argument("--seed", type=int, default=0)
    # One thread by default: on a 2-core CPU shared with other jobs, torch's spinning
    # intra-op threads made a student 10x slower with 2 threads (155 s) than with 1 (15 s).
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)

    import torch

    from pairclean.calibrate.calibration import cache_dir
    from pairclean.lite.train import HeadRecipe, extract_features, train_heads

    torch.set_num_threads(max(1, args.threads))
    feats = extract_features(flickr_root(), cache_dir() / "features")
    perm = np.random.default_rng(args.seed).permutation(len(feats["train"].image))
    half_a, half_b = _subset(feats["train"], np.sort(perm[: len(perm) // 2])), _subset(feats["train"], np.sort(perm[len(perm) // 2 :]))
    recipe = HeadRecipe()
    estimator = train_heads(half_a, recipe)
    seeds = list(range(args.seed, args.seed + args.student_seeds))
    hard = [k for k in args.kinds if k != "random"]
    if hard:
        from pairclean.lite.evaldata import load_flickr8k

        in_b = set(half_b.names)
        captions_b = [c for im in load_flickr8k(flickr_root(), "train") if im.image in in_b for c in im.captions]
        assert len(captions_b) == len(half_b.text), "half B's captions do not line up with its features"
        for kind in hard:
            for rate in args.noise:
                _hard_rows(kind, rate, half_b, captions_b, estimator, recipe, feats["dev"], seeds, args.seed)
    for rate in (args.noise if "random" in args.kinds else []):
        noisy_b, truth = _add_noise(half_b, rate, args.seed)
        scored = _score(estimator, recipe, noisy_b)
        base = {"benchmark": "downstream", "noise": rate, "pairs": int(len(truth)), "beta": round(scored.cal.beta, 4),
                "osa_noise_recall": round(float(scored.flags[truth].mean()), 4) if truth.any() else None}
        variants: dict[str, tuple[str, str, np.ndarray | None]] = {"none": ("none", "none", None)}
        for kind in OSA_WEIGHTS:
            variants[f"osa_{kind}"] = (f"osa_{kind}", "loss", scored.weight(kind))
        variants["osa_filter"] = ("osa_noisy", "filter", (~scored.flags).astype(np.float32))
        refined = _refined(scored, args.methods, args.seed, args.heads_cache) if args.methods else {}
        for method, (_, p) in refined.items():
            variants[f"{method}_p_clean"] = (f"{method}_p_clean", "loss", p)
            variants[f"{method}_filter"] = (f"{method}_noisy", "filter", (p > 0.5).astype(np.float32))
        variants["oracle"] = ("truth", "filter", (~truth).astype(np.float32))
        for name, (weight, use, w) in variants.items():
            row = {**base, "variant": name, "weight": weight, "use": use, **_weight_stats(w, truth)}
            row.update(_student(noisy_b, recipe, feats["dev"], seeds, w))
            print(json.dumps(row), flush=True)
        if rate not in args.pseudo_noise:
            continue
        flagged = scored.flags
        pseudo = _pseudo_pairs(scored, flagged, args.seed)
        for kind in args.pseudo_base:
            w_base = scored.weight(kind)
            w_pseudo = scored.weight(kind, pseudo.sim)
            min_w = float(np.median(w_base[~flagged]))
            keeps = {"all": np.ones(len(pseudo.img), bool), "mutual": pseudo.mutual, "minw": w_pseudo >= min_w}
            # Control: the same photos and weights as "all", captions shuffled among them
            # (does the nearest-neighbour choice matter, or only the extra weighted rows?).
            shuffled = np.random.default_rng(args.seed).permutation(len(pseudo.img))
            for filt in (*PSEUDO_FILTERS, "shuffled"):
                keep = keeps.get(filt, keeps["all"])
                cap = pseudo.cap[shuffled] if filt == "shuffled" else pseudo.cap
                ok = half_b.caption_image[cap] == pseudo.img
                for loss in PSEUDO_LOSSES:
                    rows = (pseudo.img[keep], cap[keep], w_pseudo[keep])
                    row = {**base, "variant": f"osa_{kind}+pseudo_{filt}_{loss}", "weight": f"osa_{kind}", "use": "loss",
                           **_weight_stats(w_base, truth), "pseudo_pool": int(flagged.sum()), "pseudo_pairs": int(keep.sum()),
                           "pseudo_mutual": None if filt == "shuffled" else int(pseudo.mutual[keep].sum()), "pseudo_right": round(float(ok[keep].mean()), 4) if keep.any() else None,
                           "pseudo_weight_mean": round(float(w_pseudo[keep].mean()), 4) if keep.any() else None,
                           "pseudo_min_weight": round(min_w, 4) if filt == "minw" else None}
                    row.update(_student(noisy_b, recipe, feats["dev"], seeds, w_base, pseudo=rows, loss=loss))
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
