"""Hard noise on Flickr8k dev: what `pairclean score` catches beyond random caption swaps.

One pair per dev image (its first caption); a fraction (20%, 50%) of the pairs gets a
wrong caption of one kind:

- ``random``: the captions of the chosen pairs are permuted among them (a derangement);
- ``near-image``: the first caption of the most alike *other* image (cosine of the
  estimator's image embeddings);
- ``near-text``: the caption of another image most alike the own caption (cosine of the
  estimator's text embeddings, over all five captions of every other image);
- ``edit``: a one-word edit of the own caption (object, colour/attribute, count, action,
  swapped roles; ``pairclean.judge.edits``, cycling through its kinds);
- ``mix``: the chosen pairs split evenly over the four kinds above;
- ``edit-unseen``: a one-word edit of one of the image's captions (the first it applies to)
  with the held-out word lists (``edits.UNSEEN``: words no training recipe changes), drawn
  among the images whose captions carry such a word: how the judge reads a wrong word it was
  never shown wrong, as with edits made by another hand;
- ``near-image-unseen``: as ``near-image``, but another of that image's captions than the
  first, which the corpus carries with its own image: no copied caption shows these
  near-misses to the calibration (``near-image`` always leaves such a copy where the other
  image is clean), as where the near-miss caption's own image is not in the corpus;
- ``boilerplate``: the caption replaced by web boilerplate alt-text that describes no image
  (a file name, "click to enlarge", a product code, a copyright line, ...; ``boilerplate``,
  made from templates with random numbers): a caption that fits no image at all, common in
  scraped corpora, which the corpus contrast must not lift as "fits this image better than
  others" (contrast version 4);
- ``placeholder``: the *image* replaced by a placeholder that shows nothing the caption
  says (a solid colour, "image not available" on grey, pixel noise, a grey ramp;
  ``placeholder_jpeg``), as a failed or hot-linked download serves: an image that fits no
  caption, which the contrast must not lift either (version 4's image-rival gate);
- ``retrieved``: the shape of a corpus of retrieved candidates (how human-judged sets such as
  Flickr8k's expert ratings were built): every image three times, with its own caption,
  with the nearest-image caption and with the nearest-text caption, in shuffled order, so
  images and captions repeat and two thirds of the pairs are near-misses (``--rates`` does
  not apply; its rows say 67%);
- ``all-captions``: no noise at all: every image with each of its five human captions, in
  shuffled order, so images repeat as in COCO- or Flickr-style sets; what such a clean
  corpus loses (its flag rate, 1 - clean accuracy, and mean ``p_clean``; AUCs are NaN; 5,000
  pairs; its rows say 0%);
- ``clause``: the own first caption with a clause of another dev caption appended whose
  content words no caption of the photo uses ("... next to a large elephant"; a caption
  embellished by a person or a captioning model; ``pairclean.judge.additions``: the judge's
  recipe can train on clauses of *train* captions, never these);
- ``negation``: the own first caption with "not" after its first "is"/"are" (only photos
  whose first caption has one);
- ``short`` and ``generic``: *clean* pairs whose caption says less, as scraped alt-text often
  does: the own first caption cut after its first listed noun ("A black dog"), or reduced to
  that noun ("a dog", "dogs"; nouns of ``pairclean.judge.edits``' lists, only photos whose first
  caption has one). Nothing is wrong in them: their rows add the mean ``p_clean`` of these
  changed pairs and the share of them below ``DOUBTFUL`` (a right caption called noisy with
  confidence).
- ``pasted``: one photo's first caption pasted onto its ``PASTE_COPIES`` most alike other photos
  (image embeddings), source after source until the rate is reached: a caption carried by a
  dozen look-alikes, wrong on all but its own photo (a scraper's template, a reposted
  caption), which a rule that spares captions many photos share must not call clean.
- ``generic-random``: random swaps at the rate, and ``GENERIC_SHARE`` of the other pairs with
  their right caption reduced to its noun as in ``generic``: whether sparing shared captions
  makes the corpus look cleaner than it is to the swapped pairs (rows as ``generic``'s, plus
  the swaps' figures).

Each (kind, rate) becomes WebDataset shards scored by the real CLI (``pairclean score
--executor local``; ``--judge MODE`` is passed through when the CLI has that option: the
default, ``auto``, judges every pair with pairclean-lite; ``--judge off`` gives OSA and the
corpus contrast alone). It
prints one row per (kind, rate): ROC-AUC of ``similarity``, ``weight`` and ``p_clean``
(clean = positive); noise recall and clean accuracy of the ``noisy`` flag; ECE (15 bins)
and Brier score of ``p_clean``; mean ``p_clean`` of clean and of noisy pairs; the share of
noisy pairs that ``p_clean`` calls clean with confidence (above ``CONFIDENT``); the largest
share of pairs tied on one ``p_clean`` value; the job's noise-rate estimate (1 - mean ``p_clean``)
and the calibration's random-mismatch share; the shares of clean and of noisy pairs whose
caption has a better owner (contrast version 3); for a corpus of several noise kinds, its ECE
with each kind's pairs left out (``ece_without``); the near-miss mixture's gain and whether it
was used (a judge that carries one); pairs/s of
the whole command (start-up and model load included).

Embeddings (for the neighbours) and shards are cached under ``--cache`` (default
``~/.cache/pairclean/hard_noise`` or ``$PAIRCLEAN_CACHE_DIR/hard_noise``, outside the repository). ``--ceiling [near-text]`` prints
100 (``--ceiling-count``) nearest-image (nearest-text) caption pairs with the image's five
human captions, to count by eye how many still describe their image. ``--rescore-from TAG`` reruns only ``pairclean rescore`` on the
score folders of an earlier run, copied (no re-embedding: for a calibration change;
pairs/s is then the earlier run's). ``--refine`` also refines a copy of each scored folder
with ``pairclean refine`` (its default ensemble) and prints that row too (``KIND +refine``;
pairs/s is the score's): refine must never do worse than the score it starts from.
``--audit N`` audits a copy of each scored folder with ``pairclean audit`` (N pairs drawn by
its design, labelled from the truth: a perfect labeller) and prints that row too (``KIND
+audit``, on the pairs not labelled): what a few hundred human labels do where the corpus
cannot show its noise.

    python benchmarks/hard_noise.py [--quick] [--kinds ...] [--rates 0.2 0.5] [--judge band]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from _common import flickr_root
from _embed_dev import embed_dev

from pairclean.calibrate.calibration import cache_dir as _default_cache

KINDS = ("random", "near-image", "near-text", "edit", "mix", "retrieved", "near-image-unseen", "edit-unseen", "boilerplate",
         "placeholder", "all-captions", "clause", "negation", "short", "generic", "pasted", "generic-random")
#: Kinds whose changed captions are still right (they say less): labelled, never noisy.
CLEAN_CHANGES = ("short", "generic")
#: ``pasted``: how many look-alike photos each source photo's caption is pasted onto.
PASTE_COPIES = 12
#: ``generic-random``: the share of the pairs not swapped whose caption is reduced to its noun.
GENERIC_SHARE = 0.3
#: A clean pair whose p_clean is below this is called noisy with confidence.
DOUBTFUL = 0.3
#: A noisy pair whose p_clean is above this is called clean with confidence (a confident wrong answer).
CONFIDENT = 0.9
PER_SHARD = 250


#: ``pairclean rescore --contrast`` under ``--rescore-from`` (``--rescore-contrast``).
RESCORE_CONTRAST: list[str] = ["keep"]

#: The pairclean executable the benchmark runs (``--cli``; default: beside this Python).
CLI: list[str] = []


def _cli() -> str:
    if CLI:
        return CLI[0]
    exe = Path(sys.executable).parent / "pairclean"
    return str(exe) if exe.exists() else (shutil.which("pairclean") or "pairclean")


def _nearest(emb: np.ndarray, exclude_self: bool = True) -> np.ndarray:
    """Index of the most alike other row (cosine) for each row of (N, D) normalised rows."""
    sims = emb @ emb.T
    if exclude_self:
        np.fill_diagonal(sims, -np.inf)
    return np.asarray(sims.argmax(1))


def _near_text(txt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each image i: (image j != i, caption c) whose caption embedding is most alike i's first caption."""
    n, c, d = txt.shape
    flat = txt.reshape(n * c, d)
    sims = txt[:, 0, :] @ flat.T  # (n, n*c)
    owner = np.repeat(np.arange(n), c)
    sims[np.arange(n)[:, None] == owner[None, :]] = -np.inf
    best = sims.argmax(1)
    return owner[best], best % c


