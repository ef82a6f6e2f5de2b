"""The word grounding: does the photo make each of the caption's words more likely? (issue 21)

The judge reads one wrong word well only for the words its training edits changed
(``JUDGE_MODEL_CARD.md``, "Words the judge never saw changed"). The word grounding gives
grounding for every word of the training captions, learnt from the captions alone: a
small masked word model over the image regions (``WordModel``) predicts a caption's
content words, hidden all at once, from the words left and the photo. Trained with the
photo dropped for some captions, the same model also predicts them without it. A word's
score is its pointwise mutual information with the photo,

    log P(word | other words, photo) - log P(word | other words, no photo),

and a caption's is the mean of its two lowest (``word_scores``): a wrong word is one the
photo makes less likely. The cascade adds ``weight`` x this score to the judge's logit
before the Platt maps (``pairclean.judge.runner``); ``weight`` is chosen on Flickr8k dev.

Inputs: the estimator's region grid (N, R, C) (the judge's own input) and the captions
as text (a lowercase word split of their own, ``WordVocab``). Two passes of the model a
caption (with and without the photo), all content words at once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from pairclean.read.words import FUNCTION_WORDS, split_words

__all__ = ["WordConfig", "WordModel", "WordVocab", "WordGrounding", "FUNCTION_WORDS", "split_words", "word_scores"]

PAD, UNK, MASK = 0, 1, 2
MAX_LAYERS = 12  # a bound on what a judge file may ask to build
_SPECIAL = ("<pad>", "<unk>", "<mask>")


@dataclass(frozen=True)
class WordConfig:
    """Shape of a word model (stored in the judge file's metadata)."""

    vocab: int
    image_dim: int = 320
    regions: int = 49
    width: int = 256
    layers: int = 2
    heads: int = 4
    max_words: int = 24
    dropout: float = 0.1

    def __post_init__(self) -> None:
        # A judge file is input: its shape must make sense before anything is built from it.
        for name in ("vocab", "image_dim", "regions", "width", "layers", "heads", "max_words"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"word config {name} must be a positive whole number, got {value!r}")
        if self.width % self.heads or self.layers > MAX_LAYERS:
            raise ValueError(f"word config: width {self.width} in {self.heads} heads, {self.layers} layers (at most {MAX_LAYERS})")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"word config dropout must be in [0, 1), got {self.dropout!r}")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the tensors that fix this config's size (checked against a file's before building)."""
        return {"embed.weight": (self.vocab, self.width), "pos": (self.max_words, self.width),
                "region_pos": (self.regions, self.width), "region_mean": (self.image_dim,)}

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WordConfig:
        return cls(**json.loads(text))


class WordVocab:
    """The words a word model knows (index 0-2: padding, unknown, mask), and the split of a caption."""

    def __init__(self, words: list[str]) -> None:
        if list(words[: len(_SPECIAL)]) != list(_SPECIAL):
            raise ValueError("a word vocabulary starts with <pad>, <unk>, <mask>")
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}

    @classmethod
    def of(cls, captions: list[str], min_count: int) -> WordVocab:
        """Every word used ``min_count`` times or more in ``captions``."""
        from collections import Counter

        counts = Counter(w for c in captions for w in split_words(c))
        return cls([*_SPECIAL, *sorted(w for w, n in counts.items() if n >= min_count)])

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, captions: list[str], max_words: int) -> NDArray[np.int64]:
        """(N, max_words) word ids (PAD after the caption, UNK for unknown words); longer captions are cut."""
        out = np.zeros((len(captions), max_words), np.int64)
        for row, caption in enumerate(captions):
            ids = [self.index.get(w, UNK) for w in split_words(caption)[:max_words]]
            out[row, : len(ids)] = ids
        return out

    def content(self, ids: NDArray[np.int64]) -> NDArray[np.bool_]:
        """Where ``ids`` hold a known content word (what the check hides and scores)."""
        function = np.array([self.index[w] for w in FUNCTION_WORDS if w in self.index], np.int64)
        return (ids > MASK) & ~np.isin(ids, function)


class WordModel(nn.Module):
    """A masked word model over image regions: pre-LN transformer layers (self-attention over
    the words, cross-attention to the regions, MLP), output tied to the word embeddings.
    ``use_image`` False replaces the regions by one learned token (the no-photo model)."""

    def __init__(self, config: WordConfig) -> None:
        super().__init__()
        self.config = config
        w = config.width
        self.embed = nn.Embedding(config.vocab, w)
        self.pos = nn.Parameter(torch.zeros(config.max_words, w))
        # The regions are standardised per channel with train statistics (kept with the weights).
        self.register_buffer("region_mean", torch.zeros(config.image_dim))
        self.register_buffer("region_std", torch.ones(config.image_dim))
        self.region_in = nn.Sequential(nn.LayerNorm(config.image_dim), nn.Linear(config.image_dim, w))
        self.region_pos = nn.Parameter(torch.zeros(config.regions, w))
        self.no_image = nn.Parameter(torch.zeros(1, 1, w))
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(w, config.heads, 4 * w, config.dropout, batch_first=True, norm_first=True, activation="gelu")
            for _ in range(config.layers))
        self.out_ln = nn.LayerNorm(w)
        for p in (self.embed.weight, self.pos, self.region_pos, self.no_image):
            nn.init.normal_(p, std=0.02)

    def set_region_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Standardise regions with these per-channel statistics (of the training photos)."""
        self.register_buffer("region_mean", mean.detach().float().clone())
        self.register_buffer("region_std", std.detach().float().clone())

    def forward(self, ids: torch.Tensor, regions: torch.Tensor, use_image: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Logits (M, vocab) over the words at the M places where ``at`` (N, L) is True,
        ids (N, L) with MASK there; regions (N, R, C); use_image (N,) bool."""
        if regions.shape[1:] != (self.config.regions, self.config.image_dim):
            raise ValueError(f"word model expects {self.config.regions} x {self.config.image_dim} regions, got {tuple(regions.shape[1:])}")
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        std: torch.Tensor = self.region_std  # type: ignore[assignment]
        mean: torch.Tensor = self.region_mean  # type: ignore[assignment]
        memory = self.region_in((regions.float() - mean) / std) + self.region_pos
        memory = torch.where(use_image[:, None, None], memory, self.no_image.expand(len(ids), memory.shape[1], -1))
        pad = ids == PAD
        for layer in self.layers:
            h = layer(h, memory, tgt_key_padding_mask=pad)
        out: torch.Tensor = self.out_ln(h)[at] @ self.embed.weight.T
        return out


@dataclass
class WordGrounding:
    """A trained word model with its vocabulary and the weight of its score in the judge's logit."""

    model: WordModel
    vocab: WordVocab
    weight: float

    def add_to(self, logits: NDArray[np.float32], regions: torch.Tensor, captions: list[str]) -> NDArray[np.float32]:
        """The judge's ``logits`` (N,) plus ``weight`` x the captions' word scores: the one rule
        the runner and training's scoring share."""
        return np.asarray(logits + np.float32(self.weight) * word_scores(self, regions, captions), np.float32)

    def describe(self) -> dict[str, object]:
        """What the output metadata records about the check."""
        return {"config": asdict(self.model.config), "weight": self.weight,
                "parameters": sum(p.numel() for p in self.model.parameters())}


@torch.inference_mode()
def word_scores(check: WordGrounding, regions: torch.Tensor, captions: list[str], batch: int = 512) -> NDArray[np.float32]:
    """(N,) the caption's word score: the mean of its two lowest PMIs with the photo (see the
    module docstring); 0 for a caption without a known content word (nothing to say)."""
    model, vocab = check.model, check.vocab
    model.eval()
    ids = vocab.encode(captions, model.config.max_words)
    content = vocab.content(ids)
    out = np.zeros(len(captions), np.float32)
    for start in range(0, len(captions), batch):
        sl = slice(start, start + batch)
        rows = np.nonzero(content[sl].any(1))[0]
        if rows.size == 0:
            continue
        width = int((ids[sl][rows] != PAD).sum(1).max())
        device = regions.device  # the model runs where the regions are (the runner moves it there)
        at = torch.from_numpy(content[sl][rows, :width]).to(device)
        x = torch.from_numpy(ids[sl][rows, :width]).to(device)
        target = x[at]
        hidden = x.masked_fill(at, MASK)
        reg = regions[sl][torch.from_numpy(rows).to(device)]
        with_image = _log_prob(model, hidden, reg, True, at, target)
        without = _log_prob(model, hidden, reg, False, at, target)
        pmi = (with_image - without).cpu().numpy()
        owner = at.nonzero()[:, 0].cpu().numpy()
        out[start + rows] = _two_lowest_mean(pmi, owner, len(rows))
    return out


def _log_prob(model: WordModel, ids: torch.Tensor, regions: torch.Tensor, use_image: bool, at: torch.Tensor,
              target: torch.Tensor) -> torch.Tensor:
    use = torch.full((len(ids),), use_image, device=ids.device)
    logits = model(ids, regions, use, at).float().log_softmax(-1)
    picked: torch.Tensor = logits[torch.arange(len(target), device=ids.device), target]
    return picked


def _two_lowest_mean(values: NDArray[np.float32], owner: NDArray[np.int64], n: int) -> NDArray[np.float32]:
    """Per owner 0..n-1 (sorted ``owner``), the mean of its two lowest values (its one value if it has one)."""
    order = np.lexsort((values, owner))
    values, owner = values[order], owner[order]
    first = np.searchsorted(owner, np.arange(n))
    count = np.bincount(owner, minlength=n)
    second = np.where(count > 1, first + 1, first)
    return ((values[first] + values[second]) / 2).astype(np.float32)
