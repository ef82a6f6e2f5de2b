"""Flickr8k features for training and evaluating the judge, computed once and cached.

``build_cache(root, cache)`` runs pairclean-lite's towers (PyTorch fp32, the shipped heads)
once over the train and dev photos and over every caption plus its one-word edits, and
stores per split (float16 where large, under ``cache``, never in the repository):

- ``images-<split>.npz``: ``regions`` (I, R, C) float16, ``emb`` (I, D) float32 (the
  estimator's L2-normalised image embeddings), ``names``;
- ``colours-<split>.npz``: ``colours`` (I, R, K) float16, each region's colour make-up
  (``pairclean.judge.features.region_colours`` on the same pixels and grid);
- ``texts-<split>.npz``: ``tokens`` (T, L, W) float16 (L = ``MAX_TOKENS``), ``mask`` (T, L)
  bool, ``emb`` (T, D) float32, ``image`` (T,) int64 (the photo a caption was written for,
  or whose caption an edit came from), ``kind`` (T,) str ("" for a real caption, else the
  edit kind), ``source`` (T,) int64 (the row of the edited caption; -1 for real ones).

Edits: train, ``train_edits`` per caption (1 by default), of kinds drawn among those that
apply; dev, every kind that applies to each photo's first caption (the benchmark's
"one-word edit" noise).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pairclean.lite.evaldata import load_flickr8k
from pairclean.judge.edits import CORE, EDIT_KINDS, Vocabulary, edit_caption

__all__ = ["MAX_TOKENS", "SplitFeatures", "build_cache", "encode_texts", "load_split", "word_edits", "with_texts"]

log = logging.getLogger(__name__)

#: Caption tokens kept (Flickr8k captions: 97% fit in 24 MiniLM tokens).
MAX_TOKENS = 32


@dataclass
class SplitFeatures:
    """One split's cached features (see the module docstring for shapes)."""

    regions: NDArray[np.float16]
    image_emb: NDArray[np.float32]
    tokens: NDArray[np.float16]
    mask: NDArray[np.bool_]
    text_emb: NDArray[np.float32]
    image: NDArray[np.int64]
    kind: NDArray[np.str_]
    source: NDArray[np.int64]
    texts: list[str]
    #: (I, R, K) colour make-up of each region (None: a cache built before colours).
    colours: NDArray[np.float16] | None = None


def _texts_of(images: list[Any], split: str, seed: int, train_captions: int,
              train_edits: int = 1, edit_words: Vocabulary = CORE, added: bool = False) -> tuple[list[str], list[int], list[str], list[int]]:
    texts, owner, kinds, source = [], [], [], []
    for i, im in enumerate(images):
        # train: ``train_captions`` per photo, rotating which (every annotator's style is seen)
        chosen = im.captions if split == "dev" else [im.captions[(i + k) % len(im.captions)] for k in range(train_captions)]
        for c in chosen:
            texts.append(c)
            owner.append(i)
            kinds.append("")
            source.append(-1)
    rng = np.random.default_rng(seed)
    n_real = len(texts)
    for row in range(n_real):
        caption = texts[row]
        if split == "dev" and row % 5 != 0:
            continue
        kinds_here = EDIT_KINDS if split == "dev" else tuple(rng.permutation(EDIT_KINDS))
        made = 0
        for kind in kinds_here:
            # dev keeps the core words: selection, Platt maps and the model card's figures stay comparable
            edited = edit_caption(caption, kind, rng, CORE if split == "dev" else edit_words)
            if edited is None:
                continue
            texts.append(edited)
            owner.append(owner[row])
            kinds.append(kind)
            source.append(row)
            made += 1
            if split != "dev" and made == train_edits:
                break  # train: ``train_edits`` edits per caption, each of another kind
    if added:
        _add_additions(images, split, texts, owner, kinds, source, n_real, seed)
    return texts, owner, kinds, source


