"""Corpus contrast: how much better a pair fits than the corpus's other pairs would.

A caption written for a similar-looking image (another dog on another lawn) scores almost
as high against the image as the right caption does; what gives it away is that it fits
some other image of the corpus at least as well. Recipe ``bank-contrast`` (version
``VERSION``), pure functions over arrays:

- *The bank*: the image and caption embeddings of the job's calibration sample (its first
  ``BANK_SIZE`` ok pairs in shard order, float16-rounded as the sidecar stores them), so a
  resumed job, every worker and ``pairclean rescore`` use the same bank.
- *Two rivals* of a pair (image i, caption c), each the mean of the ``K`` largest cosines:
  the caption's with bank images (does c fit other images as well?) and the image's with
  bank captions (do other captions fit i as well?). Left out: bank rows of the pair's own
  image or a copy of it (cosine >= ``SAME_IMAGE_COSINE``) and bank captions that are
  copies of c.
- *The adjusted similarity*: ``s - CAPTION_GAMMA * (caption rival - its mean) -
  IMAGE_GAMMA * (image rival - its mean)``, the means over the calibration sample, so the
  adjusted similarity keeps the similarity's scale (beta and the weightings read it as they
  read the similarity).

Calibration (beta, weighting, the ``p_clean`` curve) is fitted on the adjusted
similarity, and the noise references are scored the same way with the caption's own pair
left out of the bank as well: real noise's source image is often not in the bank. The
``similarity`` column stays the plain cosine; ``adjusted_similarity`` is written beside it.

Why both rivals, measured on Flickr8k dev with pairclean-lite (one pair per image, the
bank = the 1,000 dev pairs; clean first captions against each noise kind; AUC of the
cosine -> caption rival alone (weight 1) -> both (weights 0.5, version 1)): the caption of
the most alike other image 0.632 -> 0.695 -> 0.685; the most alike other caption 0.606 ->
0.687 (weight 1 both) -> 0.659; random swaps 0.974 -> 0.976 -> 0.980; one-word edits
(mean of five kinds) 0.595 -> 0.565 -> 0.589. The caption rival alone lowers edits: an
edited caption fits every image less, so its rival drops and makes up for part of its
lower cosine; the image rival does not depend on the caption and lifts edits (0.608
alone), so the two balance.

Why the weights of version 2 (caption 1.0, image 0.75; version 1 had 0.5 for both): since
the judge reads the words (``pairclean.judge``), edits are ranked by its factor, not by the
adjusted similarity, so the caption rival can take its full weight. Measured end to end
(``benchmarks/hard_noise.py --rescore-from TAG``: the same scored folders recalibrated,
judge on, AUC of ``p_clean`` at 20% / 50% noise, version 1 -> 2): the caption of the most
alike image 0.685 -> 0.718 and 0.649 -> 0.700; the most alike caption 0.633 -> 0.656 and
0.619 -> 0.647; the retrieved-candidates corpus 0.647 -> 0.693; one-word edits 0.824 ->
0.825 and 0.830 -> 0.830; the mix 0.767 -> 0.773 and 0.775 -> 0.784 (ECE 0.086 -> 0.073,
0.161 -> 0.147); random swaps 0.971 -> 0.970 and 0.983 -> 0.980 (ECE 0.043 -> 0.032,
0.049 -> 0.051). Also measured there: caption 0.75 took half the gain; caption 1.25-1.5
added +0.01 on near-misses but cost random swaps up to 0.010 AUC; image 0.5 or 1.0 and
``K`` 1 or 4 moved nothing by more than 0.01. Jobs calibrated under version 1 keep its
weights (``from_json``).

Version 3 adds *the caption's owner* (``owner_margin``, ``owner_p_clean``): a pair of
another image, in the bank or in the pair's own shard, whose caption says the same thing
(caption cosine >= ``OWNER_COSINE``) and whose image fits this pair's caption better than
this pair's own image does. A near-miss is a caption written for a similar image; where
that image is in the bank or the shard with the caption or a paraphrase of it, the caption
has a better owner. Such a pair's odds of being clean
are multiplied by ``OWNER_ODDS``, the ratio of how often a clean pair shows an owner to how
often a near-miss does (Flickr8k dev with pairclean-lite, one pair per photo, the bank =
the corpus: 0.02 of clean pairs, 0.14-0.68 of near-misses by kind, so about 0.1); pairs
without one keep their ``p_clean`` (never more confident). The margin (how much better the
owner's image fits, NaN where there is no owner) is written as ``owner_margin``. Measured
end to end (``benchmarks/hard_noise.py``, AUC of ``p_clean`` at 20% / 50%, version 2 -> 3):
``docs/hard_noise.md``. Owners are searched in the bank (the first ``BANK_SIZE`` calibration
pairs) and in the pair's own shard (its first ``OWNER_SHARD_ROWS`` ok pairs), so in a
corpus much larger than both most near-misses' source images are in neither and the factor seldom applies; it never makes ``p_clean`` more
confident, so where it does not apply the pair is scored as under version 2. The 0.85 was
measured in pairclean-lite's caption space; other estimators count copies only
(``owner_cosine_for``).

Version 4 bounds the rivals' lift (``caption_floor``, ``image_floor``): a rival below its
mean raises the adjusted similarity, and a caption that fits no image at all (web
boilerplate: "IMG_2031.JPG", "click here to enlarge", a product code) has a caption rival far
below it, as a placeholder image ("image not available", a blank served for a failed
download) has an image rival far below it, so version 3 lifted such pairs from a cosine
near 0 towards the clean pairs' median ("fits this image better than it fits others", when
it fits none). Now a rival deviation below its floor (``FLOOR_Z`` robust standard
deviations below the sample's centre, both read from the sample's upper quantiles, which
pairs carrying such captions or images move less than they move a median or a spread over
the whole sample) lifts the pair only as far as the pair beats that rival: a specific
caption that fits its own image keeps its lift, one that fits this image no better than it
fits others gets none. Measured on Flickr8k dev with pairclean-lite (one pair per photo,
three draws a corpus; AUC of the adjusted similarity, version 3 -> 4 with the caption gate
alone): captions replaced by boilerplate 0.881 -> 0.961 (20%) and 0.880 -> 0.914 (50%; the
cosine alone 0.990); random swaps 0.977 -> 0.977 and 0.978 -> 0.978; nearest-image captions
0.720 -> 0.719 and 0.724 -> 0.721; nearest-text captions 0.715 -> 0.712 and 0.692 -> 0.691.
The image gate then: placeholder images (solid colours, text on grey, noise, ramps) 0.941
-> 0.954 at 20%, near-misses -0.001. Tried and not taken: a plain floor (a lift of at most
the floor: boilerplate 0.921 / 0.888), the gate on every pair (boilerplate 0.981 / 0.966,
placeholders 0.981 / 0.973, but near-misses -0.01 to -0.04), the gate on every pair whose
similarity is below ``owner_min_fit`` (end to end: placeholders at 50% ECE 0.360 -> 0.048,
random swaps' noisy mean 0.175 -> 0.124, but nearest-image AUC -0.012 and nearest-text
-0.02, with the clean pairs' 1% point read from a normal fitted to the top 40%), and a cap
on the whole lift (0.15: boilerplate 0.943 / 0.910, near-misses -0.003 to -0.005).

On a junk-heavy corpus (half its pairs placeholders or boilerplate) those floors, read
from the upper quantiles, no longer describe the clean pairs, and ``p_clean``'s mixture
widened its clean part over the junk. ``calibration.calibrate`` recognises such a corpus
(more pairs at random level than the fitted random share explains,
``p_clean.unexplained_random``) and fits once more with ``random_fit`` set: every rival of a
pair whose similarity is below the ``RANDOM_FIT_QUANTILE`` point of the sample's mismatched
pairs is gated too. Only there: on every corpus, that gate cost near-misses' calibration
(``docs/hard_noise.md``).

Version 4 also bounds owners from below (``owner_min_fit``, ``plausible_fit``): boilerplate
repeats ("untitled" on eight photos), and under version 3 each copy found an "owner" in the
photo the string fits least badly, so the copies counted as near-miss captions and the
owners' odds factor fell on them. End to end: ``docs/hard_noise.md``, the ``boilerplate`` and
``placeholder`` kinds of ``benchmarks/hard_noise.py``.

*Shared captions* (``repeat_carriers``, ``repeat_max_words`` and ``shared_p_clean``, recorded
in the contrast; contrasts recorded before them have none): a short caption (at most
``SHARED_CAPTION_WORDS`` content words, ``pairclean.read.words.content_word_count``, counted
when the pair was embedded and kept in its sidecar) that ``REPEAT_CARRIERS`` or more other
photos carry too (in the bank, or in the pair's shard), each fitting it better than most
mismatched pairs fit theirs (``repeat_min_fit``: the larger of ``owner_min_fit`` and
``random_fit``; boilerplate such as "untitled" fits its photos at random level and keeps the
owner rule), is a caption many photos share. Whether it is right for this photo the corpus
cannot say: a generic alt-text ("a dog" on dog photos) and a wrong short caption repeated
over look-alikes ("Two men" on photos of one man) look alike here. Under the owner rule the first were called
noisy with confidence (each copy had an "owner" in whichever photo fits it best); exempted
from it, the second were called clean with confidence (Flickr8k dev corpora:
``docs/hard_noise.md``, "Shared captions"). So such a pair has no owner, and its ``p_clean``
is at most ``SHARED_P_CLEAN`` (``owner_margin`` is -inf, the mark ``owner_p_clean`` reads):
neither confident answer. Its copies still count towards the near-miss share
(``copied_caption_share``). A caption that says more keeps its owner however many photos
carry it (one photo's caption pasted onto a dozen look-alikes, the hard-noise kind
``pasted``). Pairs whose count is unknown (a sidecar written before it) are never short.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from pairclean.calibrate.p_clean import DUPLICATE_COSINE

__all__ = ["RECIPE", "VERSION", "K", "CAPTION_GAMMA", "IMAGE_GAMMA", "BANK_SIZE", "SAME_IMAGE_COSINE", "MIN_BANK", "Contrast", "fit_contrast",
           "copied_caption_share", "bank_sha256", "from_json", "rival_weights", "OWNER_COSINE", "OWNER_ODDS", "owner_p_clean",
           "table_columns", "owner_cosine_for", "OWNER_MODEL", "OWNER_SHARD_ROWS", "has_owner", "FLOOR_Z", "deviation_floor",
           "OWNER_FIT_QUANTILE", "plausible_fit", "IMAGE_COPY_COSINE_LITE", "image_copy_cosine_for",
           "RANDOM_FIT_QUANTILE", "random_fit", "REPEAT_CARRIERS", "SHARED_CAPTION_WORDS",
           "SHARED_P_CLEAN", "is_shared"]

RECIPE: Final = "bank-contrast"
VERSION: Final = 4
#: Versions ``from_json`` reads (1: one weight, ``gamma``, for both rivals; 1-2: no owner;
#: 1-3: no gate on the rivals' lift and no least fit for an owner).
_READS: Final = (1, 2, 3, 4)
#: A rival is the mean of this many best bank rows.
K: Final = 2
#: How much of the caption rival (does the caption fit other images as well?) is taken off.
CAPTION_GAMMA: Final = 1.0
#: How much of the image rival (do other captions fit the image as well?) is taken off.
IMAGE_GAMMA: Final = 0.75
#: Bank rows at most (2 x 4,096 x 512 float16 = 8 MiB; one pair costs 4 x 4,096 dot products).
BANK_SIZE: Final = 4096
#: A bank image (caption) at least this alike the pair's own is that image (or a copy):
#: the same threshold as the p_clean references' copies.
SAME_IMAGE_COSINE: Final = DUPLICATE_COSINE
#: In pairclean-lite's image space (its shipped heads), an image at least this alike the
#: pair's own is a copy of it: measured on Flickr8k dev, the same photo re-encoded as JPEG at
#: quality 90 lies at a median 0.972 of the original (1st percentile 0.934 over 120 photos; the
#: least of another 150 at 0.885, 5% of them below 0.934), at quality 75 at a median 0.942,
#: while the most alike *other* dev photo lies at most at 0.90 (median 0.59): 0.92 takes
#: nearly every re-encoded copy for the photo and no other photo. At ``SAME_IMAGE_COSINE`` (0.98) most re-encoded copies were
#: other images: a clean corpus holding each photo twice, once re-encoded, with its caption,
#: had 52% of its pairs flagged noisy (each copy a "better owner" of the other's caption, the
#: copied captions a floor on the near-miss share). Recorded in the contrast
#: (``image_copy_cosine``); contrasts recorded before it keep ``SAME_IMAGE_COSINE``.
IMAGE_COPY_COSINE_LITE: Final = 0.92
#: Fewer bank images than this and no contrast is applied (a tiny job).
MIN_BANK: Final = 16
#: A caption (of the bank or the shard) at least this alike a pair's caption says the same
#: thing (version 3; pairclean-lite's caption space, ``owner_cosine_for``).
#: Measured on Flickr8k dev (hard-noise corpora, version 2 -> 3 offline): 0.8 caught more
#: paraphrased near-misses (+0.01-0.02 AUC) but cost one-word edits 0.012 and random swaps
#: 0.003 more than 0.85; 0.75 cost edits 0.03.
OWNER_COSINE: Final = 0.85
#: Odds of being clean kept by a pair whose caption has a better owner (version 3).
OWNER_ODDS: Final = 0.1
#: A rival's deviation (caption or image) more than this many robust standard deviations
#: below the sample's centre lifts a pair only as far as the pair beats that rival (version 4).
FLOOR_Z: Final = 2.0
#: Fewer calibration pairs than this and no version-4 bounds are fitted (the contrast is
#: then version 3's): from the upper quantiles of 16-64 clean pairs the floor gated 4-15% of
#: them (up to 37% in one draw) instead of about 2%.
MIN_GATE_PAIRS: Final = 256
#: On a junk-heavy corpus (``calibration.calibrate``), a pair whose similarity is below this
#: quantile of the sample's mismatched pairs' gets no lift from either rival beyond how much
#: it beats that rival (version 4, ``random_fit``).
RANDOM_FIT_QUANTILE: Final = 0.75
#: Mismatched pairs of the sample ``random_fit`` is read from (seeded, so a rescore reads the same).
RANDOM_FIT_PAIRS: Final = 4096
#: An owner (or a copy's better-fitting pair) counts only where its fit reaches this quantile
#: of the calibration sample's clean-looking similarities (version 4, ``plausible_fit``).
OWNER_FIT_QUANTILE: Final = 0.01
#: The estimator whose caption space ``OWNER_COSINE`` was measured in (with its shipped heads).
OWNER_MODEL: Final = "pairclean-lite"
#: A shard's first this many ok pairs are searched for owners (besides the bank), so a pair
#: costs at most this many caption products however large its shard (WebDataset shards
#: usually hold up to 10,000 pairs).
OWNER_SHARD_ROWS: Final = 16384
#: A short caption this many other photos carry too (bank or shard, image cosine below the
#: copy threshold, caption cosine >= ``owner_cosine``) is a shared one: no owner, ``p_clean`` at
#: most ``SHARED_P_CLEAN``. Only carriers whose photo fits the caption at least
#: ``Contrast.carrier_fit`` count (version 4), so boilerplate pasted over photos it fits at
#: random level keeps its owners. Measured (for every caption, before the word limit) on the hard-noise
#: benchmark's corpora (Flickr8k dev, pairclean-lite): 10 or more other carriers held 0.8-1.7%
#: of the pairs of ``retrieved`` (every photo with its own, its nearest image's and its nearest
#: text's caption, where look-alike "hub" photos lend their caption to several others) and
#: none of the other near-miss corpora, but 60-73% of the ``generic`` captions ("a dog") and
#: 34-54% of the ``short`` ones. At 4 the rule also took 35% of ``retrieved``'s nearest-image
#: captions (AUC 0.745 -> 0.693); counting every carrier, boilerplate at 20% lost its owners
#: (AUC 0.982 -> 0.975).
REPEAT_CARRIERS: Final = 10
#: Only a caption of at most this many content words can be a shared caption: 0.8% of
#: Flickr8k dev's first captions have 2 or fewer; a pasted caption of one photo that says
#: more keeps its owner (module docstring). At 3 (4.4% of them), a source captioned "The
#: children are playing in the water" lost the owner of its 12 pasted copies (hard-noise
#: ``pasted`` at 20%: AUC 0.948 -> 0.933, 0.5% of the copies above 0.9).
SHARED_CAPTION_WORDS: Final = 2
#: A shared caption's ``p_clean`` is at most this: the corpus cannot tell a right one from a
#: wrong one (module docstring). Near the middle, and above the 0.5 at which ``noisy`` flags
#: a judged pair, so the cap flags nothing (``noisy`` still says what the similarity and the
#: judge say) and the table's ``noisy_rule`` holds for every row.
SHARED_P_CLEAN: Final = 0.6

FloatArray = NDArray[np.float32]
#: Rows of pairs scored at a time (memory: 4 x BLOCK x BANK_SIZE float32 = 64 MiB).
_BLOCK = 1024


def _f16(x: NDArray[Any]) -> FloatArray:
    """Rounded as the sidecar stores embeddings, so a rescore reproduces a fresh score."""
    return np.asarray(x, dtype=np.float16).astype(np.float32)


def bank_sha256(bank: NDArray[Any]) -> str:
    """Checksum of a bank's float16 bytes (recorded in the calibration)."""
    return hashlib.sha256(np.ascontiguousarray(bank, dtype=np.float16).tobytes()).hexdigest()