def _edit_module() -> Any:
    try:
        from pairclean.judge import edits
    except ImportError:
        return None
    return edits


def _first_edit(edits: Any, texts: list[str], pos: int, rng: np.random.Generator, vocabulary: Any) -> tuple[str, str] | None:
    """(edited text, edit kind) of the first of ``texts`` an edit applies to, trying the kinds
    in turn from the ``pos``-th (so consecutive pairs cycle through them); None: none applies."""
    kinds = list(edits.EDIT_KINDS)
    for text in texts:
        for shift in range(len(kinds)):
            kind = kinds[(pos + shift) % len(kinds)]
            edited = edits.edit_caption(text, kind, rng, vocabulary)
            if edited is not None:
                return edited, kind
    return None


#: Web alt-text that describes no image (``boilerplate``); ``{n}`` is a random number.
BOILERPLATE = ("IMG_{n}.JPG", "DSC{n}", "click here to enlarge", "Product code {n}-B", "untitled", "stock photo",
               "Copyright {n} all rights reserved", "image {n} of 12", "free shipping on orders over ${n}", "photo",
               "screenshot {n}", "thumbnail", "Item #{n} - add to cart", "download high resolution", "P{n}.jpg",
               "view gallery", "banner", "page {n}", "no description available", "sale ends soon")


