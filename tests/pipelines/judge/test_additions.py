"""Clause and negation edits: false of the photo, as far as its captions say, and deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from pairclean.judge.additions import add_clause, clause_pool, clauses, content_words, negate

PHOTO = ["A brown dog runs on the grass .", "A dog chases a red ball in a park .", "A puppy plays outside ."]
OTHERS = ["A man in a suit stands in front of the Eiffel Tower .", "Two girls sit on a bench near the lake .",
          "A boy with a red kite on the beach .", "A cat sleeps on a sofa ."]


def test_clauses_are_tails_from_a_preposition_with_a_content_word() -> None:
    assert clauses("A brown dog runs on the grass next to a red ball .") == ["on the grass next to a red ball", "next to a red ball"]
    assert clauses("A dog runs .") == []
    assert all(2 <= len(c.split()) <= 8 for c in clause_pool(OTHERS))
    assert "in front of the Eiffel Tower" in clause_pool(OTHERS)  # case kept, each clause once
    assert len(clause_pool(OTHERS + OTHERS)) == len(clause_pool(OTHERS))


def test_an_added_clause_uses_no_word_of_the_photos_captions() -> None:
    pool = clause_pool(OTHERS + PHOTO)  # the photo's own clauses are in the pool: never chosen
    known = set().union(*(content_words(c) for c in PHOTO))
    for seed in range(30):
        made = add_clause(PHOTO[0], PHOTO, pool, np.random.default_rng(seed))
        assert made is not None and made.startswith("A brown dog runs on the grass ") and made.endswith(" .")
        added = made[len("A brown dog runs on the grass "):-2]
        assert added in pool and not content_words(added) & known
    # the same generator state, the same edit; nothing to add where every clause is true of the photo
    assert add_clause(PHOTO[0], PHOTO, pool, np.random.default_rng(3)) == add_clause(PHOTO[0], PHOTO, pool, np.random.default_rng(3))
    assert add_clause(PHOTO[0], PHOTO, clause_pool(PHOTO), np.random.default_rng(0)) is None
    assert add_clause(PHOTO[0], PHOTO, [], np.random.default_rng(0)) is None


@pytest.mark.parametrize(("caption", "negated"), [
    ("A dog is running on the grass .", "A dog is not running on the grass ."),
    ("Two girls are sitting on a bench", "Two girls are not sitting on a bench"),
    ("A man Is jumping", "A man Is not jumping"),
    ("A dog is not running .", None),
    ("A dog runs on the grass .", None),
    ("This island is", None),
])
def test_negation_denies_the_first_is_or_are(caption: str, negated: str | None) -> None:
    assert negate(caption) == negated