def _add_additions(images: list[Any], split: str, texts: list[str], owner: list[int], kinds: list[str], source: list[int],
                   n_real: int, seed: int) -> None:
    """Append a ``clause`` and a ``negation`` edit (``pairclean.judge.additions``) of each real
    caption (dev: of each photo's first), where they apply. The clauses come from the split's
    own captions (train's for training, dev's for the dev figures)."""
    from pairclean.judge.additions import add_clause, clause_pool, negate

    rng = np.random.default_rng([seed, 1])  # its own stream: the word edits stay those of a cache without additions
    pool = clause_pool(c for im in images for c in im.captions)
    for row in range(n_real):
        if split == "dev" and row % 5 != 0:
            continue
        photo = images[owner[row]]
        for kind, edited in (("clause", add_clause(texts[row], photo.captions, pool, rng)), ("negation", negate(texts[row]))):
            if edited is not None:
                texts.append(edited)
                owner.append(owner[row])
                kinds.append(kind)
                source.append(row)


def build_cache(root: Path, cache: Path, estimator: Any, batch: int = 64, seed: int = 0, train_captions: int = 1,
                train_edits: int = 1, edit_words: Vocabulary = CORE, added: bool = False) -> None:
    """Compute and store the features of the train and dev splits (skips files present).

    ``train_edits``: one-word edits per train caption, each of a different kind (in a random
    order of the kinds, as many as apply up to this number); the trainer draws one of them
    per caption and epoch. With 1 the texts are those of earlier caches, edit for edit.

    ``edit_words``: the word lists the train edits draw from (``edits.CORE``, or
    ``edits.TRAINING``: the core and the extra words); dev edits always use the core words.

    ``added``: also a clause and a negation edit of each caption (``_add_additions``).

    ``train_captions``: captions per train photo (1-5). One by default: on the shared
    2-core machine the text tower ran at about 16 captions/s, so all five captions and their
    edits (60,000 texts) would take an hour; one caption and its edit per photo is 12,000.
    """
    import torch

    from pairclean.judge.features import image_parts

    cache.mkdir(parents=True, exist_ok=True)
    model = estimator.model
    for split in ("dev", "train"):
        images = load_flickr8k(root, split)
        ipath = cache / f"images-{split}.npz"
        if not ipath.exists():
            t0 = time.perf_counter()
            regions, embs = [], []
            for start in range(0, len(images), batch):
                x = _pixels(images[start : start + batch], estimator).contiguous(memory_format=torch.channels_last)
                with torch.inference_mode():
                    pooled, reg = image_parts(model, x)
                regions.append(reg.to(torch.float16).numpy())
                embs.append(torch.nn.functional.normalize(pooled.float(), dim=-1).numpy())
            _save(ipath, regions=np.concatenate(regions), emb=np.concatenate(embs), names=np.array([i.image for i in images]))
            log.info("%s images: %d in %.0f s", split, len(images), time.perf_counter() - t0)
        cpath = cache / f"colours-{split}.npz"
        if not cpath.exists():
            _save(cpath, colours=_colours_of(images, estimator, batch))
        tpath = cache / f"texts-{split}.npz"
        if not tpath.exists():
            t0 = time.perf_counter()
            texts, owner, kinds, source = _texts_of(images, split, seed, train_captions, train_edits, edit_words, added)
            tokens, text_masks, text_embs = encode_texts(estimator, texts)
            _save(tpath, tokens=tokens, mask=text_masks, emb=text_embs,
                  image=np.array(owner, np.int64), kind=np.array(kinds), source=np.array(source, np.int64),
                  texts=np.array(texts))
            log.info("%s texts: %d in %.0f s", split, len(texts), time.perf_counter() - t0)


def word_edits(dev: SplitFeatures, vocabulary: Vocabulary, seed: int = 0) -> list[tuple[str, int, str]]:
    """(kind, photo, text) of every one-word edit of each dev photo's first caption that
    ``vocabulary`` can make (one per edit kind that applies; ``edits.edit_caption``)."""
    rng = np.random.default_rng(seed)
    out = []
    for photo, row in enumerate(np.nonzero(dev.kind == "")[0][::5]):  # five captions per photo, in order
        for kind in EDIT_KINDS:
            edited = edit_caption(dev.texts[row], kind, rng, vocabulary)
            if edited is not None:
                out.append((kind, photo, edited))
    return out