@dataclass(frozen=True)
class Contrast:
    """A frozen bank and its parameters: ``adjust`` maps similarities to adjusted ones.

    ``bank``: (2, B, D) the calibration sample's image embeddings and their captions'.
    ``caption_floor``, ``image_floor``: each rival's deviation below which its lift is gated
    (version 4; None: no gate, versions 1-3). ``owner_min_fit``: an owner must fit the caption at
    least this well (version 4, ``plausible_fit``; None: any owner, versions 1-3)."""

    bank: FloatArray
    mean_caption_rival: float
    mean_image_rival: float
    k: int = K
    caption_gamma: float = CAPTION_GAMMA
    image_gamma: float = IMAGE_GAMMA
    #: Version 3's owner search (None: a version 1-2 contrast, which has none).
    owner_cosine: float | None = OWNER_COSINE
    owner_odds: float | None = OWNER_ODDS
    caption_floor: float | None = None
    #: Version 4: the same gate on the image rival (None: none, versions 1-3).
    image_floor: float | None = None
    #: Version 4: the least fit an owner must have (None: any, versions 1-3).
    owner_min_fit: float | None = None
    #: Version 4, set only on a junk-heavy corpus (``calibration.calibrate``): below this
    #: similarity every rival is gated (``random_fit``; None: not set).
    random_fit: float | None = None
    #: Images at least this alike are one image (or copies of it): never a rival, an owner
    #: or a copied caption's source (``image_copy_cosine_for``).
    image_copy_cosine: float = SAME_IMAGE_COSINE
    #: A caption at least this many other photos carry is a repeat: no owner (None: no such
    #: rule, contrasts recorded before it).
    repeat_carriers: int | None = None
    #: Only captions of at most this many content words are repeats (set with ``repeat_carriers``).
    repeat_max_words: int | None = None
    #: A shared caption's ``p_clean`` is at most this (set with ``repeat_carriers``).
    shared_p_clean: float | None = None
    #: Version 4: the least fit a carrier of a shared caption must have (``fit_contrast``: the
    #: larger of ``owner_min_fit`` and ``random_fit``; None: ``owner_min_fit``).
    repeat_min_fit: float | None = None

    def rivals(self, image_emb: NDArray[Any], text_emb: NDArray[Any],
               source: NDArray[np.int64] | None = None) -> tuple[FloatArray, FloatArray]:
        """(caption rival, image rival), each (N,), NaN where every bank row was left out.

        Caption rival: the mean of the ``k`` best cosines of the caption with bank images;
        image rival: of the image with bank captions. Left out: bank rows of the pair's own
        image (or a copy), bank captions that are copies of the pair's caption, and the
        bank row ``source[n]`` (>= 0) when given (a noise reference's own pair)."""
        img, txt = _f16(image_emb), _f16(text_emb)
        bank_img, bank_txt = self.bank[0], self.bank[1]
        cap_rival = np.zeros(len(txt), dtype=np.float32)
        img_rival = np.zeros(len(txt), dtype=np.float32)
        for start in range(0, len(txt), _BLOCK):
            rows = slice(start, start + _BLOCK)
            same = (img[rows] @ bank_img.T) >= self.image_copy_cosine
            if source is not None:
                src = source[rows]
                has = np.nonzero(src >= 0)[0]
                same[has, src[has]] = True
            cap = txt[rows] @ bank_img.T
            cap[same] = -np.inf
            im = img[rows] @ bank_txt.T
            im[same | ((txt[rows] @ bank_txt.T) >= SAME_IMAGE_COSINE)] = -np.inf
            cap_rival[rows] = self._top_mean(cap)
            img_rival[rows] = self._top_mean(im)
        return cap_rival, img_rival

    def _top_mean(self, cos: FloatArray) -> FloatArray:
        k = min(self.k, cos.shape[1])
        top = -np.partition(-cos, k - 1, axis=1)[:, :k]
        finite = np.isfinite(top)
        count = finite.sum(1)
        total = np.where(finite, top, 0.0).sum(1)
        out: FloatArray = np.where(count > 0, total / np.maximum(count, 1), np.nan).astype(np.float32)
        return out

    def adjust(self, similarity: NDArray[Any], image_emb: NDArray[Any], text_emb: NDArray[Any],
               source: NDArray[np.int64] | None = None) -> FloatArray:
        """(N,) adjusted similarities (module docstring); NaN similarities stay NaN, a
        missing rival (every bank row left out) adjusts nothing, and a rival's deviation below
        its floor (version 4) lifts the pair at most by how much its similarity exceeds that
        rival."""
        s = np.asarray(similarity, dtype=np.float32)
        ok = np.isfinite(s)
        out = np.full(s.shape, np.nan, dtype=np.float32)
        if ok.any():
            cap, im = self.rivals(np.asarray(image_emb)[ok], np.asarray(text_emb)[ok], None if source is None else source[ok])
            d_cap = np.where(np.isfinite(cap), cap - np.float32(self.mean_caption_rival), 0.0)
            d_img = np.where(np.isfinite(im), im - np.float32(self.mean_image_rival), 0.0)
            # version 4: a caption that fits nothing lifts nothing, nor does an image that fits no
            # caption (a placeholder), nor, on a junk-heavy corpus, any rival of a pair that fits
            # no better than most random pairs do (``random_fit``)
            low = None if self.random_fit is None else s[ok] < np.float32(self.random_fit)
            if self.caption_floor is not None:
                d_cap = _gated(d_cap, self.caption_floor, s[ok], cap, low)
            if self.image_floor is not None:
                d_img = _gated(d_img, self.image_floor, s[ok], im, low)
            if self.caption_gamma == self.image_gamma:  # version 1's arithmetic, so its jobs resume bit for bit
                out[ok] = s[ok] - np.float32(self.image_gamma) * (d_cap + d_img).astype(np.float32)
            else:
                out[ok] = s[ok] - (np.float32(self.caption_gamma) * d_cap + np.float32(self.image_gamma) * d_img).astype(np.float32)
        return out

    def owner_margin(self, similarity: NDArray[Any], image_emb: NDArray[Any], text_emb: NDArray[Any],
                     ok: NDArray[np.bool_] | None = None, words: NDArray[Any] | None = None) -> FloatArray:
        """(N,) how much better the caption's best *owner* fits it than the pair's own image:
        the largest ``cos(caption, owner image) - similarity`` over owners, the pairs of
        another image (image cosine below ``SAME_IMAGE_COSINE``) whose caption says the same
        (caption cosine >= ``owner_cosine``), searched among the bank's rows and among the
        first ``OWNER_SHARD_ROWS`` of the N given pairs themselves (a shard's, so corpora
        larger than the bank still find the owners their shards hold). NaN where there is
        no owner, where the similarity is NaN, and for a version 1-2 contrast; -inf where the
        caption is a short one that many photos share (``repeat_carriers``; ``words``: (N,)
        content-word counts, None where unknown): no owner, ``p_clean`` capped (``is_shared``).
        Positive: the caption has a better owner. ``ok`` (N,):
        the pairs searched and searched for (default: finite similarities); a table passes
        its ``ok`` statuses, which its sidecar has embeddings of, so a rescore finds what the
        score found."""
        s = np.asarray(similarity, dtype=np.float32)
        if self.owner_cosine is None:
            return np.full(s.shape, np.nan, dtype=np.float32)
        img, txt = _f16(image_emb), _f16(text_emb)
        ok = np.isfinite(s) & (True if ok is None else np.asarray(ok, dtype=bool))
        shard = np.nonzero(ok)[0][:OWNER_SHARD_ROWS]
        short = self.short(words, len(s))
        fit = np.maximum(  # NaN propagates: a caption repeated in either place has no owner
            _best_owner_fit(img, txt, self.bank[0], self.bank[1], self.owner_cosine, self.image_copy_cosine,
                            self.repeat_carriers, self.carrier_fit, short),
            _best_owner_fit(img, txt, img[shard], txt[shard], self.owner_cosine, self.image_copy_cosine,
                            self.repeat_carriers, self.carrier_fit, short))
        shared = ok & np.isnan(fit)  # _best_owner_fit's mark: NaN only for a shared caption
        if self.owner_min_fit is not None:  # version 4: a repeat that fits no photo well is no owner
            fit = np.where(fit >= np.float32(self.owner_min_fit), fit, -np.inf).astype(np.float32)
        out: FloatArray = np.where(ok & np.isfinite(fit), fit - s, np.nan).astype(np.float32)
        out[shared] = -np.inf
        return out

    def without_shared_rule(self) -> Contrast:
        """This contrast without the shared-caption rule (a rescore of sidecars written
        before the caption counts: the record must not claim a rule that cannot act)."""
        return replace(self, repeat_carriers=None, repeat_max_words=None, shared_p_clean=None, repeat_min_fit=None)

    @property
    def carrier_fit(self) -> float | None:
        """The least fit a carrier of a shared caption must have (``repeat_min_fit``, else
        ``owner_min_fit``; None: any)."""
        return self.repeat_min_fit if self.repeat_min_fit is not None else self.owner_min_fit

    def short(self, words: NDArray[Any] | None, n: int) -> NDArray[np.bool_] | None:
        """(n,) which pairs' captions are short enough to be shared ones: ``words`` (n,)
        content-word counts (-1 where unknown or not ok) at most ``repeat_max_words``; None
        where the rule is off (no ``repeat_carriers``), no count is known, or ``words`` holds
        another number of pairs."""
        if self.repeat_carriers is None or self.repeat_max_words is None or self.shared_p_clean is None or words is None:
            return None
        counts = np.asarray(words)
        if counts.shape != (n,):
            return None
        out: NDArray[np.bool_] = (counts >= 0) & (counts <= self.repeat_max_words)
        return out

    def to_json(self) -> dict[str, Any]:
        """The parameters and the bank's checksum (the bank itself is a file of its own)."""
        owner = {} if self.owner_cosine is None else {"owner_cosine": self.owner_cosine, "owner_odds": self.owner_odds}
        bounds = (self.caption_floor, self.image_floor, self.owner_min_fit)
        # version 4 only with every bound finite (fit_contrast sets none otherwise): JSON has no infinity
        floors = ({} if not owner or any(b is None or not math.isfinite(b) for b in bounds)
                  else {"caption_floor": self.caption_floor, "image_floor": self.image_floor, "owner_min_fit": self.owner_min_fit,
                        **({} if self.random_fit is None or not math.isfinite(self.random_fit) else {"random_fit": self.random_fit})})
        return {"recipe": RECIPE, "version": 4 if floors else 3 if owner else 2, **floors, "k": self.k, "caption_gamma": self.caption_gamma,
                "image_gamma": self.image_gamma,
                "mean_caption_rival": self.mean_caption_rival, "mean_image_rival": self.mean_image_rival,
                "bank_rows": int(self.bank.shape[1]), "bank_sha256": bank_sha256(self.bank), **owner,
                **({} if self.image_copy_cosine == SAME_IMAGE_COSINE else {"image_copy_cosine": self.image_copy_cosine}),
                **({} if self.repeat_carriers is None or self.repeat_max_words is None or not owner
                   else {"repeat_carriers": self.repeat_carriers, "repeat_max_words": self.repeat_max_words,
                         "shared_p_clean": self.shared_p_clean,
                         **({} if self.repeat_min_fit is None or not math.isfinite(self.repeat_min_fit) or not floors
                            else {"repeat_min_fit": self.repeat_min_fit})})}


