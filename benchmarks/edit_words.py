"""How the judge reads one wrong word by word list: the ones it trained on and the held-out ones.

On Flickr8k dev (never trained on), each photo's first caption against its one-word edits
(``pairclean.judge.edits``), made with each vocabulary:

- ``core``: the first lists (the dev cache's own edits; the hard-noise benchmark's ``edit``);
- ``extra``: the words only the training recipe ``--edit-words training`` adds;
- ``unseen``: words no training recipe changes (the hard-noise benchmark's ``edit-unseen``).

Prints, per vocabulary and edit kind: the number of edits, the AUC of the judge's logit
(clean first captions against the edits), the plain cosine's AUC, and the share of edits
that score below the caption they were made from on the same photo. A judge that only
learnt its own word lists scores well on ``core`` and near the cosine on ``unseen``.

Reads the dev split of a ``pairclean train-judge`` features cache (``--features-cache``;
regions of the dev photos) and encodes the new edits with pairclean-lite's text tower
(a few seconds). Nothing is written.

    python benchmarks/edit_words.py [--features-cache ~/.cache/pairclean/judge/lite0-c5] [--judge PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from pairclean.calibrate.calibration import cache_dir
from pairclean.judge.edits import EDIT_KINDS, VOCABULARIES
from pairclean.lite.judge_data import load_split, with_texts, word_edits
from pairclean.lite.judge_train import evaluate, score_pairs

MIN_EDITS = 20  # kinds with fewer edits than this are folded into the vocabulary's row only


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features-cache", type=Path, default=cache_dir() / "judge" / "lite0-c5")
    ap.add_argument("--judge", default=None, help="judge weights (default: the shipped judge)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    args = ap.parse_args()
    from pairclean.judge.runner import load_judge

    dev = load_split(args.features_cache, "dev")
    n = len(dev.image_emb)
    first = np.nonzero(dev.kind == "")[0][::5]  # each photo's first caption (five per photo, in order)
    made = [(name, *m) for name in ("extra", "unseen") for m in word_edits(dev, VOCABULARIES[name])]
    from pairclean.embed.estimators import EstimatorSpec, load_estimator

    estimator = load_estimator(EstimatorSpec(model="pairclean-lite", precision="fp32", engine="torch"))
    dev, rows = with_texts(dev, estimator, [m[3] for m in made])
    model = load_judge(args.judge).model
    pairs = {"clean": (np.arange(n), first)}
    for kind in EDIT_KINDS:
        r = np.nonzero(dev.kind == kind)[0]
        pairs[f"core:{kind}"] = (dev.image[r], r)
    r = np.nonzero(np.isin(dev.kind, EDIT_KINDS))[0]
    pairs["core:all"] = (dev.image[r], r)
    for name in ("extra", "unseen"):
        sel = [k for k, m in enumerate(made) if m[0] == name]
        for kind in EDIT_KINDS:
            ks = [k for k in sel if made[k][1] == kind]
            if len(ks) >= MIN_EDITS:
                pairs[f"{name}:{kind}"] = (np.array([made[k][2] for k in ks]), rows[ks])
        pairs[f"{name}:all"] = (np.array([made[k][2] for k in sel]), rows[sel])
    aucs = evaluate(model, dev, pairs)  # the judge's and the cosine's AUC, as train-judge reports them
    clean = score_pairs(model, dev, *pairs["clean"])
    if not args.json:
        print("| words:kind | edits | judge AUC | cosine AUC | own caption above its edit |\n|---|---|---|---|---|")
    for name, (img, txt) in pairs.items():
        if name == "clean":
            continue
        report = {"edits": int(len(txt)), "judge_auc": round(aucs[name]["judge_auc"], 4),
                  "cosine_auc": round(aucs[name]["cosine_auc"], 4),
                  "own_above_edit": round(float((clean[img] > score_pairs(model, dev, img, txt)).mean()), 4)}
        print(json.dumps({"row": name, **report}) if args.json else
              f"| {name} | {report['edits']} | {report['judge_auc']:.3f} | {report['cosine_auc']:.3f} | {report['own_above_edit']:.3f} |")

if __name__ == "__main__":
    main()