def boilerplate(rng: np.random.Generator) -> str:
    """One boilerplate alt-text (``BOILERPLATE``) with a random number filled in."""
    return str(rng.choice(BOILERPLATE)).replace("{n}", str(int(rng.integers(10, 99999))))


#: Texts a placeholder image may show (``placeholder_jpeg``).
PLACEHOLDER_TEXTS = ("image not available", "no photo", "coming soon", "404 not found", "loading...", "photo removed")


def placeholder_jpeg(i: int, rng: np.random.Generator) -> bytes:
    """A 320 x 240 JPEG of the ``i % 4``-th placeholder style (solid colour, text on grey,
    pixel noise, grey ramp), drawn here (licence-clean)."""
    import io

    from PIL import Image, ImageDraw

    style = i % 4
    if style == 0:
        im = Image.new("RGB", (320, 240), tuple(int(v) for v in rng.integers(0, 256, 3)))
    elif style == 1:
        im = Image.new("RGB", (320, 240), (220, 220, 220))
        ImageDraw.Draw(im).text((70, 110), str(rng.choice(PLACEHOLDER_TEXTS)), fill=(90, 90, 90))
    elif style == 2:
        im = Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8))
    else:
        im = Image.fromarray((np.linspace(0, 255, 320)[None, :, None] * np.ones((240, 1, 3))).astype(np.uint8))
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make_pairing(kind: str, rate: float, images: list[Any], emb: dict[str, np.ndarray], seed: int) -> tuple[list[str], np.ndarray, list[str]]:
    """(captions, noisy flags, noise kind per pair ("" when clean)) for one (kind, rate)."""
    n = len(images)
    rng = np.random.default_rng([seed, KINDS.index(kind), int(rate * 1000)])
    captions = [img.captions[0] for img in images]
    labels = [""] * n
    edits = _edit_module()
    if kind == "negation":  # only images whose first caption has an "is"/"are" to deny
        from pairclean.judge.additions import negate

        able = [i for i, c in enumerate(captions) if negate(c) is not None]
        chosen = rng.choice(able, size=min(len(able), int(round(rate * n))), replace=False)
    elif kind in CLEAN_CHANGES:  # only images whose first caption names a listed noun
        able = [i for i, c in enumerate(captions) if _head_noun(c) is not None]
        chosen = rng.choice(able, size=min(len(able), int(round(rate * n))), replace=False)
    elif kind == "edit-unseen":  # only images with a caption the held-out words apply to
        if edits is None:
            raise SystemExit("the edit-unseen kind needs pairclean.judge.edits with its UNSEEN words")
        able = [i for i, img in enumerate(images) if any(edits.applicable_kinds(c, edits.UNSEEN) for c in img.captions)]
        chosen = rng.choice(able, size=min(len(able), int(round(rate * n))), replace=False)
    else:
        chosen = rng.choice(n, size=int(round(rate * n)), replace=False)
    if kind == "pasted":
        return _pasted(images, emb, int(round(rate * n)), rng)
    if kind == "generic-random":
        swapped = set(chosen.tolist())
        rest = [i for i in range(n) if i not in swapped and _head_noun(captions[i]) is not None]
        reduced = rng.choice(rest, size=min(len(rest), int(round(GENERIC_SHARE * (n - len(chosen))))), replace=False)
        for i in reduced:
            captions[i], labels[i] = _said_less(captions[i], "generic"), "generic"
    if kind == "mix":
        parts = np.array_split(chosen, 4)
        plan = dict(zip(("random", "near-image", "near-text", "edit"), parts))
    else:
        plan = {"random" if kind == "generic-random" else kind: chosen}
    near_img = _nearest(emb["img"])
    near_txt_img, near_txt_cap = _near_text(emb["txt"])
    out = list(captions)
    for k, idx in plan.items():
        if k == "random":
            for dst, src in zip(idx, np.roll(idx, 1)):
                out[dst] = captions[src]
                labels[dst] = k
        elif k == "near-image":
            for i in idx:
                out[i] = images[near_img[i]].captions[0]
                labels[i] = k
        elif k == "near-image-unseen":
            for i in idx:  # a caption of the most alike image that the corpus does not carry: no copy to see
                out[i] = images[near_img[i]].captions[1 + (i % (len(images[near_img[i]].captions) - 1))]
                labels[i] = k
        elif k == "boilerplate":
            for i in idx:
                out[i] = boilerplate(rng)
                labels[i] = k
        elif k == "placeholder":  # the caption stays; write_shards puts a placeholder in place of the image
            for i in idx:
                labels[i] = k
        elif k == "near-text":
            for i in idx:
                out[i] = images[near_txt_img[i]].captions[near_txt_cap[i]]
                labels[i] = k
        elif k in ("clause", "negation"):
            from pairclean.judge import additions

            pool = additions.clause_pool(c for img in images for c in img.captions)  # dev's own clauses: never trained on
            for i in idx:
                made = (additions.add_clause(captions[i], images[i].captions, pool, rng) if k == "clause"
                        else additions.negate(captions[i]))
                if made is not None:
                    out[i], labels[i] = made, k
        elif k in CLEAN_CHANGES:
            for i in idx:
                out[i], labels[i] = _said_less(captions[i], k), k
        elif k in ("edit", "edit-unseen"):
            if edits is None:
                raise SystemExit(f"the {k} kind needs pairclean.judge.edits (not in this tree yet); pass --kinds without it and mix")
            # edit: the own first caption, core words (one no edit applies to stays clean, labelled so);
            # edit-unseen: the first of the image's captions the held-out words apply to
            texts_of = (lambda i: [captions[i]]) if k == "edit" else (lambda i: images[i].captions)
            vocabulary = edits.CORE if k == "edit" else edits.UNSEEN
            for pos, i in enumerate(idx):
                made = _first_edit(edits, texts_of(i), pos, rng, vocabulary)
                if made is not None:
                    out[i], labels[i] = made[0], f"{k}:{made[1]}"
    noisy = np.array([bool(lab) and lab not in CLEAN_CHANGES for lab in labels])
    return out, noisy, labels


