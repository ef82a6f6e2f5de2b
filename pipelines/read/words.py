"""A caption's words: the one split every stage that reads words uses.

The word grounding (``pairclean.judge.words``) scores a caption's content words; the corpus
contrast (``pairclean.calibrate.contrast``, shared captions) asks how many a caption has, a
count the embedding stage records per pair (``ShardResult.caption_words``, the sidecar's
``caption_words`` column) so that ``pairclean rescore`` sees what a fresh score saw.
"""

from __future__ import annotations

import re

__all__ = ["FUNCTION_WORDS", "split_words", "content_word_count"]

_WORD = re.compile(r"[a-z]+|[0-9]+")
#: Words never scored (nor hidden): grammar, not content. Numbers and colours are content.
FUNCTION_WORDS = frozenset(
    "a an the is are was were be of in on at with and to its his her their it this that by for from as into while".split())


def split_words(caption: str) -> list[str]:
    """The caption's words, lowercase (letters or digits; everything else splits)."""
    return _WORD.findall(caption.lower())


def content_word_count(caption: str) -> int:
    """How many of ``caption``'s words are content (not ``FUNCTION_WORDS``): "a dog" 1,
    "A black dog" 2, a Flickr8k caption 3 or more (99% of dev's first captions)."""
    return sum(1 for word in split_words(caption) if word not in FUNCTION_WORDS)
