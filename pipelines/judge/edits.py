"""One-word edits of a caption: near-miss negatives that say something false about the image.

``edit_caption(caption, kind, rng)`` returns the caption with ONE content word changed so
that it no longer describes the photo, or ``None`` where that kind does not apply:

- ``object``: a noun becomes another noun of the same family (dog -> cat, man -> woman,
  ball -> frisbee, beach -> street), number kept (dogs -> cats);
- ``attribute``: a colour or size word becomes a different one (red -> blue, little -> big);
- ``count``: a number word becomes another (two -> three); where the caption has none, an
  article before a listed noun becomes a number and the noun its plural (a dog -> two dogs:
  the same one fact, two tokens);
- ``action``: a verb of the same form becomes another (running -> sleeping, jumps -> sits);
- ``swap``: the first two different listed nouns trade places, each slot keeping its own
  number ("a dog chases a cat" -> "a cat chases a dog"): the same words, wrong roles.

Deterministic: the same caption, kind and generator state give the same edit. Case and
punctuation are kept; an ``a``/``an`` before the changed word follows the new word.

The word lists are small and hand-written on purpose: Flickr8k-style captions use a few
hundred frequent words (people, dogs, colours, a dozen actions), and a hand-picked list can
keep near-synonyms apart (grey/gray, blond/blonde, running/racing are never swapped for
each other, so an "edit" is really wrong); a lexical database (WordNet) would pull in a
dependency and propose synonyms and rare senses that need filtering anyway. Pure Python.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

__all__ = ["EDIT_KINDS", "edit_caption", "applicable_kinds"]

#: The kinds of edit, in a fixed order (benchmarks and training sample by index).
EDIT_KINDS: tuple[str, ...] = ("object", "attribute", "count", "action", "swap")

# Nouns by family, as (singular, plural). An object edit stays within a family so the new
# caption is fluent ("a man rides a horse" -> "a woman rides a horse") yet false.
_NOUN_FAMILIES: dict[str, tuple[tuple[str, str], ...]] = {
    "animal": (
        ("dog", "dogs"), ("cat", "cats"), ("horse", "horses"), ("bird", "birds"),
        ("cow", "cows"), ("sheep", "sheep"), ("duck", "ducks"), ("puppy", "puppies"),
    ),
    "person": (
        ("man", "men"), ("woman", "women"), ("boy", "boys"), ("girl", "girls"),
        ("baby", "babies"), ("child", "children"),
    ),
    "thing": (
        ("ball", "balls"), ("frisbee", "frisbees"), ("stick", "sticks"), ("toy", "toys"),
        ("kite", "kites"), ("umbrella", "umbrellas"), ("guitar", "guitars"), ("hat", "hats"),
    ),
    "vehicle": (
        ("bike", "bikes"), ("car", "cars"), ("motorcycle", "motorcycles"),
        ("boat", "boats"), ("skateboard", "skateboards"), ("surfboard", "surfboards"),
    ),
    "place": (
        ("beach", "beaches"), ("field", "fields"), ("street", "streets"), ("snow", "snow"),
        ("pool", "pools"), ("park", "parks"), ("lake", "lakes"), ("mountain", "mountains"),
        ("road", "roads"), ("grass", "grass"), ("sand", "sand"), ("river", "rivers"),
    ),
}
# Pairs never swapped for each other: one could be the other in the photo.
_NOUN_TOO_CLOSE = {
    frozenset(("dog", "puppy")), frozenset(("child", "boy")), frozenset(("child", "girl")),
    frozenset(("child", "baby")), frozenset(("girl", "baby")), frozenset(("boy", "baby")),
    # Flickr captions call teenagers both: "a young woman" may be a girl in the photo.
    frozenset(("woman", "girl")), frozenset(("man", "boy")),
    frozenset(("street", "road")), frozenset(("field", "grass")),
    frozenset(("field", "park")), frozenset(("beach", "sand")), frozenset(("lake", "river")),
    frozenset(("grass", "park")), frozenset(("bike", "motorcycle")),
}
# Role swaps need an agent: people and animals do things to others.
_AGENT_FAMILIES = ("animal", "person")

# Attribute words by group; each inner tuple is one meaning (synonym spellings together).
_ATTRIBUTE_GROUPS: dict[str, tuple[tuple[str, ...], ...]] = {
    "colour": (
        ("black",), ("white",), ("brown", "tan"), ("red",), ("blue",), ("green",),
        ("yellow",), ("pink",), ("orange",), ("purple",), ("grey", "gray"),
    ),
    "size": (("little", "small"), ("big", "large")),
    "age": (("young",), ("old", "older", "elderly")),
}
# Replacement targets: one spelling per meaning (never a synonym spelling of the source).
_ATTRIBUTE_TARGETS = {group: tuple(m[0] for m in meanings) for group, meanings in _ATTRIBUTE_GROUPS.items()}

_NUMBERS = ("one", "two", "three", "four", "five", "six")

# Verbs of one form each; near-synonyms left out (racing, leaping, laying, strolling).
_ACTIONS: dict[str, tuple[str, ...]] = {
    "ing": ("running", "walking", "jumping", "sitting", "standing", "swimming", "climbing",
            "sleeping", "eating", "dancing", "riding", "lying"),
    "s": ("runs", "walks", "jumps", "sits", "stands", "swims", "climbs", "sleeps", "eats",
          "dances", "rides", "lies"),
}

_WORD = re.compile(r"[A-Za-z]+(?:[-'][A-Za-z]+)*")
_VOWEL_START = re.compile(r"^[aeiou]", re.IGNORECASE)


@dataclass(frozen=True)
class _Noun:
    lemma: str
    plural: bool
    family: str


def _noun_index() -> dict[str, _Noun]:
    index: dict[str, _Noun] = {}
    for family, pairs in _NOUN_FAMILIES.items():
        for singular, plural in pairs:
            index[plural] = _Noun(singular, singular != plural, family)
            index[singular] = _Noun(singular, False, family)
    return index


_NOUNS = _noun_index()
_NOUN_FORMS = {s: (s, p) for pairs in _NOUN_FAMILIES.values() for s, p in pairs}
_ATTRIBUTES = {w: (g, i) for g, ms in _ATTRIBUTE_GROUPS.items() for i, m in enumerate(ms) for w in m}
_ACTION_FORM = {w: form for form, words in _ACTIONS.items() for w in words}


def _words(caption: str) -> list[re.Match[str]]:
    return list(_WORD.finditer(caption))


def _match_case(new: str, old: str) -> str:
    if old.isupper() and len(old) > 1:
        return new.upper()
    if old[:1].isupper():
        return new[:1].upper() + new[1:]
    return new


def _form(lemma: str, plural: bool) -> str:
    singular, plural_form = _NOUN_FORMS[lemma]
    return plural_form if plural else singular


def _rebuild(caption: str, words: list[re.Match[str]], changes: dict[int, str]) -> str:
    """``caption`` with word ``i`` replaced by ``changes[i]`` (case kept), and the article
    before each changed word fixed to a/an for the new word."""
    changes = dict(changes)
    for i in list(changes):
        if i > 0 and (i - 1) not in changes:
            article = words[i - 1].group().lower()
            if article in ("a", "an"):
                wanted = "an" if _VOWEL_START.match(changes[i]) else "a"
                if wanted != article:
                    changes[i - 1] = wanted
    out, last = [], 0
    for i, match in enumerate(words):
        if i in changes:
            out.append(caption[last : match.start()])
            out.append(_match_case(changes[i], match.group()))
            last = match.end()
    out.append(caption[last:])
    return "".join(out)


_T = TypeVar("_T")


def _pick(rng: np.random.Generator, options: Sequence[_T]) -> _T:
    return options[int(rng.integers(len(options)))]


def _edit_object(caption: str, words: list[re.Match[str]], rng: np.random.Generator) -> str | None:
    slots = [i for i, m in enumerate(words) if m.group().lower() in _NOUNS]
    if not slots:
        return None
    i = _pick(rng, slots)
    noun = _NOUNS[words[i].group().lower()]
    others = [
        s for s, _ in _NOUN_FAMILIES[noun.family]
        if s != noun.lemma and frozenset((s, noun.lemma)) not in _NOUN_TOO_CLOSE
    ]
    new = _pick(rng, others)
    return _rebuild(caption, words, {i: _form(new, noun.plural)})


def _edit_attribute(caption: str, words: list[re.Match[str]], rng: np.random.Generator) -> str | None:
    slots = [i for i, m in enumerate(words) if m.group().lower() in _ATTRIBUTES]
    if not slots:
        return None
    i = _pick(rng, slots)
    group, meaning = _ATTRIBUTES[words[i].group().lower()]
    targets = [w for k, w in enumerate(_ATTRIBUTE_TARGETS[group]) if k != meaning]
    return _rebuild(caption, words, {i: _pick(rng, targets)})


def _edit_count(caption: str, words: list[re.Match[str]], rng: np.random.Generator) -> str | None:
    slots = [i for i, m in enumerate(words) if m.group().lower() in _NUMBERS]
    if slots:
        i = _pick(rng, slots)
        old = words[i].group().lower()
        if old == "one":
            return _one_to_many(caption, words, i, rng)
        # A plural count stays plural ("two dogs" -> "three dogs", never "one dogs").
        targets = [n for n in _NUMBERS if n not in (old, "one")]
        return _rebuild(caption, words, {i: _pick(rng, targets)})
    # No number word: "a (little) dog" -> "two (little) dogs", where a listed countable
    # singular noun follows the article directly or after one listed attribute word.
    pairs: list[tuple[int, int]] = []
    for i in range(len(words) - 1):
        if words[i].group().lower() not in ("a", "an"):
            continue
        j = i + 2 if words[i + 1].group().lower() in _ATTRIBUTES and i + 2 < len(words) else i + 1
        if _countable_singular(words[j].group().lower()):
            pairs.append((i, j))
    if not pairs:
        return None
    i, j = _pick(rng, pairs)
    lemma = _NOUNS[words[j].group().lower()].lemma
    number = _pick(rng, ["two", "three", "four"])
    return _rebuild(caption, words, {i: number, j: _form(lemma, True)})


def _countable_singular(word: str) -> bool:
    """A listed noun in its singular form whose plural differs (dog, not sheep or snow)."""
    noun = _NOUNS.get(word)
    return noun is not None and not noun.plural and _NOUN_FORMS[noun.lemma][1] != word


def _one_to_many(caption: str, words: list[re.Match[str]], i: int, rng: np.random.Generator) -> str | None:
    """"one dog" -> "two dogs": only where the next word is a listed singular noun."""
    if i + 1 >= len(words):
        return None
    nxt = words[i + 1].group().lower()
    if not _countable_singular(nxt):
        return None
    number = _pick(rng, ["two", "three", "four"])
    return _rebuild(caption, words, {i: number, i + 1: _form(_NOUNS[nxt].lemma, True)})


def _edit_action(caption: str, words: list[re.Match[str]], rng: np.random.Generator) -> str | None:
    slots = [i for i, m in enumerate(words) if m.group().lower() in _ACTION_FORM]
    if not slots:
        return None
    i = _pick(rng, slots)
    old = words[i].group().lower()
    targets = [w for w in _ACTIONS[_ACTION_FORM[old]] if w != old]
    return _rebuild(caption, words, {i: _pick(rng, targets)})


def _edit_swap(caption: str, words: list[re.Match[str]], rng: np.random.Generator) -> str | None:
    del rng  # deterministic by construction: the first two different nouns, one an agent
    slots = [i for i, m in enumerate(words) if m.group().lower() in _NOUNS]
    for a_pos, a in enumerate(slots):
        first = _NOUNS[words[a].group().lower()]
        for b in slots[a_pos + 1 :]:
            second = _NOUNS[words[b].group().lower()]
            if first.lemma == second.lemma or frozenset((first.lemma, second.lemma)) in _NOUN_TOO_CLOSE:
                continue
            if first.family not in _AGENT_FAMILIES and second.family not in _AGENT_FAMILIES:
                continue
            if first.family == "place" or second.family == "place":
                continue  # "a beach runs on a dog" is nonsense, not a role error
            changes = {a: _form(second.lemma, first.plural), b: _form(first.lemma, second.plural)}
            return _rebuild(caption, words, changes)
    return None


_EDITORS = {
    "object": _edit_object,
    "attribute": _edit_attribute,
    "count": _edit_count,
    "action": _edit_action,
    "swap": _edit_swap,
}


def edit_caption(caption: str, kind: str, rng: np.random.Generator) -> str | None:
    """``caption`` with one word changed by ``kind`` (one of ``EDIT_KINDS``), or ``None``
    where that kind does not apply (no listed word of the kind in the caption).

    The result always differs from ``caption``. ``rng`` picks the position and the new word.
    Raises ``ValueError`` for an unknown kind.
    """
    if kind not in _EDITORS:
        raise ValueError(f"unknown edit kind {kind!r}; expected one of {', '.join(EDIT_KINDS)}")
    words = _words(caption)
    edited = _EDITORS[kind](caption, words, rng)
    if edited is None or edited.lower() == caption.lower():
        return None
    return edited


def applicable_kinds(caption: str) -> tuple[str, ...]:
    """The kinds ``edit_caption`` can apply to ``caption`` (no randomness spent)."""
    probe = np.random.default_rng(0)
    return tuple(k for k in EDIT_KINDS if edit_caption(caption, k, probe) is not None)