def _pasted(images: list[Any], emb: dict[str, np.ndarray], count: int,
            rng: np.random.Generator) -> tuple[list[str], np.ndarray, list[str]]:
    """The ``pasted`` corpus: sources in random order, each one's first caption on its
    ``PASTE_COPIES`` most alike photos not used yet (never another source), ``count`` in all."""
    captions = [img.captions[0] for img in images]
    labels = [""] * len(images)
    used: set[int] = set()
    done = 0
    for src in rng.permutation(len(images)):
        if done >= count:
            break
        if int(src) in used:
            continue
        used.add(int(src))
        ranked = np.argsort(-(emb["img"] @ emb["img"][src]))
        for dst in [int(j) for j in ranked if int(j) not in used][: min(PASTE_COPIES, count - done)]:
            captions[dst], labels[dst] = images[src].captions[0], "pasted"
            used.add(dst)
            done += 1
    return captions, np.array([bool(lab) for lab in labels]), labels


def _head_noun(caption: str) -> tuple[int, str, bool] | None:
    """(word position, lemma, plural) of the first word of ``caption`` that the edit lists know
    as a noun (``edits.TRAINING + edits.UNSEEN``), or None."""
    edits = _edit_module()
    if edits is None:
        raise SystemExit("the short and generic kinds need pairclean.judge.edits")
    index = (edits.TRAINING + edits.UNSEEN).noun_index
    for pos, word in enumerate(caption.split()):
        noun = index.get(re.sub(r"[^a-z]", "", word.lower()))
        if noun is not None:
            return pos, noun.lemma, noun.plural
    return None


def _said_less(caption: str, kind: str) -> str:
    """``caption`` cut after its first listed noun (``short``) or reduced to it (``generic``)."""
    found = _head_noun(caption)
    assert found is not None  # chosen among captions that have one
    pos, lemma, plural = found
    if kind == "short":
        return " ".join(caption.split()[: pos + 1])
    word = re.sub(r"[^A-Za-z]", "", caption.split()[pos]).lower()
    return word if plural else ("an " if lemma[0] in "aeiou" else "a ") + word


