"""Training the judge's word grounding (``pairclean.judge.words``) on Flickr8k train, choosing its
weight on dev.

Recipe (``WordRecipe``; ``pairclean train-judge --words on``): every real train caption
(never an edit), its words with 2+ uses form the vocabulary. Per caption and epoch each
content word is hidden with probability ``mask_rate`` (at least one), and the photo is
replaced by the no-photo token with probability ``image_drop``, so one model learns both
P(word | words, photo) and P(word | words). Cross-entropy on the hidden words, AdamW, a
one-cycle schedule. Weights are stored in float16 (``round_to_stored``); the weight of the
score in the judge's logit is chosen afterwards on dev (``choose_weight``), with the
rounded model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from pairclean.lite.judge_data import SplitFeatures

if TYPE_CHECKING:  # torch is imported where a model is built: `pairclean serve` builds this CLI's parser
    from pairclean.judge.words import WordGrounding, WordModel, WordVocab

__all__ = ["WordRecipe", "train_words", "round_to_stored", "choose_weight", "fit_word_grounding", "WEIGHTS"]

log = logging.getLogger(__name__)

#: Weights of the word score in the judge's logit that ``choose_weight`` tries.
WEIGHTS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.6)


@dataclass(frozen=True)
class WordRecipe:
    """How the word model is trained (recorded in the judge file)."""

    epochs: int = 12
    lr: float = 1e-3
    weight_decay: float = 0.05
    batch: int = 256
    mask_rate: float = 0.25
    image_drop: float = 0.3
    min_count: int = 2
    width: int = 256
    layers: int = 2
    heads: int = 4
    seed: int = 0


def train_words(captions: list[str], image_of: NDArray[np.int64], regions: NDArray[Any], recipe: WordRecipe) -> tuple[WordModel, WordVocab, dict[str, Any]]:
    """A word model trained on ``captions`` (real captions only), caption n written for photo
    ``image_of[n]`` whose regions are ``regions[image_of[n]]`` (I, R, C); returns (model in eval
    mode, vocabulary, report with the loss per epoch)."""
    import torch
    import torch.nn.functional as F

    from pairclean.judge.words import MASK, WordConfig, WordModel, WordVocab

    torch.manual_seed(recipe.seed)
    vocab = WordVocab.of(captions, recipe.min_count)
    config = WordConfig(vocab=len(vocab), image_dim=int(regions.shape[2]), regions=int(regions.shape[1]),
                        width=recipe.width, layers=recipe.layers, heads=recipe.heads)
    model = WordModel(config)
    reg = torch.from_numpy(np.asarray(regions, np.float32))
    model.set_region_stats(reg.mean((0, 1)), reg.std((0, 1)) + 1e-3)
    ids = torch.from_numpy(vocab.encode(captions, config.max_words))
    content = torch.from_numpy(vocab.content(ids.numpy()))
    owner = torch.from_numpy(np.asarray(image_of, np.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    steps = recipe.epochs * max(1, -(-len(ids) // recipe.batch))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, recipe.lr, total_steps=steps, pct_start=0.05)
    history = []
    started = time.perf_counter()
    for epoch in range(recipe.epochs):
        model.train()
        losses = []
        order = torch.randperm(len(ids))
        for start in range(0, len(ids), recipe.batch):
            idx = order[start : start + recipe.batch]
            hide = _hidden(content[idx], recipe.mask_rate)
            if not hide.any():
                continue
            x = ids[idx].masked_fill(hide, MASK)
            use = torch.rand(len(idx)) >= recipe.image_drop
            loss = F.cross_entropy(model(x, reg[owner[idx]], use, hide), ids[idx][hide])
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
        history.append({"epoch": epoch + 1, "loss": round(float(np.mean(losses)), 4), "seconds": round(time.perf_counter() - started, 1)})
        log.info("word model epoch %d: %s", epoch + 1, history[-1])
    model.eval()
    return model, vocab, {"recipe": asdict(recipe), "history": history, "vocabulary": len(vocab)}


def _hidden(content: Any, rate: float) -> Any:
    """Which content words to hide: each with probability ``rate``, at least one a caption that has one."""
    import torch

    hide = content & (torch.rand(content.shape) < rate)
    none = ~hide.any(1) & content.any(1)
    if none.any():
        pick = (torch.rand(content.shape) * content).argmax(1)
        hide[none, pick[none]] = True
    return hide


def round_to_stored(model: WordModel) -> WordModel:
    """The model with its weights rounded to float16 and back: what the judge file stores."""
    import torch

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.copy_(t.half().float())
    return model


def choose_weight(judge_logits: dict[str, NDArray[np.float32]], word: dict[str, NDArray[np.float32]]) -> tuple[float, dict[str, float]]:
    """The weight of ``WEIGHTS`` whose judge logit + weight x word score has the best mean AUC,
    clean against each noise kind (dicts by kind, "clean" included); returns (weight, mean AUC by weight)."""
    from pairclean.judge.metrics import roc_auc

    means = {}
    for w in WEIGHTS:
        s = {k: judge_logits[k] + w * word[k] for k in judge_logits}
        aucs = [roc_auc(np.r_[s["clean"], s[k]], np.r_[np.ones(len(s["clean"]), bool), np.zeros(len(s[k]), bool)])
                for k in s if k != "clean"]
        means[w] = float(np.mean(aucs))
    best = max(means, key=lambda w: (means[w], -w))
    return best, {str(k): round(v, 4) for k, v in means.items()}



def fit_word_grounding(judge: Any, train: SplitFeatures, dev: SplitFeatures, recipe: WordRecipe) -> tuple[WordGrounding, dict[str, Any]]:
    """Train the word model on ``train``'s real captions, round it as stored, and choose its
    weight beside ``judge`` on ``dev``'s pairs (``judge_train.dev_pairs``); returns (check, report)."""
    import torch

    from pairclean.judge.words import WordGrounding, word_scores
    from pairclean.lite.judge_train import dev_pairs, score_pairs

    real = np.nonzero(train.kind == "")[0]
    model, vocab, report = train_words([train.texts[r] for r in real], train.image[real], train.regions, recipe)
    round_to_stored(model)
    pairs = dev_pairs(dev)
    judge_logits = {k: score_pairs(judge, dev, *v) for k, v in pairs.items()}
    probe = WordGrounding(model, vocab, 1.0)
    word = {k: word_scores(probe, torch.from_numpy(dev.regions[img]), [dev.texts[t] for t in txt]) for k, (img, txt) in pairs.items()}
    weight, by_weight = choose_weight(judge_logits, word)
    return WordGrounding(model, vocab, weight), {**report, "weight": weight, "dev_mean_auc_by_weight": by_weight}
