"""Short shared captions, right and wrong: corpora a rule for captions many photos carry must get right.

Builds six 1,000-pair corpora of Flickr8k **dev** (one pair per photo, its first caption
unless changed; 15% of the untouched photos get random swaps as ordinary noise), in which a
short caption is pasted over look-alike photos (image embeddings of pairclean-lite):

- ``c1-count``: "Two dogs", "Three dogs", "Two men", "Two girls", "Two boys" on a photo they are
  right for (the source) and on its 12 most alike photos of one dog / man / girl / boy; "A dog"
  on photos of two dogs;
- ``c2-colour``: "A black/white/brown dog", "A man in red", "A girl in pink" on a source and
  12 look-alikes whose captions never name that colour;
- ``c3-short``: a photo's own caption cut after its first noun ("Three dogs") on its 12 most
  alike photos, each labelled by whether its five captions support it;
- ``c4-many``: five wrong short captions on 25 look-alikes each, no source in the corpus;
- ``c5-many-src``: four of them on a source and 30 wrong look-alikes each;
- ``c6-count2``: more count groups from other sources.

Labels (``truth.json``, ``role``): clean (own first caption), wrong (changed, wrong for the photo
by its five human captions), right (changed, supported by them), swap; ``group`` names the
pasted caption. Rules over the captions' words decide, so a few labels are debatable ("A dog"
on a photo of two dogs). A helper built these to attack the corpus contrast's shared-caption
rule (``pairclean.calibrate.contrast``, "Shared captions"; ``docs/hard_noise.md``):

    python benchmarks/shared_captions.py build
    python benchmarks/shared_captions.py score --cli before=/old/venv/bin/pairclean --cli now=.venv/bin/pairclean
    python benchmarks/shared_captions.py report --cli before=... --cli now=...

``score`` runs ``pairclean score --executor local`` of each named executable on each corpus
(one at a time; default: ``now``, the one beside this Python); ``report`` prints per corpus the
AUC of ``p_clean``, the wrong pairs above 0.9 (a wrong caption called clean with confidence),
the right changed pairs below 0.3, the ``noisy`` flag's recall on the wrong ones, random swaps
above 0.9 and the untouched clean pairs' mean, one column per executable.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from _common import flickr_root

from pairclean.calibrate.calibration import cache_dir as _default_cache

#: Set by ``main``: where the corpora and the score folders go, and the executables by name.
WORK: list[Path] = []
CLIS: dict[str, str] = {}
SWAP_SHARE = 0.15
SEED = 7

COLOURS = {"black", "white", "brown", "tan", "golden", "yellow", "red", "blue", "green", "pink", "orange", "purple",
           "gray", "grey", "spotted", "blond", "blonde"}
NOUNS = {  # lemma -> (singular forms, plural forms)
    "dog": ({"dog", "puppy", "pup"}, {"dogs", "puppies", "pups"}),
    "man": ({"man", "guy"}, {"men", "guys"}),
    "girl": ({"girl"}, {"girls"}),
    "boy": ({"boy"}, {"boys"}),
    "woman": ({"woman", "lady"}, {"women", "ladies"}),
}
MULTI = {"two", "three", "four", "five", "several", "group", "pair", "couple", "both", "many", "crowd", "another", "other",
         "others", "team", "people", "each"}
WATER = {"water", "swim", "swims", "swimming", "pool", "lake", "river", "beach", "ocean", "wave", "waves", "sea", "stream",
         "creek", "pond", "splash", "splashes", "splashing", "wet", "surf", "shore", "puddle", "wading", "wades"}


def toks(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def capsets(img) -> list[set[str]]:
    return [set(toks(c)) for c in img.captions]


def mentions(img, words: set[str], least: int = 1) -> bool:
    return sum(bool(s & words) for s in capsets(img)) >= least


def never(img, words: set[str]) -> bool:
    return not mentions(img, words)


def single(img, noun: str) -> bool:
    """>= 3 captions name one NOUN, none names it in the plural or any count / group word."""
    sing, plur = NOUNS[noun]
    return mentions(img, sing, 3) and never(img, plur | MULTI)


def plural(img, noun: str, least: int = 2) -> bool:
    sing, plur = NOUNS[noun]
    return mentions(img, plur, least)


def colour_dog(img, colour: str) -> bool:
    """Some caption says '<colour> dog' (colour word right before a dog word, allowing 'and white')."""
    for c in img.captions:
        t = toks(c)
        for i, w in enumerate(t):
            if w in NOUNS["dog"][0] | NOUNS["dog"][1] and colour in t[max(0, i - 3):i]:
                return True
    return False


def dog(img: Any) -> bool:
    """At least three captions name a dog."""
    return mentions(img, NOUNS["dog"][0] | NOUNS["dog"][1], 3)


def man_only(img: Any) -> bool:
    """A man, and no woman, girl, child or group in any caption."""
    return mentions(img, NOUNS["man"][0], 3) and never(img, NOUNS["woman"][0] | NOUNS["woman"][1] | {
        "girl", "girls", "people", "couple", "mother", "her", "she", "person", "child", "children"})


def boy_only(img: Any) -> bool:
    """A boy, and no girl, woman, child or group in any caption."""
    return mentions(img, {"boy", "boys"}, 3) and never(img, {
        "girl", "girls", "woman", "women", "lady", "she", "her", "child", "kid", "children", "kids", "people", "person"})


def one_person(img: Any) -> bool:
    """One person: four captions name one, none a count, a group or a second person."""
    return mentions(img, {"man", "woman", "boy", "girl", "person", "child", "guy", "lady", "kid"}, 4) and never(
        img, MULTI | {"men", "women", "boys", "girls", "children", "kids", "and"})


def load() -> tuple[Any, dict[str, np.ndarray]]:
    from _embed_dev import embed_dev
    from pairclean.lite.evaldata import load_flickr8k

    images = load_flickr8k(flickr_root(), "dev")
    emb = embed_dev(_default_cache() / "hard_noise" / "dev_lite.npz")  # the hard-noise benchmark's cache
    return images, emb


class Corpus:
    def __init__(self, images, emb, name):
        self.images, self.emb, self.name = images, emb, name
        self.captions = [img.captions[0] for img in images]
        self.role = ["clean"] * len(images)
        self.group = [""] * len(images)
        self.used: set[int] = set()

    def alike(self, src: int) -> np.ndarray:
        return np.argsort(-(self.emb["img"] @ self.emb["img"][src]))

    def paste(self, caption: str, group: str, src: int | None, ok, copies: int, anchor: int | None = None) -> int:
        """caption on SRC (right) and on the COPIES photos most alike SRC (or ANCHOR) that satisfy OK (wrong)."""
        if src is not None:
            self.captions[src], self.role[src], self.group[src] = caption, "right", group
            self.used.add(src)
        centre = src if src is not None else anchor
        done = 0
        for j in (int(x) for x in self.alike(centre)):
            if done >= copies:
                break
            if j in self.used or j == src or not ok(self.images[j]):
                continue
            self.captions[j], self.role[j], self.group[j] = caption, "wrong", group
            self.used.add(j)
            done += 1
        if done < copies:
            print(f"# {self.name}/{group}: only {done} of {copies} copies", file=sys.stderr)
        return done

    def paste_labelled(self, caption: str, group: str, src: int, copies: int, supports) -> None:
        """caption on SRC and its COPIES most alike photos (no filter), each labelled by SUPPORTS(img)."""
        self.captions[src], self.role[src], self.group[src] = caption, "right", group
        self.used.add(src)
        done = 0
        for j in (int(x) for x in self.alike(src)):
            if done >= copies:
                break
            if j in self.used:
                continue
            self.captions[j], self.group[j] = caption, group
            self.role[j] = "right" if supports(self.images[j]) else "wrong"
            self.used.add(j)
            done += 1

    def swaps(self, rng) -> None:
        rest = [i for i in range(len(self.images)) if i not in self.used]
        idx = rng.choice(rest, size=int(round(SWAP_SHARE * len(rest))), replace=False)
        orig = list(self.captions)
        for dst, src in zip(idx, np.roll(idx, 1)):
            self.captions[dst], self.role[dst], self.group[dst] = orig[src], "swap", "swap"

    def pick_source(self, ok, rng) -> int:
        cands = [i for i, img in enumerate(self.images) if i not in self.used and ok(img)]
        if not cands:
            raise SystemExit(f"{self.name}: no source")
        # the source with the most qualifying look-alikes among its 40 nearest: a dense cluster
        return max(cands, key=lambda i: (sum(1 for j in self.alike(i)[1:41]), int(rng.integers(1 << 30))))

    def write(self) -> list[str]:
        from hard_noise import write_shards

        noisy = np.array([r in ("wrong", "swap") for r in self.role])
        folder = WORK[0] / "corpora" / self.name
        shards = write_shards(folder, self.images, self.captions, noisy, list(self.group))
        doc = json.loads((folder / "labels.json").read_text())
        doc["role"], doc["group"] = self.role, self.group
        (folder / "truth.json").write_text(json.dumps(doc))
        return shards


def src_with(c: Corpus, ok, density_ok, rng, skip: int = 0) -> int:
    """A source photo satisfying OK whose 40 nearest photos hold the most satisfying DENSITY_OK
    (SKIP: take the (SKIP+1)-th best instead)."""
    cands = [i for i, img in enumerate(c.images) if i not in c.used and ok(img)]
    score = {i: sum(1 for j in c.alike(i)[1:41] if int(j) not in c.used and density_ok(c.images[int(j)])) for i in cands}
    return sorted(cands, key=lambda i: (-score[i], i))[min(skip, len(cands) - 1)]


def _pasted_groups(c: Corpus, groups: list[tuple[str, Any, Any]], rng: np.random.Generator, copies: int) -> Corpus:
    """Each (caption, right-for, wrong-for) of ``groups`` on a source it is right for and its
    ``copies`` most alike photos it is wrong for; then the random swaps."""
    for cap, ok_src, ok_copy in groups:
        src = src_with(c, ok_src, ok_copy, rng)
        c.paste(cap, cap, src, ok_copy, copies)
    c.swaps(rng)
    return c


def build_count(images, emb) -> Corpus:
    c = Corpus(images, emb, "c1-count")
    rng = np.random.default_rng([SEED, 1])
    groups = [  # (caption, source condition: right, copy condition: wrong)
        ("Two dogs", lambda im: mentions(im, {"two"}, 2) and plural(im, "dog", 2), lambda im: single(im, "dog")),
        ("Three dogs", lambda im: mentions(im, {"three"}, 2) and plural(im, "dog", 2), lambda im: single(im, "dog")),
        ("Two men", lambda im: mentions(im, {"two"}, 2) and plural(im, "man", 2), lambda im: single(im, "man")),
        ("Two girls", lambda im: mentions(im, {"two"}, 2) and plural(im, "girl", 2), lambda im: single(im, "girl")),
        ("Two boys", lambda im: mentions(im, {"two"}, 2) and plural(im, "boy", 2), lambda im: single(im, "boy")),
        # debatable: "a dog" on a photo of two dogs (a dog is there; the count is wrong)
        ("A dog", lambda im: single(im, "dog"), lambda im: mentions(im, {"two"}, 3) and plural(im, "dog", 3)),
    ]
    return _pasted_groups(c, groups, rng, 12)


def build_colour(images, emb) -> Corpus:
    c = Corpus(images, emb, "c2-colour")
    rng = np.random.default_rng([SEED, 2])
    groups = [
        ("A black dog", lambda im: colour_dog(im, "black") and mentions(im, {"black"}, 3),
         lambda im: dog(im) and never(im, {"black"}) and (colour_dog(im, "brown") or colour_dog(im, "white") or colour_dog(im, "tan") or colour_dog(im, "golden"))),
        ("A white dog", lambda im: colour_dog(im, "white") and mentions(im, {"white"}, 3),
         lambda im: dog(im) and never(im, {"white"}) and (colour_dog(im, "brown") or colour_dog(im, "black"))),
        ("A brown dog", lambda im: colour_dog(im, "brown") and mentions(im, {"brown"}, 3),
         lambda im: dog(im) and never(im, {"brown", "tan", "golden"}) and (colour_dog(im, "black") or colour_dog(im, "white"))),
        ("A man in red", lambda im: mentions(im, {"man"}, 3) and mentions(im, {"red"}, 3),
         lambda im: mentions(im, {"man"}, 3) and never(im, {"red"}) and mentions(im, COLOURS - {"red"}, 2)),
        ("A girl in pink", lambda im: mentions(im, {"girl"}, 3) and mentions(im, {"pink"}, 3),
         lambda im: mentions(im, {"girl"}, 3) and never(im, {"pink"}) and mentions(im, COLOURS - {"pink"}, 2)),
    ]
    return _pasted_groups(c, groups, rng, 12)


def build_short(images, emb) -> Corpus:
    from hard_noise import _head_noun, _said_less
    from pairclean.read.words import content_word_count

    c = Corpus(images, emb, "c3-short")
    rng = np.random.default_rng([SEED, 3])
    able = [i for i, img in enumerate(images) if _head_noun(img.captions[0]) is not None
            and content_word_count(_said_less(img.captions[0], "short")) <= 2]
    want = 8
    for i in rng.permutation(able):
        if want == 0:
            break
        i = int(i)
        if i in c.used:
            continue
        short = _said_less(images[i].captions[0], "short")
        words = [w for w in toks(short) if w not in {"a", "an", "the"}]
        noun = words[-1]
        lemma = _head_noun(short)[1]
        forms = {noun, lemma, lemma + "s", lemma + "es"} | ({"men"} if lemma == "man" else set()) | ({"women"} if lemma == "woman" else set()) \
            | ({"children", "child", "kid", "kids"} if lemma in ("child", "kid") else set())
        adjs = set(words[:-1])

        def supports(im, forms=forms, adjs=adjs):
            # right: some caption names the noun, and every other word of the short caption appears in some caption
            return mentions(im, forms) and all(mentions(im, {a}) for a in adjs)

        c.paste_labelled(short, short, i, 12, supports)
        want -= 1
    c.swaps(rng)
    return c


def build_many(images, emb) -> Corpus:
    c = Corpus(images, emb, "c4-many")
    rng = np.random.default_rng([SEED, 4])
    groups = [  # no right source in the corpus: the caption is wrong on every photo that carries it
        ("Two dogs", lambda im: single(im, "dog"), 25),
        ("A black dog", lambda im: dog(im) and never(im, {"black"}) and (colour_dog(im, "brown") or colour_dog(im, "white") or colour_dog(im, "tan") or colour_dog(im, "golden")), 25),
        ("A girl", boy_only, 25),
        ("A woman", man_only, 25),
        ("A dog swimming", lambda im: dog(im) and never(im, WATER), 25),
    ]
    for cap, ok, copies in groups:
        anchor = src_with(c, ok, ok, rng)
        c.paste(cap, cap, None, ok, copies, anchor=anchor)
    c.swaps(rng)
    return c


def build_many_src(images, emb) -> Corpus:
    """As c4-many but each caption also on one photo it is right for (its source): 30 wrong copies each."""
    c = Corpus(images, emb, "c5-many-src")
    rng = np.random.default_rng([SEED, 5])
    groups = [
        ("Two dogs", lambda im: mentions(im, {"two"}, 2) and plural(im, "dog", 2), lambda im: single(im, "dog")),
        ("A black dog", lambda im: colour_dog(im, "black") and mentions(im, {"black"}, 3),
         lambda im: dog(im) and never(im, {"black"}) and (colour_dog(im, "brown") or colour_dog(im, "white") or colour_dog(im, "tan") or colour_dog(im, "golden"))),
        ("A woman", lambda im: mentions(im, NOUNS["woman"][0], 3) and never(im, NOUNS["man"][0] | NOUNS["man"][1]), man_only),
        ("A dog swimming", lambda im: dog(im) and mentions(im, {"swims", "swimming", "swim"}, 3), lambda im: dog(im) and never(im, WATER)),
    ]
    return _pasted_groups(c, groups, rng, 30)


def build_count2(images, emb) -> Corpus:
    """More count groups (other sources than c1's) to see how often the count attack lands."""
    c = Corpus(images, emb, "c6-count2")
    rng = np.random.default_rng([SEED, 6])
    groups = [  # (caption, source: right, copies: wrong, which-best source)
        ("Two men", lambda im: mentions(im, {"two"}, 2) and plural(im, "man", 2), lambda im: single(im, "man"), 1),
        ("Three men", lambda im: mentions(im, {"three"}, 2) and plural(im, "man", 2), lambda im: single(im, "man"), 0),
        ("Two women", lambda im: mentions(im, {"two"}, 2) and plural(im, "woman", 2), lambda im: single(im, "woman"), 0),
        ("Two people", lambda im: mentions(im, {"two"}, 2) and mentions(im, {"people"}, 2), one_person, 0),
        ("Two children", lambda im: mentions(im, {"two"}, 2) and mentions(im, {"children", "kids"}, 2), one_person, 0),
        ("Two dogs", lambda im: mentions(im, {"two"}, 2) and plural(im, "dog", 2), lambda im: single(im, "dog"), 1),
        ("Two dogs", lambda im: mentions(im, {"two"}, 2) and plural(im, "dog", 2), lambda im: single(im, "dog"), 5),
    ]
    for k, (cap, ok_src, ok_copy, skip) in enumerate(groups):
        src = src_with(c, ok_src, ok_copy, rng, skip)
        c.paste(cap, f"{cap} #{k}", src, ok_copy, 12)
    c.swaps(rng)
    return c


BUILDERS = {"c1-count": build_count, "c2-colour": build_colour, "c3-short": build_short, "c4-many": build_many,
            "c5-many-src": build_many_src, "c6-count2": build_count2}


def cmd_score(names: list[str]) -> None:
    for name in names:
        shards = sorted(str(p) for p in (WORK[0] / "corpora" / name).glob("part-*.tar"))
        if not shards:
            raise SystemExit(f"no corpus {name!r} under {WORK[0] / 'corpora'}: run build first")
        for which, cli in CLIS.items():
            out = WORK[0] / "runs" / f"{name}-{which}"
            for p in (out, out.parent / f"{out.name}.pairclean"):
                if p.exists():
                    subprocess.run(["rm", "-rf", str(p)], check=True)
            cmd = [cli, "score", *shards, "--out", str(out), "--executor", "local", "--threads", "2", "--no-progress"]
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            print(name, which, f"rc={proc.returncode}", f"{time.time() - t0:.0f}s", flush=True)
            if proc.returncode:
                raise SystemExit(proc.stderr[-2000:])


def _mean(values: np.ndarray) -> float:
    return float(np.mean(values)) if np.size(values) else float("nan")


def metrics(name: str, which: str) -> dict[str, Any]:
    """One score folder's figures against the corpus's roles."""
    import pandas as pd
    from sklearn.metrics import roc_auc_score

    truth = json.loads((WORK[0] / "corpora" / name / "truth.json").read_text())
    df = pd.read_parquet(WORK[0] / "runs" / f"{name}-{which}")
    df = df[df["status"] == "ok"].set_index("key")
    role = pd.Series(truth["role"], index=truth["keys"]).reindex(df.index).to_numpy()
    p = df["p_clean"].to_numpy(float)
    flag = df["noisy"].to_numpy(bool)
    wrong, right, swap, clean = role == "wrong", role == "right", role == "swap", role == "clean"
    return {
        "auc": float(roc_auc_score(~(wrong | swap), p)), "wrong": int(wrong.sum()), "right": int(right.sum()),
        "wrong above 0.9": int((p[wrong] > 0.9).sum()), "wrong mean": _mean(p[wrong]), "right mean": _mean(p[right]),
        "right below 0.3": int((p[right] < 0.3).sum()), "noisy recall on wrong": _mean(flag[wrong]),
        "swaps above 0.9": _mean(p[swap] > 0.9), "untouched clean mean": _mean(p[clean]),
    }


def cmd_report(names: list[str]) -> None:
    for name in names:
        rows = {which: metrics(name, which) for which in CLIS}
        first = next(iter(rows.values()))
        print(f"\n### {name} ({first['wrong']} wrong changed pairs, {first['right']} right)\n")
        print("| figure | " + " | ".join(rows) + " |")
        print("|---|" + "---|" * len(rows))
        for key in first:
            if key in ("wrong", "right"):
                continue
            cells = [f"{r[key]:.3f}" if isinstance(r[key], float) else str(r[key]) for r in rows.values()]
            print(f"| {key} | " + " | ".join(cells) + " |")


def cmd_build(names: list[str]) -> None:
    images, emb = load()
    for name in names:
        c = BUILDERS[name](images, emb)
        c.write()
        roles = {r: c.role.count(r) for r in ("clean", "wrong", "right", "swap")}
        print(name, roles)
        for g in dict.fromkeys(x for x in c.group if x and x != "swap"):
            idx = [i for i, x in enumerate(c.group) if x == g]
            print(f"   {g!r}: wrong {sum(c.role[i] == 'wrong' for i in idx)} right {sum(c.role[i] == 'right' for i in idx)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["build", "score", "report"])
    ap.add_argument("names", nargs="*", default=None, help=f"corpora (default: all of {', '.join(BUILDERS)})")
    ap.add_argument("--work", default=str(_default_cache() / "shared_captions"), help="where corpora and score folders go")
    ap.add_argument("--cli", action="append", default=[], metavar="NAME=EXE",
                    help="a pairclean executable to score with (repeat; default now=the one beside this Python)")
    args = ap.parse_args()
    WORK.append(Path(args.work))
    for item in args.cli or [f"now={Path(sys.executable).parent / 'pairclean'}"]:
        name, _, exe = item.partition("=")
        if not exe:
            raise SystemExit(f"--cli {item!r}: write NAME=EXE")
        CLIS[name] = exe
    names = args.names or list(BUILDERS)
    {"build": cmd_build, "score": cmd_score, "report": cmd_report}[args.what](names)


if __name__ == "__main__":
    main()