def make_all_captions(images: list[Any], seed: int) -> tuple[list[str], np.ndarray, list[str], np.ndarray]:
    """The ``all-captions`` corpus: (captions, noisy flags, kinds, image index) of every image
    with each of its own captions (5 x N pairs, none noisy) in shuffled order: a clean corpus
    whose images repeat, as COCO- or Flickr-style sets with several captions per image are."""
    pairs = [(i, c) for i, img in enumerate(images) for c in img.captions]
    order = np.random.default_rng([seed, KINDS.index("all-captions")]).permutation(len(pairs))
    pairs = [pairs[k] for k in order]
    return [p[1] for p in pairs], np.zeros(len(pairs), bool), [""] * len(pairs), np.array([p[0] for p in pairs], dtype=np.int64)


def make_retrieved(images: list[Any], emb: dict[str, np.ndarray], seed: int) -> tuple[list[str], np.ndarray, list[str], np.ndarray]:
    """The ``retrieved`` corpus: (captions, noisy flags, kinds, image index) of 3 x N pairs in shuffled order."""
    near_img = _nearest(emb["img"])
    near_txt_img, near_txt_cap = _near_text(emb["txt"])
    pairs = []
    for i, img in enumerate(images):
        pairs += [(i, img.captions[0], ""), (i, images[near_img[i]].captions[0], "near-image"),
                  (i, images[near_txt_img[i]].captions[near_txt_cap[i]], "near-text")]
    order = np.random.default_rng([seed, KINDS.index("retrieved")]).permutation(len(pairs))
    pairs = [pairs[k] for k in order]
    return ([p[1] for p in pairs], np.array([bool(p[2]) for p in pairs]), [p[2] for p in pairs],
            np.array([p[0] for p in pairs], dtype=np.int64))


def write_shards(folder: Path, images: list[Any], captions: list[str], noisy: np.ndarray, labels: list[str],
                 owner: np.ndarray | None = None) -> list[str]:
    """Shards of ``PER_SHARD`` pairs under ``folder`` (reused when already complete) and labels.json.

    Pair k shows ``images[owner[k]]`` (default: pair k shows image k) with ``captions[k]``, or a
    placeholder image (``placeholder_jpeg``) where its label is ``placeholder``."""
    from pairclean.lite.evaldata import write_shard

    owner = np.arange(len(images)) if owner is None else owner
    n = len(captions)
    meta = folder / "labels.json"
    doc = {"keys": [f"{i:05d}" for i in range(n)], "noisy": noisy.tolist(), "kind": labels, "captions": captions,
           "images": ["placeholder" if labels[int(k)] == "placeholder" else images[int(i)].image for k, i in enumerate(owner)]}
    rng = np.random.default_rng([0, len(labels)])

    def jpeg(i: int) -> bytes:
        return placeholder_jpeg(i, rng) if labels[i] == "placeholder" else images[int(owner[i])].path.read_bytes()

    paths = [folder / f"part-{s // PER_SHARD:05d}.tar" for s in range(0, n, PER_SHARD)]
    if meta.exists() and json.loads(meta.read_text()) == doc and all(p.exists() for p in paths):
        return [str(p) for p in paths]
    folder.mkdir(parents=True, exist_ok=True)
    for s, path in zip(range(0, n, PER_SHARD), paths):
        samples = [{"__key__": f"{i:05d}", "jpg": jpeg(i), "txt": captions[i]} for i in range(s, min(s + PER_SHARD, n))]
        write_shard(path, samples)
    meta.write_text(json.dumps(doc))
    return [str(p) for p in paths]


def ece(p: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error (equal-width bins) of probabilities ``p`` for outcomes ``y``."""
    idx = np.clip(np.digitize(p, np.linspace(0, 1, bins + 1)[1:-1]), 0, bins - 1)
    return float(sum((idx == b).mean() * abs(p[idx == b].mean() - y[idx == b].mean()) for b in range(bins) if (idx == b).any()))


def _auc(clean: np.ndarray, score: np.ndarray) -> float:
    """ROC-AUC of ``score`` for ``clean`` (positive); NaN where one class is missing (``all-captions``)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(clean, score)) if 0 < clean.mean() < 1 else float("nan")


def _mean(values: np.ndarray) -> float:
    """The mean of ``values``; NaN (no warning) where there are none."""
    return float(np.mean(values)) if values.size else float("nan")


