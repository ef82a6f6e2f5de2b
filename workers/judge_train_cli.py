"""``pairclean train-judge``: train the fine-grained judge (issue 21) and write its weights.

Extracts (once, cached) pairclean-lite's image regions and caption tokens over Flickr8k
train and dev plus one-word edits, trains the judge on train with hard negatives
(``pairclean.lite.judge_train``), keeps the epoch with the best mean dev AUC, fits the Platt map
on dev and writes the weights with recipe, history and dev figures in the file's
metadata. ``--words on`` (the default) then trains the word grounding
(``pairclean.lite.word_train``) and chooses its weight beside the judge on dev, before the
Platt maps; ``--judge-from FILE`` takes the judge's weights from a judge file instead of
training them (``--words keep``: its word grounding too, so only the maps, the pass rates and
the near-miss mixture are fitted anew). Last, the near-miss mixture
(``pairclean.judge.posterior.FineMixture``): the dev distributions of the word check's ratios
for clean pairs, the judge's own lists' edits and edits with words its recipe never changed
(``extra``; ``unseen`` for a recipe that trained on ``extra``). ``--report`` gets the dev
figures per noise kind and rate as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from pairclean.errors import InputError
from pairclean_workers.args import seed

__all__ = ["add_judge_train_parser", "cmd_train_judge"]

log = logging.getLogger(__name__)

#: Members of the shipped judge (``pairclean.judge.model.JudgeEnsemble``): one. Three (seeds
#: 0-2) were measured: dev AUC of the judge alone +0.007-0.014 by kind, but through
#: `pairclean score` on the hard-noise benchmark no gain (edits 0.804 / 0.827 vs 0.805 / 0.830)
#: for three judge passes a pair (``JUDGE_MODEL_CARD.md``).
DEFAULT_MEMBERS = 1
#: The shipped judge's train edits (``pairclean.judge.edits.VOCABULARIES``); "training" measured, not taken.
DEFAULT_EDIT_WORDS = "core"


def add_judge_train_parser(sub: Any) -> None:
    """Register the ``train-judge`` sub-command."""
    from pairclean.lite.judge_train import JudgeRecipe
    from pairclean.lite.word_train import WordRecipe

    base = JudgeRecipe()
    p = sub.add_parser("train-judge", help="train the fine-grained judge on Flickr8k (train split, selected on dev)")
    p.add_argument("--data", default=None, help="Flickr8k folder (default: $PAIRCLEAN_FLICKR8K or ../shared/data/flickr8k)")
    p.add_argument("--out", required=True, help="where to write the judge (.safetensors)")
    p.add_argument("--report", default=None, help="write the dev figures as JSON here")
    p.add_argument("--features-cache", default=None, help="folder for cached regions and tokens (default: the pairclean cache/judge)")
    p.add_argument("--train-captions", type=int, default=5, help="captions per train photo (1-5), each with one edit")
    p.add_argument("--train-edits", type=int, default=1,
                   help="one-word edits per train caption, each of another kind (1-5); one is drawn per caption and epoch")
    p.add_argument("--edit-words", choices=("core", "training"), default=DEFAULT_EDIT_WORDS,
                   help="word lists of the train edits: core (the first lists, those of the benchmark's edit kind) or "
                        "training (core plus extra words; never the held-out unseen lists)")
    p.add_argument("--edits-per-positive", type=int, default=base.edits_per_positive,
                   help="distinct edits of a caption used as negatives each epoch (up to --train-edits)")
    p.add_argument("--added-negatives", choices=("on", "off"), default="on" if base.added_negatives else "off",
                   help="also train on each caption's clause and negation edits (pairclean.judge.additions), one more "
                        "negative per positive and epoch")
    p.add_argument("--pair-weight", type=float, default=base.pair_weight, help="weight of the edit ranking loss (0: BCE only)")
    p.add_argument("--epochs", type=int, default=base.epochs)
    p.add_argument("--width", type=int, default=base.width)
    p.add_argument("--layers", type=int, default=base.layers)
    p.add_argument("--lr", type=float, default=base.lr)
    p.add_argument("--batch", type=int, default=base.batch)
    p.add_argument("--seed", type=seed, default=base.seed, help="seed of the data (edits) and of the first member")
    p.add_argument("--members", type=int, default=DEFAULT_MEMBERS,
                   help="judges trained from seeds SEED, SEED+1, ... whose logits are averaged (1: one judge)")
    p.add_argument("--colours", choices=("on", "off"), default="on" if base.colours else "off",
                   help="also read each region's colour make-up (off: the shipped judge; see its model card)")
    p.add_argument("--words", choices=("on", "off", "keep"), default="on",
                   help="also train the word grounding (pairclean.judge.words) and add it to the judge's logit (on: the shipped judge); "
                        "keep: with --judge-from, keep that file's grounding as it is")
    p.add_argument("--word-epochs", type=int, default=WordRecipe().epochs, help="epochs of the word grounding's model")
    p.add_argument("--judge-from", default=None,
                   help="take the judge's weights from this judge file instead of training them "
                        "(its recipe and history are kept, so the judge's training options are not used; "
                        "the word grounding and Platt maps are fitted anew)")
    p.add_argument("--threads", type=int, default=None)


def cmd_train_judge(args: argparse.Namespace) -> int:
    """Extract (cached), train, calibrate on dev, save; prints the dev figures."""
    import torch

    from pairclean.calibrate.calibration import cache_dir
    from pairclean.embed.estimators import EstimatorSpec, load_estimator
    from pairclean.lite.evaldata import find_flickr8k
    from pairclean.lite.judge_data import build_cache, load_split, with_texts, word_edits
    from pairclean.judge.edits import VOCABULARIES
    from pairclean.judge.runner import JudgeRunner, load_judge, save_judge
    from pairclean.lite.judge_train import (JudgeRecipe, calibrated_report, dev_scores, fine_mixture, fine_rates, fit_platts,
                                            train_members)
    from pairclean.lite.word_train import WordRecipe, fit_word_grounding

    if not 1 <= args.train_captions <= 5:
        raise InputError(f"--train-captions must be 1-5, got {args.train_captions}")
    if not 1 <= args.train_edits <= 5:
        raise InputError(f"--train-edits must be 1-5, got {args.train_edits}")
    if not 1 <= args.edits_per_positive <= args.train_edits:
        raise InputError(f"--edits-per-positive must be 1-{args.train_edits} (--train-edits), got {args.edits_per_positive}")
    if not 1 <= args.members <= 8:
        raise InputError(f"--members must be 1-8, got {args.members}")
    if not 1 <= args.word_epochs <= 100:
        raise InputError(f"--word-epochs must be 1-100, got {args.word_epochs}")
    if args.words == "keep" and not args.judge_from:
        raise InputError("--words keep needs --judge-from FILE (the grounding to keep)")
    source = load_judge(args.judge_from) if args.judge_from else None  # a bad file fails here, before any work
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    root = Path(args.data) if args.data else find_flickr8k(os.getcwd())
    if root is None or not (root / "captions.jsonl").exists():
        raise InputError("Flickr8k not found: pass --data /path/to/flickr8k or set PAIRCLEAN_FLICKR8K")
    cache = Path(args.features_cache) if args.features_cache else cache_dir() / "judge" / (
        f"lite0-c{args.train_captions}" + (f"-e{args.train_edits}" if args.train_edits > 1 else "")
        + ("" if args.edit_words == "core" else f"-w{args.edit_words}") + ("-a" if args.added_negatives == "on" else ""))
    print(f"extracting (or loading cached) regions and tokens into {cache} ...", flush=True)
    # PyTorch fp32 towers: the judge reads what `pairclean score` computes for pairclean-lite.
    estimator = load_estimator(EstimatorSpec(model="pairclean-lite", precision="fp32", engine="torch"))
    if source is not None:
        JudgeRunner(source, estimator)  # a judge for another estimator's regions and tokens: one line, before any work
    build_cache(root, cache, estimator, seed=args.seed, train_captions=args.train_captions, train_edits=args.train_edits,
                edit_words=VOCABULARIES[args.edit_words], added=args.added_negatives == "on")
    recipe = JudgeRecipe(epochs=args.epochs, width=args.width, layers=args.layers, seed=args.seed, lr=args.lr, batch=args.batch,
                         pair_weight=args.pair_weight, colours=args.colours == "on",
                         edits_per_positive=args.edits_per_positive, added_negatives=args.added_negatives == "on")
    if source is not None:  # the judge's own recipe, and whether it reads colours, are the source's
        kept = source.meta.get("recipe")
        kept = {k: v for k, v in kept.items() if k in asdict(recipe)} if isinstance(kept, dict) else {}
        recipe = JudgeRecipe(**{**asdict(recipe), **kept, "colours": source.model.config.colour_bins > 0})
    train, dev = load_split(cache, "train", recipe.colours), load_split(cache, "dev", recipe.colours)
    if source is not None:
        model, report = source.model, {"history": source.meta.get("history", []), "seconds": 0.0, "from": os.path.basename(args.judge_from)}
    else:
        model, report = train_members(train, dev, recipe, args.members)
    words = source.words if source is not None and args.words == "keep" else None
    if args.words == "on":
        words, word_report = fit_word_grounding(model, train, dev, WordRecipe(epochs=args.word_epochs, seed=args.seed))
        report["words"] = word_report
        print(f"word grounding: weight {words.weight} (dev mean AUC by weight {word_report['dev_mean_auc_by_weight']})", flush=True)
        if words.weight == 0:  # it would add nothing but two passes a caption
            print("word grounding: weight 0 on dev; the judge is saved without it", flush=True)
            words = None
    scores = dev_scores(model, dev, words)  # one scoring of dev for the maps, the rates and the figures
    platt, platt_fine = fit_platts(model, dev, words, scores)
    rates = fine_rates(model, dev, platt_fine, words, scores)
    figures = calibrated_report(model, dev, platt, words=words, scores=scores)
    for name, row in figures.items():
        print(f"{name:<22} judge AUC {row['judge_auc']:.3f} (cosine {row['cosine_auc']:.3f})  ECE {row['ece']:.3f}  "
              f"Brier {row['brier']:.3f}  p_clean clean {row['p_clean_clean']:.2f} noisy {row['p_clean_noisy']:.2f}", flush=True)
    extra = {"recipe": asdict(recipe) | {"train_captions": args.train_captions, "train_edits": args.train_edits,
                                             "edit_words": args.edit_words,
                                             "members": args.members if source is None else source.model.config.members},
             "history": report["history"], "platt_fine": list(platt_fine), "fine_rates": list(rates),
             "dev": figures, "data": "Flickr8k train (training), dev (selection, Platt map, figures)"}
    if source is not None and args.words == "keep":  # the source's grounding, as it was trained
        extra.update({k: source.meta[k] for k in ("word_recipe", "word_report") if k in source.meta})
    if "words" in report:  # trained, kept or not (weight 0)
        extra["word_recipe"] = report["words"]["recipe"]
        extra["word_report"] = {k: v for k, v in report["words"].items() if k != "recipe"}
    if source is not None:  # the judge's own recipe is the source's; this run's data trained the grounding and fitted the maps
        extra["recipe"] = source.meta.get("recipe", extra["recipe"])
        extra["judge_from"] = {"file": os.path.basename(args.judge_from), "sha256": source.sha256,
                               "data": {"train_captions": args.train_captions, "train_edits": args.train_edits,
                                        "edit_words": args.edit_words, "seed": args.seed}}
        if "judge_from" in source.meta:  # the source's own provenance, so the chain back to a trained judge stays readable
            extra["judge_from"]["previous"] = source.meta["judge_from"]
    # the words this judge never trained on: edits made with them stand for other hands' edits
    kept_recipe = extra["recipe"] if isinstance(extra["recipe"], dict) else {}
    other_words = "unseen" if kept_recipe.get("edit_words") == "training" else "extra"
    made = word_edits(dev, VOCABULARIES[other_words], seed=args.seed)
    grown, rows = with_texts(dev, estimator, [m[2] for m in made])
    try:
        mixture = fine_mixture(model, grown, platt_fine, (np.array([m[1] for m in made], np.int64), rows), other_words, words)
        extra["fine_mixture"] = mixture.to_doc()
        print(f"near-miss mixture: {len(rows)} dev edits with {other_words} words", flush=True)
    except ValueError as exc:  # a few dev photos (a test run) give too few such edits: the adjusted count alone
        print(f"near-miss mixture: not fitted ({exc})", flush=True)
    sha = save_judge(args.out, model, platt, "pairclean-lite", extra, words)
    print(f"judge -> {args.out} (sha256 {sha}, Platt a={platt[0]:.3f} b={platt[1]:.3f}, {report['seconds']} s)")
    if args.report:
        Path(args.report).write_text(json.dumps({"sha256": sha, "platt": platt, **report, "dev_calibrated": figures}, indent=2))
    return 0