def with_texts(split: SplitFeatures, estimator: Any, texts: list[str]) -> tuple[SplitFeatures, NDArray[np.int64]]:
    """A copy of ``split`` with ``texts`` appended (encoded by ``estimator``'s text tower, as
    ``encode_texts``), and their rows (T,) in it. The new rows have no owner photo (-1)."""
    if not texts:
        return split, np.zeros(0, np.int64)
    tokens, mask, emb = encode_texts(estimator, texts)
    base = len(split.texts)
    n = len(texts)
    grown = SplitFeatures(split.regions, split.image_emb, np.concatenate([split.tokens, tokens]),
                          np.concatenate([split.mask, mask]), np.concatenate([split.text_emb, emb]),
                          np.r_[split.image, np.full(n, -1, np.int64)], np.r_[split.kind, np.full(n, "added")],
                          np.r_[split.source, np.full(n, -1, np.int64)], [*split.texts, *texts], split.colours)
    return grown, base + np.arange(n, dtype=np.int64)


def encode_texts(estimator: Any, texts: list[str], batch: int = 256) -> tuple[NDArray[np.float16], NDArray[np.bool_], NDArray[np.float32]]:
    """The judge's text inputs for ``texts``: token states (T, ``MAX_TOKENS``, W) float16
    (zero-padded), masks (T, ``MAX_TOKENS``) bool, and the estimator's L2-normalised caption
    embeddings (T, D) float32, from one pass of its text tower (pairclean-lite's, as
    ``pairclean score`` runs it)."""
    import torch

    from pairclean.judge.features import text_parts

    tok_parts, masks, embs = [], [], []
    for start in range(0, len(texts), batch):
        ids = estimator.tokenizer(texts[start : start + batch])[:, :MAX_TOKENS]
        with torch.inference_mode():
            pooled, tok, mask = text_parts(estimator.model, ids)
        pad = MAX_TOKENS - tok.shape[1]
        tok_parts.append(np.pad(tok.to(torch.float16).numpy(), ((0, 0), (0, pad), (0, 0))))
        masks.append(np.pad(mask.numpy(), ((0, 0), (0, pad))))
        embs.append(torch.nn.functional.normalize(pooled.float(), dim=-1).numpy())
    return np.concatenate(tok_parts), np.concatenate(masks), np.concatenate(embs)


def _pixels(images: list[Any], estimator: Any) -> Any:
    import torch
    from PIL import Image

    px = []
    for im in images:
        with Image.open(im.path) as pil:
            px.append(estimator.preprocess(pil.convert("RGB")))
    return torch.stack(px)


def _colours_of(images: list[Any], estimator: Any, batch: int) -> NDArray[np.float16]:
    """(I, R, K) ``region_colours`` of ``images`` on the grid of the estimator's regions."""
    from pairclean.judge.features import colour_grid, estimator_colours, image_parts_dim

    t0 = time.perf_counter()
    grid = colour_grid(image_parts_dim(estimator.model, estimator.image_size)[0])
    out = [estimator_colours(estimator, _pixels(images[s : s + batch], estimator), grid).numpy().astype(np.float16)
           for s in range(0, len(images), batch)]
    log.info("colours of %d images in %.0f s", len(images), time.perf_counter() - t0)
    return np.concatenate(out)


def _save(path: Path, **arrays: Any) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def load_split(cache: Path, split: str, colours: bool = False) -> SplitFeatures:
    """The cached features of ``split`` (``build_cache`` first); ``colours``: with the regions'
    colour make-up (an error where the cache has none), else without."""
    im = np.load(cache / f"images-{split}.npz", allow_pickle=False)
    tx = np.load(cache / f"texts-{split}.npz", allow_pickle=False)
    cpath = cache / f"colours-{split}.npz"
    return SplitFeatures(
        regions=im["regions"], image_emb=im["emb"], tokens=tx["tokens"], mask=tx["mask"], text_emb=tx["emb"],
        image=tx["image"], kind=tx["kind"], source=tx["source"], texts=list(tx["texts"]),
        colours=np.load(cpath, allow_pickle=False)["colours"] if colours else None,
    )