def evaluate(out: Path, labels: dict[str, Any], skip: set[str] | None = None) -> dict[str, Any]:
    """The metrics of one scored folder against its labels (ok rows only, less the keys in ``skip``)."""
    import pandas as pd
    from sklearn.metrics import roc_auc_score

    df = pd.read_parquet(out)
    df = df[(df["status"] == "ok") & ~df["key"].isin(skip or set())].set_index("key")
    truth = pd.Series(labels["noisy"], index=labels["keys"]).reindex(df.index).to_numpy(bool)
    clean = ~truth
    p = df["p_clean"].to_numpy(np.float64)
    flag = df["noisy"].to_numpy(bool)
    _, counts = np.unique(p, return_counts=True)
    from pairclean.output.folder import OutputDir

    frozen = OutputDir(str(out)).read_calibration()  # either layout (OUT.pairclean/state or OUT/_pairclean)
    cal = frozen.to_json() if frozen is not None else {}
    row = {
        "pairs": int(len(df)),
        "auc_similarity": _auc(clean, df["similarity"].to_numpy()),
        "auc_weight": _auc(clean, df["weight"].to_numpy()),
        "auc_p_clean": _auc(clean, p),
        "noise_recall": _mean(flag[truth]),
        "clean_accuracy": _mean((~flag)[clean]),
        "ece": ece(p, clean.astype(float)),
        "brier": float(((p - clean) ** 2).mean()),
        "p_clean_clean": _mean(p[clean]),
        "p_clean_noisy": _mean(p[truth]),
        "noisy_confident": _mean(p[truth] > CONFIDENT),
        "max_tie": float(counts.max() / len(p)),
        # the job's noise-rate estimate as `pairclean inspect` and REST jobs report it, and the
        # random-mismatch share it replaced there (a lower bound: near-misses score above it)
        "noise_rate_est": float(1 - p.mean()),
        "random_mismatch_share": cal.get("noise_rate"),
        "true_noise_rate": float(truth.mean()),
    }
    changed = pd.Series(labels["kind"], index=labels["keys"]).reindex(df.index).isin(CLEAN_CHANGES).to_numpy()
    if changed.any():  # right captions that say less: how many are called noisy with confidence
        row["changed_clean_mean"], row["changed_clean_doubtful"] = _mean(p[changed]), _mean(p[changed] < DOUBTFUL)
        row["unchanged_clean_mean"] = _mean(p[clean & ~changed])
    if "owner_margin" in df.columns:  # contrast version 3: shares of pairs whose caption has a better owner
        from pairclean.calibrate.contrast import has_owner

        owned = has_owner(df["owner_margin"].to_numpy())
        row["owned_clean"], row["owned_noisy"] = float(owned[clean].mean()), float(owned[truth].mean()) if truth.any() else None
    if "judge_score" in df.columns:
        judged = df["judge_score"].notna().to_numpy()
        row["judged_share"] = float(judged.mean())
        if judged.any() and 0 < clean[judged].mean() < 1:  # the judge's AUC on the pairs it judged
            row["auc_judge_on_judged"] = roc_auc_score(clean[judged], df["judge_score"].to_numpy()[judged])
    kinds = pd.Series(labels["kind"], index=labels["keys"]).reindex(df.index).fillna("").str.split(":").str[0].to_numpy()
    present = sorted({k for k in kinds if k and k not in CLEAN_CHANGES})
    if len(present) > 1:  # a mixed corpus (mix, generic-random): ECE with each kind's pairs left out
        # near-text labels are the noisiest (about a third of those captions describe the photo):
        # what the mix's ECE owes to each kind
        row["ece_without"] = {k: round(ece(p[kinds != k], clean[kinds != k].astype(float)), 4) for k in present}
    fit = (frozen.extra.get("judge") or {}).get("fine_mixture_fit") if frozen is not None else None
    if fit:  # the near-miss mixture's deviance gain and whether it set the word check (posterior.fit_mixture)
        row["mixture_gain"], row["mixture_used"] = float(fit["gain"]), bool(fit["used"])
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}


def run_cli(shards: list[str], out: Path, judge: str | None, threads: int, checkpoint: str | None = None) -> float:
    """Score ``shards`` into ``out`` with the real CLI; returns wall seconds."""
    cmd = [_cli(), "score", *shards, "--out", str(out), "--executor", "local", "--overwrite", "--no-progress", "--threads", str(threads)]
    if judge:
        cmd += ["--judge", judge]
    if checkpoint:
        cmd += ["--judge-checkpoint", checkpoint]
    t0 = time.perf_counter()
    _run(cmd, "score")
    return time.perf_counter() - t0


def _copy_run(out: Path, suffix: str) -> Path:
    """A copy of the scored folder ``out`` and its state folder, ``<name>-<suffix>`` beside it."""
    copy = out.parent / f"{out.name}-{suffix}"
    for src, dst in ((out, copy), (out.parent / f"{out.name}.pairclean", out.parent / f"{copy.name}.pairclean")):
        shutil.rmtree(dst, ignore_errors=True)
        if src.exists():
            shutil.copytree(src, dst)
    return copy