def _gated(deviation: NDArray[Any], floor: float, similarity: FloatArray, rival: FloatArray,
           low: NDArray[np.bool_] | None = None) -> NDArray[Any]:
    """Version 4's gate: a rival ``deviation`` (N,) below ``floor``, or any deviation of a pair
    marked ``low`` (N,) (its similarity below ``random_fit``), counts only as far down as the
    pair's ``similarity`` exceeds that ``rival`` (a missing rival: no gate), so the lift it
    gives is at most how much better the pair fits than the rival does.

    Discontinuous on purpose: just above the floor a rival lifts by its whole deviation, just
    below by at most ``beat``. Below the floor the rival says the caption (image) fits nothing,
    which is no evidence for this pair; the continuous alternative (a lift of at most the
    floor, or ``beat`` if more) left boilerplate pairs the floor's lift (dev AUC 0.921 against
    0.961 at 20%, module docstring)."""
    beat = np.maximum(np.float32(0.0), np.where(np.isfinite(rival), similarity - rival, 0.0))
    free = deviation >= np.float32(floor)
    if low is not None:
        free &= ~low
    return np.where(free, deviation, np.maximum(deviation, -beat))


def _best_owner_fit(img: FloatArray, txt: FloatArray, ref_img: FloatArray, ref_txt: FloatArray, cosine: float,
                    image_copy: float = SAME_IMAGE_COSINE, repeat: int | None = None, min_fit: float | None = None,
                    short: NDArray[np.bool_] | None = None) -> FloatArray:
    """(N,) for each pair (rows of ``img``, ``txt``) the largest cosine of its caption with a
    reference image whose caption says the same (cosine >= ``cosine``) and that is not its
    own image (image cosine below ``image_copy``); -inf where there is none, NaN where
    ``repeat`` or more such references carry it and fit it at least ``min_fit`` and the pair's
    caption is ``short`` (N,) (a caption many photos share: no owner; boilerplate repeated over
    photos it fits none of is no such caption; None: no caption is short).

    One caption product per block; the image products only for the few caption matches
    (about 1 in 10,000 reference rows for pairclean-lite at 0.85), so a 10,000-pair shard
    costs about one 10,000 x 10,000 x D product."""
    best = np.full(len(txt), -np.inf, dtype=np.float32)
    if not len(ref_txt):
        return best
    block = max(16, min(_BLOCK, (1 << 22) // len(ref_txt)))  # a (rows x references) product near 16 MiB
    for start in range(0, len(txt), block):
        r, c = np.nonzero((txt[start : start + block] @ ref_txt.T) >= cosine)
        r = r + start
        other = np.einsum("nd,nd->n", img[r], ref_img[c]) < image_copy
        r, c = r[other], c[other]
        fit = np.einsum("nd,nd->n", txt[r], ref_img[c]).astype(np.float32)
        np.maximum.at(best, r, fit)
        if repeat is not None and short is not None:
            plausible = r if min_fit is None else r[fit >= np.float32(min_fit)]
            carriers = np.bincount(plausible - start, minlength=min(block, len(txt) - start))
            shared = start + np.nonzero(carriers >= repeat)[0]
            best[shared[short[shared]]] = np.nan
    return best


def table_columns(contrast: Contrast | None, similarity: NDArray[Any], image_emb: NDArray[Any],
                  text_emb: NDArray[Any], ok: NDArray[np.bool_],
                  words: NDArray[Any] | None = None) -> tuple[FloatArray | None, FloatArray | None]:
    """``scores_table``'s contrast arguments ``(adjusted, owner_margin)`` for a table's (N,)
    similarities, (N, D) embeddings, (N,) ``ok`` statuses and (N,) caption content-word counts
    (``words``, None where unknown): each (N,), the margin only under a version-3 contrast;
    both None without a contrast."""
    if contrast is None:
        return None, None
    adjusted = contrast.adjust(similarity, image_emb, text_emb)
    owner = contrast.owner_margin(similarity, image_emb, text_emb, ok, words) if contrast.owner_cosine is not None else None
    return adjusted, owner


def has_owner(margin: NDArray[Any]) -> NDArray[np.bool_]:
    """(N,) which pairs' captions have a better owner: ``owner_margin`` (N,) above 0 (NaN: none)."""
    out: NDArray[np.bool_] = np.nan_to_num(np.asarray(margin, dtype=np.float64), nan=-1.0) > 0
    return out


def is_shared(margin: NDArray[Any]) -> NDArray[np.bool_]:
    """(N,) which pairs' captions are shared ones: ``owner_margin`` (N,) -inf (``Contrast.owner_margin``)."""
    m = np.asarray(margin, dtype=np.float64)
    out: NDArray[np.bool_] = np.isneginf(m)
    return out


def owner_p_clean(p_clean: NDArray[Any], margin: NDArray[Any], odds: float | None,
                  shared_max: float | None = None) -> NDArray[np.float32]:
    """(N,) ``p_clean`` with the odds of each pair whose caption has a better owner (``margin``
    > 0, ``Contrast.owner_margin``) multiplied by ``odds``, and the ``p_clean`` of each pair
    whose caption is a shared one (``is_shared``) at most ``shared_max`` (None: a contrast
    recorded without the rule); other pairs (and ``odds`` None: a version 1-2 contrast)
    unchanged. Never raises a ``p_clean``."""
    p = np.asarray(p_clean, dtype=np.float64)
    if odds is None:
        return p.astype(np.float32)
    owned = has_owner(margin)
    lowered = p * odds / np.maximum(1.0 - p + p * odds, 1e-12)
    out = np.where(owned, lowered, p)
    if shared_max is not None:
        out = np.where(is_shared(margin), np.minimum(out, shared_max), out)
    return out.astype(np.float32)


def copied_caption_share(similarity: NDArray[Any], image_emb: NDArray[Any], text_emb: NDArray[Any],
                         limit: int = BANK_SIZE, min_fit: float | None = None, image_copy: float = SAME_IMAGE_COSINE) -> float:
    """The share of pairs (of the first ``limit``) whose caption another, different image of
    the sample carries too (caption cosine >= ``SAME_IMAGE_COSINE``, image cosine below it)
    with a higher similarity: a caption copied from a better-fitting image, so most likely
    not this image's. A lower bound on the near-miss share that the similarity alone cannot
    see (the two pairs' scores overlap); measured on Flickr8k dev (one pair per photo):
    0.001 with no noise or random swaps only, 0.168 / 0.339 when 20% / 50% of the pairs carry
    the caption of the most alike other photo (85-90% of those pairs are that noise), 0.05 /
    0.108 for the most alike other caption. ``min_fit`` (version 4, ``plausible_fit``): the
    better-fitting pair counts only where its similarity reaches it, so a repeated string that
    fits none of its photos is not read as a caption copied from a better one. ``image_copy``:
    images at least this alike are one image (``Contrast.image_copy_cosine``). Copies of a
    shared caption count too: some of them are near-misses (module docstring)."""
    s = np.asarray(similarity, dtype=np.float32)[:limit]
    img, txt = _f16(np.asarray(image_emb)[:limit]), _f16(np.asarray(text_emb)[:limit])
    if len(s) < 2:
        return 0.0
    beaten = np.zeros(len(s), dtype=bool)
    for start in range(0, len(s), _BLOCK):
        rows = slice(start, start + _BLOCK)
        copy = ((txt[rows] @ txt.T) >= SAME_IMAGE_COSINE) & ((img[rows] @ img.T) < image_copy)
        better = s[None, :] > s[rows, None]
        if min_fit is not None:  # version 4: the better pair must fit its caption plausibly (``plausible_fit``)
            better &= s[None, :] >= np.float32(min_fit)
        beaten[rows] = (copy & better).any(1)
    return float(beaten[np.isfinite(s)].mean()) if np.isfinite(s).any() else 0.0


def owner_cosine_for(model_id: str, checkpoint: str | None) -> float:
    """The caption cosine at which two captions say the same, for an estimator:
    ``OWNER_COSINE`` in the caption space it was measured in (pairclean-lite with its shipped
    heads), else ``SAME_IMAGE_COSINE`` (copies only). Why: what a cosine means depends on
    the text tower (CLIP-style towers put unrelated captions at 0.6-0.9 of each other, where
    pairclean-lite's are near 0 and 0.85 is their top 0.01%), and a word-for-word copy is
    a copy in any space."""
    return OWNER_COSINE if model_id == OWNER_MODEL and checkpoint is None else SAME_IMAGE_COSINE


def image_copy_cosine_for(model_id: str, checkpoint: str | None) -> float:
    """The image cosine at which two images are one (a copy, re-encoded): ``IMAGE_COPY_COSINE_LITE``
    in the space it was measured in (pairclean-lite with its shipped heads), else
    ``SAME_IMAGE_COSINE``."""
    return IMAGE_COPY_COSINE_LITE if model_id == OWNER_MODEL and checkpoint is None else SAME_IMAGE_COSINE


def fit_contrast(image_emb: NDArray[Any], text_emb: NDArray[Any], owner_cosine: float = OWNER_COSINE,
                 image_copy: float = SAME_IMAGE_COSINE) -> Contrast | None:
    """The contrast of a calibration sample ((N, D) ok-pair embeddings in shard order) whose
    owners say the same at ``owner_cosine`` (``owner_cosine_for``) and whose images are one at
    ``image_copy`` (``image_copy_cosine_for``); None when it holds fewer
    than ``MIN_BANK`` pairs. Version 4's bounds (floors, least owner fit) only from
    ``MIN_GATE_PAIRS`` pairs on; a smaller sample's contrast is version 3's."""
    if len(image_emb) < MIN_BANK:
        return None
    bank = np.stack([_f16(image_emb[:BANK_SIZE]), _f16(text_emb[:BANK_SIZE])])
    cap, im = Contrast(bank=bank, mean_caption_rival=0.0, mean_image_rival=0.0, image_copy_cosine=image_copy).rivals(image_emb, text_emb)
    if not (np.isfinite(cap).any() and np.isfinite(im).any()):
        return None
    mean_cap, mean_im = float(np.nanmean(cap.astype(np.float64))), float(np.nanmean(im.astype(np.float64)))
    plain = Contrast(bank=bank, mean_caption_rival=mean_cap, mean_image_rival=mean_im, owner_cosine=owner_cosine,
                     image_copy_cosine=image_copy, repeat_carriers=REPEAT_CARRIERS, repeat_max_words=SHARED_CAPTION_WORDS,
                     shared_p_clean=SHARED_P_CLEAN)
    if len(image_emb) < MIN_GATE_PAIRS:
        return plain  # version 3's contrast: too few pairs to place the bounds
    bounds = (deviation_floor(cap, mean_cap), deviation_floor(im, mean_im),
              plausible_fit(np.einsum("nd,nd->n", _f16(image_emb), _f16(text_emb))))
    if not all(math.isfinite(b) for b in bounds):
        return plain
    carrier = max(bounds[2], random_fit(image_emb, text_emb))
    return replace(plain, caption_floor=bounds[0], image_floor=bounds[1], owner_min_fit=bounds[2],
                   repeat_min_fit=carrier if math.isfinite(carrier) else None)


def plausible_fit(similarities: NDArray[Any]) -> float:
    """The least similarity at which a pair of the sample (N,) fits its caption plausibly
    (version 4): the ``OWNER_FIT_QUANTILE`` quantile of the normal read from the sample's
    upper quantiles (``_upper_normal``), so a share of pairs that fit nothing does not drag it
    down. An owner, or the better-fitting pair of a copied caption, must reach it: a caption
    written for a similar-looking photo fits that photo as clean pairs fit theirs, while a
    string repeated over many photos that fits none of them (boilerplate alt-text:
    "untitled", "photo") would otherwise find an "owner" in whichever photo it fits least
    badly. -inf for an empty sample."""
    fit = _upper_normal(similarities)
    if fit is None:
        return -math.inf
    centre, sd = fit
    return float(centre + NormalDist().inv_cdf(OWNER_FIT_QUANTILE) * sd)


def random_fit(image_emb: NDArray[Any], text_emb: NDArray[Any]) -> float:
    """The ``RANDOM_FIT_QUANTILE`` quantile of the similarities of ``RANDOM_FIT_PAIRS`` seeded
    mismatched pairs of the sample ((N, D) each, float16-rounded as the bank): how well a
    caption fits a photo it was not written for. A threshold junk cannot move (mismatched
    pairs fit at random level, junk or not), where every low quantile of the sample's own
    similarities moves with the junk's share. About 0.10 on Flickr8k dev with pairclean-lite
    (1.3% of clean pairs below it). -inf for fewer than 2 pairs."""
    from pairclean import osa

    img, txt = _f16(np.asarray(image_emb)), _f16(np.asarray(text_emb))
    if len(img) < 2:
        return -math.inf
    i, j = osa.mismatched_pairs(len(img), RANDOM_FIT_PAIRS, 0)
    return float(np.quantile(np.einsum("nd,nd->n", img[i], txt[j]), RANDOM_FIT_QUANTILE))


def _upper_normal(values: NDArray[Any]) -> tuple[float, float] | None:
    """(centre, sd) of the normal whose 75th and 90th percentiles are the sample's (N,). Why
    the upper quantiles: pairs whose captions fit no image (boilerplate) or whose image fits
    no caption (placeholders) make a lower tail, and a median, a spread or a low quantile
    over the whole sample moves with their share (a fifth of the sample moves these little;
    half of it does: see ``docs/hard_noise.md``). None for an empty sample."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return None
    q75, q90 = np.quantile(x, [0.75, 0.9])
    unit = NormalDist()
    sd = float(q90 - q75) / (unit.inv_cdf(0.9) - unit.inv_cdf(0.75))
    return float(q75) - unit.inv_cdf(0.75) * sd, sd


def deviation_floor(rivals: NDArray[Any], mean: float, z: float = FLOOR_Z) -> float:
    """The deviation from ``mean`` below which a rival of the sample ``rivals`` (N,) is
    gated (version 4): ``z`` robust standard deviations below the sample's centre
    (``_upper_normal``). At most 0 (a floor must not gate a pair the sample calls typical);
    -inf for an empty sample."""
    fit = _upper_normal(rivals)
    if fit is None:
        return -math.inf
    centre, sd = fit
    return float(min(0.0, centre - z * sd - mean))


def rival_weights(doc: dict[str, Any]) -> tuple[float, float]:
    """(caption, image) weights of a recorded contrast (``to_json``): version 1 took one
    ``gamma`` off both."""
    if int(doc["version"]) == 1:
        return float(doc["gamma"]), float(doc["gamma"])
    return float(doc["caption_gamma"]), float(doc["image_gamma"])


def from_json(doc: dict[str, Any], bank: NDArray[Any]) -> Contrast:
    """The ``Contrast`` recorded as ``doc`` (``to_json``, this version or an earlier one, so a
    job keeps the contrast it was calibrated under) with its ``bank`` rows; raises ValueError
    for an unknown recipe or version, or when the bank is not the recorded one."""
    if doc.get("recipe") != RECIPE or doc.get("version") not in _READS:
        raise ValueError(f"unknown contrast recipe {doc.get('recipe')!r} version {doc.get('version')!r}")
    arr = _f16(bank)
    if bank_sha256(arr) != doc["bank_sha256"]:
        raise ValueError("the contrast bank's checksum does not match the calibration")
    if arr.ndim != 3 or arr.shape[0] != 2:
        raise ValueError(f"the contrast bank has shape {arr.shape}, not (2, rows, dim)")
    caption_gamma, image_gamma = rival_weights(doc)
    owner = int(doc["version"]) >= 3
    floors = int(doc["version"]) >= 4
    return Contrast(bank=arr, mean_caption_rival=float(doc["mean_caption_rival"]),
                    mean_image_rival=float(doc["mean_image_rival"]), k=int(doc["k"]),
                    caption_gamma=caption_gamma, image_gamma=image_gamma,
                    owner_cosine=float(doc["owner_cosine"]) if owner else None,
                    owner_odds=float(doc["owner_odds"]) if owner else None,
                    caption_floor=float(doc["caption_floor"]) if floors else None,
                    image_floor=float(doc["image_floor"]) if floors else None,
                    owner_min_fit=float(doc["owner_min_fit"]) if floors else None,
                    random_fit=float(doc["random_fit"]) if floors and "random_fit" in doc else None,
                    image_copy_cosine=float(doc.get("image_copy_cosine", SAME_IMAGE_COSINE)),
                    repeat_carriers=_positive_int(doc, "repeat_carriers") if owner else None,
                    repeat_max_words=_positive_int(doc, "repeat_max_words") if owner else None,
                    shared_p_clean=_fraction(doc, "shared_p_clean") if owner else None,
                    repeat_min_fit=float(doc["repeat_min_fit"]) if floors and "repeat_min_fit" in doc else None)


def _positive_int(doc: dict[str, Any], name: str) -> int | None:
    """A recorded ``repeat_carriers`` or ``repeat_max_words`` (absent: None); ValueError unless
    a positive integer."""
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the contrast's {name} must be a positive integer, not {value!r}")
    return value


def _fraction(doc: dict[str, Any], name: str) -> float | None:
    """A recorded ``shared_p_clean`` (absent: None); ValueError unless a number in [0, 1]."""
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"the contrast's {name} must be a number in [0, 1], not {value!r}")
    return float(value)

