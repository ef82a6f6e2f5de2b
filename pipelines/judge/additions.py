"""Captions that say something false beyond one wrong word: a clause added, a negation.

Two shapes of near-miss that the one-word edits (``edits.py``) do not make, both common
where captions are written by a model or embellished by a person:

- ``clause``: the caption with a clause of another photo's caption appended ("A dog runs
  on the grass" + "next to a large elephant"), chosen so that none of the clause's content
  words occurs in any caption of the photo (so it is false of the photo, as far as its five
  annotators say). A clause is a caption's tail from a preposition or a participle on
  (``clauses``), 2 to 8 words.
- ``negation``: the first "is"/"are" of the caption followed by "not" ("A dog is not
  running"): a caption that denies what the photo shows.

The judge's recipe can train on them (``pairclean train-judge --added-negatives on``) and
the hard-noise benchmark measures them (its ``clause`` and ``negation`` kinds, with
clauses of Flickr8k dev captions: the recipe's come from train). Pure Python, deterministic
under ``rng``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["ADDED_KINDS", "add_clause", "clause_pool", "clauses", "content_words", "negate"]

#: The kinds of this module, in a fixed order.
ADDED_KINDS: tuple[str, ...] = ("clause", "negation")

# Where a clause may start: a space before one of these words (longest first).
_STARTERS = ("in front of", "on top of", "next to", "close to", "in the middle of", "near", "beside", "behind", "under",
             "beneath", "with", "while", "at", "on", "in", "by", "holding", "wearing", "carrying", "across", "through",
             "along", "around", "against", "into", "over")
_START = re.compile(r"\s(?=(?:" + "|".join(re.escape(s) for s in _STARTERS) + r")\s)", re.IGNORECASE)
_WORD = re.compile(r"[a-z]+", re.IGNORECASE)
_STOP = frozenset(
    "a an the of in on at with and to is are was were be his her their its it this that these those some one two three "
    "four five six several many near next front top middle beside behind under beneath while by holding wearing carrying "
    "across through along around against into over close as for from up down out off other another each very".split())
_TAIL = re.compile(r"\s*[.!?]*\s*$")


def content_words(text: str) -> set[str]:
    """The lower-case words of ``text`` that are not stop words, a final plural "s" dropped
    ("dogs" and "dog" are one word here)."""
    words = (w.lower() for w in _WORD.findall(text))
    return {w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w for w in words if w not in _STOP}


def clauses(caption: str) -> list[str]:
    """The caption's tails from each clause start on, of 2 to 8 words with at least one content
    word, without the final punctuation ("A dog runs on the grass ." -> ["on the grass"])."""
    body = _TAIL.sub("", caption)
    out = []
    for m in _START.finditer(body):
        tail = body[m.end():].strip()
        n = len(tail.split())
        if 2 <= n <= 8 and content_words(tail):
            out.append(tail)
    return out


def clause_pool(captions: Iterable[str]) -> list[str]:
    """Every distinct clause of ``captions`` (``clauses``), in first-seen order."""
    seen: dict[str, str] = {}
    for caption in captions:
        for clause in clauses(caption):
            seen.setdefault(clause.lower(), clause)
    return list(seen.values())


def add_clause(caption: str, photo_captions: Sequence[str], pool: Sequence[str], rng: np.random.Generator,
               tries: int = 20) -> str | None:
    """``caption`` with a clause of ``pool`` appended whose content words occur in none of
    ``photo_captions`` (the photo's own captions, ``caption`` among them), or None where
    ``tries`` draws find none. The caption's final punctuation is kept after the clause."""
    if not pool:
        return None
    known = set().union(*(content_words(c) for c in photo_captions)) | content_words(caption)
    body = _TAIL.sub("", caption)
    if not body:
        return None
    end = caption[len(body):]
    for _ in range(tries):
        clause = pool[int(rng.integers(len(pool)))]
        if content_words(clause) & known:
            continue
        return f"{body} {clause}{end}"
    return None


_AUX = re.compile(r"\b(is|are)\s+(?!not\b)(?=[a-z])", re.IGNORECASE)


def negate(caption: str) -> str | None:
    """``caption`` with "not" after its first "is"/"are" ("A dog is running" -> "A dog is not
    running"), or None where it has none (or already denies)."""
    m = _AUX.search(caption)
    if m is None:
        return None
    return f"{caption[: m.end(1)]} not{caption[m.end(1):]}"