def run_audit(out: Path, labels: dict[str, Any], count: int, seed: int) -> tuple[Path, set[str]]:
    """A copy of the scored folder ``out`` audited with ``pairclean audit``: ``count`` pairs
    drawn by its design, labelled from the benchmark's truth (a perfect labeller), the
    recalibrated ``p_clean`` written into the copy's tables; returns the copy and the
    labelled keys (left out of its row: the map was fitted on them)."""
    import pandas as pd

    copy = _copy_run(out, "audited")
    queue = copy.parent / f"{copy.name}-queue.csv"
    queue.unlink(missing_ok=True)  # this benchmark's own labelled queue of an earlier run: audit keeps labels it finds
    _run([_cli(), "audit", str(copy), "--sample", str(count), "--seed", str(seed), "--out", str(queue)], "audit")
    truth = dict(zip(labels["keys"], labels["noisy"]))
    q = pd.read_csv(queue, dtype={"key": str})
    q["label"] = ["noisy" if truth[k] else "clean" for k in q["key"]]
    q.to_csv(queue, index=False)
    _run([_cli(), "audit", str(copy), "--labels", str(queue)], "audit")
    return copy, set(q["key"])


def _run(cmd: list[str], what: str) -> None:
    """Run a pairclean command; its failure ends the benchmark with the command's last words."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pairclean {what} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")


def run_refine(out: Path, threads: int) -> Path:
    """A copy of the scored folder ``out`` refined with the CLI (``pairclean refine``, its
    default ensemble); returns the copy (``<name>-refined`` beside ``out``)."""
    copy = _copy_run(out, "refined")
    cmd = [_cli(), "refine", str(copy), "--executor", "local", "--threads", str(threads)]
    _run(cmd, "refine")
    return copy


def run_rescore(out: Path) -> None:
    """Recalibrate a scored folder with the CLI (``pairclean rescore``, no re-embedding)."""
    from pairclean.output.folder import OutputDir

    cal = OutputDir(str(out)).read_calibration()
    assert cal is not None, f"{out} has no calibration"
    cmd = [_cli(), "rescore", str(out), "--beta-recipe", cal.recipe, "--weighting", cal.weighting, "--contrast", RESCORE_CONTRAST[0]]
    _run(cmd, "rescore")


def judge_supported() -> bool:
    """Whether this CLI has ``score --judge``."""
    proc = subprocess.run([_cli(), "score", "--help"], capture_output=True, text=True)
    return "--judge" in proc.stdout


def print_ceiling(images: list[Any], emb: dict[str, np.ndarray], count: int, seed: int, kind: str = "near-image") -> None:
    """``count`` pairs of ``kind`` (near-image or near-text): the image, the borrowed caption, the image's own five."""
    near_img = _nearest(emb["img"])
    near_txt_img, near_txt_cap = _near_text(emb["txt"])
    rng = np.random.default_rng(seed)
    for i in rng.choice(len(images), size=min(count, len(images)), replace=False):
        j, c = (near_img[i], 0) if kind == "near-image" else (near_txt_img[i], near_txt_cap[i])
        print(json.dumps({"image": images[i].image, "borrowed": images[j].captions[c], "from": images[j].image,
                          "own": list(images[i].captions)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="300 images instead of all 1,000 dev images")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--rates", nargs="+", type=float, default=[0.2, 0.5])
    ap.add_argument("--judge", default=None, help="pass --judge MODE to pairclean score (when it has that option)")
    ap.add_argument("--judge-checkpoint", default=None, metavar="PATH",
                    help="pass --judge-checkpoint PATH to pairclean score (a judge other than the shipped one)")
    ap.add_argument("--cache", default=str(_default_cache() / "hard_noise"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rescore-from", default=None, metavar="TAG",
                    help="copy the score folders of an earlier run (runs/TAG) and only rerun `pairclean rescore` on them")
    ap.add_argument("--rescore-contrast", default="keep", choices=["keep", "on", "off"],
                    help="with --rescore-from: rescore with the corpus contrast on, off, or as scored")
    ap.add_argument("--tag", default=None, help="name of this run's folder under CACHE/runs (default: from the image count and judge)")
    ap.add_argument("--cli", default=None, help="the pairclean executable to run (default: the one beside this Python)")
    ap.add_argument("--refine", action="store_true",
                    help="also run `pairclean refine` (default ensemble) on a copy of each scored folder and print its row")
    ap.add_argument("--audit", type=int, default=None, metavar="N",
                    help="also audit a copy of each scored folder with pairclean audit: N pairs of its design "
                         "labelled from the truth (a perfect labeller), and print that row (KIND +audit)")
    ap.add_argument("--ceiling", nargs="?", const="near-image", default=None, choices=["near-image", "near-text"],
                    help="print --ceiling-count borrowed-caption pairs of this kind (default near-image) to judge by eye, then exit")
    ap.add_argument("--ceiling-count", type=int, default=100)
    args = ap.parse_args()
    from pairclean.lite.evaldata import load_flickr8k

    cache = Path(args.cache)
    images = load_flickr8k(flickr_root(), "dev")
    data = embed_dev(cache / "dev_lite.npz")
    n = 300 if args.quick else len(images)
    images, emb = images[:n], {"img": data["img"][:n], "txt": data["txt"][:n]}
    if args.ceiling:
        print_ceiling(images, emb, args.ceiling_count, args.seed, args.ceiling)
        return
    if args.cli:
        CLI.append(args.cli)
    RESCORE_CONTRAST[0] = args.rescore_contrast
    judge = args.judge
    if judge and not judge_supported():
        print(f"# this CLI has no --judge option; scoring without it (asked: {judge})", file=sys.stderr)
        judge = None
    tag = args.tag or (f"n{n}" + (f"-judge-{judge}" if judge else "") + (f"-rescored-{args.rescore_from}-{args.rescore_contrast}" if args.rescore_from else ""))
    print(f"# {_cli()} score SHARDS --out OUT --executor local --threads {args.threads}" + (f" --judge {judge}" if judge else "")
          + (f" --judge-checkpoint {args.judge_checkpoint}" if args.judge_checkpoint else "")
          + (f" (copied from runs/{args.rescore_from}, then {_cli()} rescore OUT)" if args.rescore_from else ""), flush=True)
    rows = []
    for kind in args.kinds:
        for rate in ({"retrieved": [2 / 3], "all-captions": [0.0]}.get(kind, args.rates)):
            owner = None
            if kind == "retrieved":
                captions, noisy, labels, owner = make_retrieved(images, emb, args.seed)
            elif kind == "all-captions":
                captions, noisy, labels, owner = make_all_captions(images, args.seed)
            else:
                captions, noisy, labels = make_pairing(kind, rate, images, emb, args.seed)
            name = f"{kind}-{round(rate * 100)}"
            shards = write_shards(cache / "shards" / f"n{n}" / name, images, captions, noisy, labels, owner)
            out = cache / "runs" / tag / name
            speed_file = out.parent / f"{name}.seconds"
            if args.rescore_from:
                source = cache / "runs" / args.rescore_from / name
                if out.exists():
                    shutil.rmtree(out)
                shutil.copytree(source, out)
                side = source.parent / f"{name}.pairclean"  # the state folder beside OUT (issue 23 layout)
                if side.exists():
                    shutil.rmtree(out.parent / side.name, ignore_errors=True)
                    shutil.copytree(side, out.parent / side.name)
                run_rescore(out)
                old = source.parent / f"{name}.seconds"
                seconds = float(old.read_text()) if old.exists() else float("nan")
            else:
                seconds = run_cli(shards, out, judge, args.threads, args.judge_checkpoint)
                speed_file.write_text(str(seconds))
            lab = json.loads((cache / "shards" / f"n{n}" / name / "labels.json").read_text())
            row = {"kind": kind, "rate": rate, **evaluate(out, lab), "pairs_per_s": round(len(captions) / seconds, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.refine:
                refined = run_refine(out, args.threads)
                row = {"kind": f"{kind} +refine", "rate": rate, **evaluate(refined, lab), "pairs_per_s": row["pairs_per_s"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
            if args.audit:
                audited, labelled = run_audit(out, lab, args.audit, args.seed)
                row = {"kind": f"{kind} +audit", "rate": rate, **evaluate(audited, lab, labelled), "pairs_per_s": rows[-1]["pairs_per_s"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(markdown(rows))


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as the README's table."""
    head = ("| noise | rate | AUC sim. | AUC weight | AUC p_clean | noise recall | clean acc. | ECE | Brier "
            f"| p_clean clean | p_clean noisy | noisy > {CONFIDENT} | largest tie | pairs/s |\n|" + "---|" * 14)
    lines = [head]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['rate']:.0%} | {r['auc_similarity']:.3f} | {r['auc_weight']:.3f} | {r['auc_p_clean']:.3f} "
                     f"| {r['noise_recall']:.3f} | {r['clean_accuracy']:.3f} | {r['ece']:.3f} | {r['brier']:.3f} "
                     f"| {r['p_clean_clean']:.3f} | {r['p_clean_noisy']:.3f} | {r.get('noisy_confident', float('nan')):.1%} "
                     f"| {r['max_tie']:.1%} | {r['pairs_per_s']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
