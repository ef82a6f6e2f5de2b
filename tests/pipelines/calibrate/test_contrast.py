"""The corpus contrast (pairclean.calibrate.contrast) and its place in the calibration."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pairclean.calibrate import contrast as cm
from pairclean.calibrate.calibration import calibrate
from pairclean.judge.metrics import roc_auc
from pairclean.output.folder import OutputDir
from pairclean.errors import InputError


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _corpus(n: int = 200, dim: int = 32, near: float = 0.3, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Images in pairs of look-alikes; captions near their own image. A ``near`` share of
    pairs carry the caption of their look-alike (a near-miss). Returns img, txt, clean."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n // 2, dim))
    img = _unit(np.repeat(base, 2, axis=0) + 0.5 * rng.normal(size=(n, dim)))
    own = _unit(img + 1.5 * rng.normal(size=(n, dim)) / np.sqrt(dim))
    clean = rng.random(n) >= near
    twin = np.arange(n) ^ 1  # the look-alike of image i
    txt = np.where(clean[:, None], own, own[twin])
    return img, txt.astype(np.float32), clean


def test_a_near_miss_ranks_lower_once_its_caption_fits_another_image_better() -> None:
    img, txt, clean = _corpus()
    sims = (img * txt).sum(1)
    c = cm.fit_contrast(img, txt)
    assert c is not None
    adjusted = c.adjust(sims, img, txt)
    assert roc_auc(adjusted, clean) > roc_auc(sims, clean) + 0.03


def test_the_adjusted_similarity_keeps_the_similarity_scale_on_the_sample() -> None:
    img, txt, _ = _corpus(near=0.0)
    sims = (img * txt).sum(1)
    c = cm.fit_contrast(img, txt)
    assert c is not None
    ungated = replace(c, caption_floor=None, image_floor=None)
    assert abs(float(ungated.adjust(sims, img, txt).mean() - sims.mean())) < 1e-4  # the rivals are centred on the sample
    # version 4's gate only ever lowers a pair, and few of a sample without boilerplate
    adjusted = c.adjust(sims, img, txt)
    assert np.all(adjusted <= ungated.adjust(sims, img, txt) + 1e-6) and abs(float(adjusted.mean() - sims.mean())) < 0.01


def test_own_image_and_copies_are_no_rival() -> None:
    img, txt, _ = _corpus(near=0.0)
    c = cm.fit_contrast(img, txt)
    assert c is not None
    # a pair whose image is in the bank: its own caption in the bank must not be its rival
    cap, im = c.rivals(img[:1], txt[:1])
    others = np.r_[img[1:2], img[2:]]
    assert cap[0] <= float(np.sort(others @ txt[0])[-2:].mean()) + 1e-3
    assert im[0] < float(img[0] @ txt[0])  # its own caption (the best fit) was left out
    # a bank of nothing but copies of the pair's image: no rival, no adjustment
    copies = cm.Contrast(bank=np.stack([np.repeat(img[:1], 20, 0), np.repeat(txt[:1], 20, 0)]),
                         mean_caption_rival=0.1, mean_image_rival=0.1)
    s = np.array([0.3], np.float32)
    assert copies.adjust(s, img[:1], txt[:1])[0] == pytest.approx(0.3)


def test_small_samples_and_bad_rows() -> None:
    img, txt, _ = _corpus(n=10)
    assert cm.fit_contrast(img, txt) is None  # fewer than MIN_BANK pairs
    img, txt, _ = _corpus()
    c = cm.fit_contrast(img, txt)
    assert c is not None
    sims = (img * txt).sum(1)
    sims[3] = np.nan
    out = c.adjust(sims, img, txt)
    assert np.isnan(out[3]) and np.isfinite(np.delete(out, 3)).all()


def test_the_recorded_contrast_round_trips_and_a_changed_bank_is_refused() -> None:
    img, txt, _ = _corpus()
    c = cm.fit_contrast(img, txt)
    assert c is not None
    doc = c.to_json()
    back = cm.from_json(doc, c.bank.astype(np.float16))
    sims = (img * txt).sum(1)
    np.testing.assert_array_equal(back.adjust(sims, img, txt), c.adjust(sims, img, txt))
    other = c.bank.copy()
    other[0, 0, 0] += 0.5
    with pytest.raises(ValueError, match="checksum"):
        cm.from_json(doc, other)
    with pytest.raises(ValueError, match="unknown contrast recipe"):
        cm.from_json({**doc, "version": 99}, c.bank)


def test_a_version_1_contrast_keeps_its_one_weight_and_its_arithmetic() -> None:
    """A job calibrated under version 1 (one gamma for both rivals) resumes with exactly
    the adjusted similarities it was scored with; version 2 weighs the rivals apart."""
    img, txt, _ = _corpus(n=400)  # at least MIN_GATE_PAIRS: a version-4 contrast
    c = cm.fit_contrast(img, txt)
    assert c is not None
    doc = c.to_json()
    assert doc["version"] == 4 and (doc["caption_gamma"], doc["image_gamma"]) == (cm.CAPTION_GAMMA, cm.IMAGE_GAMMA)
    assert cm.CAPTION_GAMMA != cm.IMAGE_GAMMA
    v1 = {k: v for k, v in doc.items() if k not in ("caption_gamma", "image_gamma", "owner_cosine", "owner_odds", "caption_floor", "image_floor", "owner_min_fit")} | {"version": 1, "gamma": 0.5}
    old = cm.from_json(v1, c.bank)
    assert (old.caption_gamma, old.image_gamma) == (0.5, 0.5)
    sims = (img * txt).sum(1)
    cap, im = c.rivals(img, txt)
    d = (cap - np.float32(c.mean_caption_rival)) + (im - np.float32(c.mean_image_rival))
    np.testing.assert_array_equal(old.adjust(sims, img, txt), sims - np.float32(0.5) * d)
    expected = sims - (np.float32(cm.CAPTION_GAMMA) * (cap - np.float32(c.mean_caption_rival))
                       + np.float32(cm.IMAGE_GAMMA) * (im - np.float32(c.mean_image_rival)))
    np.testing.assert_allclose(replace(c, caption_floor=None, image_floor=None).adjust(sims, img, txt), expected, atol=1e-6)
    # a version-3 record (no bounds) reads back without them and adjusts as version 3 did
    v3 = {k: v for k, v in doc.items() if k not in ("caption_floor", "image_floor", "owner_min_fit")} | {"version": 3}
    back = cm.from_json(v3, c.bank)
    assert (back.caption_floor, back.image_floor, back.owner_min_fit) == (None, None, None)
    np.testing.assert_array_equal(back.adjust(sims, img, txt), replace(c, caption_floor=None, image_floor=None).adjust(sims, img, txt))
    # a sample under MIN_GATE_PAIRS keeps version 3's contrast (too few pairs to place the bounds)
    small = cm.fit_contrast(img[:cm.MIN_GATE_PAIRS - 1], txt[:cm.MIN_GATE_PAIRS - 1])
    assert small is not None and small.caption_floor is None and small.to_json()["version"] == 3
    with pytest.raises(ValueError, match="unknown contrast recipe"):
        cm.from_json({**doc, "version": "2"}, c.bank)


def test_a_caption_with_a_better_owner_loses_its_odds_and_nothing_else_moves() -> None:
    """Version 3: a near-miss whose caption a look-alike of the bank carries (here word for
    word) has an owner that fits it better; the pair's odds of being clean are multiplied by
    ``OWNER_ODDS``, and no pair's p_clean rises."""
    img, txt, clean = _corpus(n=400, near=0.3)
    sims = (img * txt).sum(1)
    c = cm.fit_contrast(img, txt)
    assert c is not None and c.owner_cosine == cm.OWNER_COSINE and c.owner_odds == cm.OWNER_ODDS
    margin = c.owner_margin(sims, img, txt)
    owned = np.nan_to_num(margin, nan=-1.0) > 0
    twin = np.arange(len(sims)) ^ 1
    # a near-miss whose look-alike is clean carries that look-alike's caption: its owner
    copied = ~clean & clean[twin]
    assert owned[copied].mean() > 0.8 and owned[clean].mean() < 0.2
    # the margin is the owner's fit less the pair's own (the owner's image with this caption)
    i = int(np.nonzero(copied & owned)[0][0])
    assert margin[i] == pytest.approx(float(cm._f16(img[twin[i]]) @ cm._f16(txt[i])) - float(sims[i]), abs=2e-3)
    p = np.clip(0.5 + (sims - sims.mean()) / (4 * sims.std()), 0.01, 0.99)
    lowered = cm.owner_p_clean(p, margin, c.owner_odds)
    assert np.all(lowered <= p.astype(np.float32)) and np.array_equal(lowered[~owned], p[~owned].astype(np.float32))
    np.testing.assert_allclose(lowered[owned], (p * 0.1 / (1 - p + p * 0.1))[owned], rtol=1e-5)
    assert roc_auc(lowered, clean) > roc_auc(p, clean) + 0.05
    # NaN similarities (pairs that are not ok) have no owner
    assert np.isnan(c.owner_margin(np.full(3, np.nan, np.float32), img[:3], txt[:3])).all()


def test_owners_are_searched_in_the_shard_as_well_as_in_the_bank() -> None:
    """A near-miss whose source pair is not in the bank (a corpus larger than the bank) still
    finds it when the two share a shard, and a pair that is not ok is no one's owner."""
    img, txt, clean = _corpus(n=400, near=0.3)
    sims = (img * txt).sum(1)
    bank_rows = np.arange(200, 400)  # the bank holds none of the first 200 pairs
    c = cm.fit_contrast(img[bank_rows], txt[bank_rows])
    assert c is not None
    twin = np.arange(400) ^ 1
    shard = np.arange(200)
    copied = (~clean & clean[twin])[shard]
    in_shard = c.owner_margin(sims[shard], img[shard], txt[shard])
    assert (np.nan_to_num(in_shard, nan=-1) > 0)[copied].mean() > 0.8
    alone = np.concatenate([[c.owner_margin(sims[[i]], img[[i]], txt[[i]])[0]] for i in shard])
    assert (np.nan_to_num(alone, nan=-1) > 0)[copied].mean() < 0.2  # neither bank nor a one-pair shard holds the source
    ok = np.ones(200, bool)
    ok[twin[shard][copied]] = False  # the sources fail (decode errors): no owners then
    masked = c.owner_margin(sims[shard], img[shard], txt[shard], ok)
    assert (np.nan_to_num(masked, nan=-1) > 0)[copied].mean() < 0.2


def test_a_huge_shard_searches_only_its_first_rows_for_owners(monkeypatch: pytest.MonkeyPatch) -> None:
    """The work a shard causes stays linear: only its first OWNER_SHARD_ROWS pairs are owners."""
    img, txt, clean = _corpus(n=400, near=0.3)
    sims = (img * txt).sum(1)
    c = cm.fit_contrast(img[200:], txt[200:])
    assert c is not None
    c = replace(c, owner_min_fit=None)  # every owner, however well it fits (version 4's bound is tested below)
    monkeypatch.setattr(cm, "OWNER_SHARD_ROWS", 100)
    twin = np.arange(400) ^ 1
    margin = c.owner_margin(sims[:200], img[:200], txt[:200])
    copied = (~clean & clean[twin])[:200]
    owned = np.nan_to_num(margin, nan=-1) > 0
    # near-misses whose source is among the first 100 rows find it; the others do not
    first = twin[:200] < 100
    assert owned[copied & first].mean() > 0.8 and owned[copied & ~first].mean() < 0.2


def test_owners_say_the_same_at_0_85_only_in_the_caption_space_it_was_measured_in() -> None:
    """pairclean-lite (shipped heads): paraphrases at 0.85; any other tower or heads: copies only."""
    assert cm.owner_cosine_for("pairclean-lite", None) == cm.OWNER_COSINE == 0.85
    assert cm.owner_cosine_for("pairclean-lite", "/my/heads.safetensors") == cm.SAME_IMAGE_COSINE
    assert cm.owner_cosine_for("ViT-B-32", None) == cm.SAME_IMAGE_COSINE
    img, txt, _ = _corpus()
    c = cm.fit_contrast(img, txt, owner_cosine=cm.SAME_IMAGE_COSINE)
    assert c is not None and c.to_json()["owner_cosine"] == cm.SAME_IMAGE_COSINE
    assert cm.from_json(c.to_json(), c.bank).owner_cosine == cm.SAME_IMAGE_COSINE


def test_a_re_encoded_copy_of_the_photo_is_the_photo_not_a_better_owner() -> None:
    """A clean corpus holding each photo twice (one copy re-encoded: image cosine 0.93-0.97 in
    pairclean-lite's space) with its caption had half its pairs flagged: each copy a better
    owner of the other's caption, the copies a floor on the near-miss share. In
    pairclean-lite's space images at 0.92 are one; elsewhere, and in contrasts recorded
    before, 0.98 (``SAME_IMAGE_COSINE``)."""
    assert cm.image_copy_cosine_for("pairclean-lite", None) == cm.IMAGE_COPY_COSINE_LITE == 0.92
    assert cm.image_copy_cosine_for("pairclean-lite", "/my/heads.safetensors") == cm.SAME_IMAGE_COSINE
    assert cm.image_copy_cosine_for("ViT-B-32", None) == cm.SAME_IMAGE_COSINE
    rng = np.random.default_rng(0)
    n, dim = 100, 32
    photo = _unit(rng.normal(size=(n, dim)))
    side = rng.normal(size=(n, dim))
    side = _unit(side - (side * photo).sum(1, keepdims=True) * photo)  # orthogonal to the photo
    cos = rng.uniform(0.93, 0.975, size=(n, 1))  # re-encoded copies, as measured
    copy = _unit(cos * photo + np.sqrt(1 - cos**2) * side)
    cosines = (photo * copy).sum(1)
    assert 0.93 < cosines.min() and cosines.max() < cm.SAME_IMAGE_COSINE
    caption = _unit(photo + 1.5 * rng.normal(size=(n, dim)) / np.sqrt(dim))
    img, txt = np.concatenate([photo, copy]), np.concatenate([caption, caption])  # every caption twice
    sims = (img * txt).sum(1)
    for image_copy, copies in ((cm.SAME_IMAGE_COSINE, True), (cm.IMAGE_COPY_COSINE_LITE, False)):
        c = cm.fit_contrast(img, txt, image_copy=image_copy)
        assert c is not None and c.image_copy_cosine == image_copy
        owned = cm.has_owner(c.owner_margin(sims, img, txt))
        share = cm.copied_caption_share(sims, img, txt, image_copy=image_copy)
        assert (owned.mean() > 0.3 and share > 0.3) if copies else (owned.mean() == 0 and share == 0)
        back = cm.from_json(c.to_json(), c.bank)
        assert back.image_copy_cosine == image_copy and ("image_copy_cosine" in c.to_json()) == (not copies)


def test_a_version_2_contrast_has_no_owner_and_reads_back_unchanged() -> None:
    """Jobs calibrated under version 2 resume with their p_clean untouched by owners."""
    img, txt, _ = _corpus()
    c = cm.fit_contrast(img, txt)
    assert c is not None
    v2 = {k: v for k, v in c.to_json().items() if k not in ("owner_cosine", "owner_odds", "caption_floor", "image_floor", "owner_min_fit", "repeat_carriers",
                                                          "repeat_max_words", "shared_p_clean", "repeat_min_fit")} | {"version": 2}
    old = cm.from_json(v2, c.bank)
    assert old.owner_cosine is None and old.owner_odds is None and old.to_json() == v2
    sims = (img * txt).sum(1)
    assert np.isnan(old.owner_margin(sims, img, txt)).all()
    adjusted, owner = cm.table_columns(old, sims, img, txt, np.ones(len(sims), bool))
    assert owner is None and adjusted is not None and np.array_equal(adjusted, replace(c, caption_floor=None, image_floor=None).adjust(sims, img, txt))
    p = np.linspace(0.01, 0.99, len(sims))
    assert np.array_equal(cm.owner_p_clean(p, np.ones(len(sims)), None), p.astype(np.float32))


def test_calibrate_fits_the_p_clean_curve_on_adjusted_similarities() -> None:
    img, txt, clean = _corpus(n=400, near=0.3)
    sims = (img * txt).sum(1)
    c = cm.fit_contrast(img, txt)
    cal = calibrate(beta_recipe="gmm", k=32, seed=0, weighting="p-clean", batch_size=64, similarities=sims,
                    image_emb=img, text_emb=txt, random_beta=lambda: 0.0, contrast=c)
    assert cal.extra["contrast"]["recipe"] == cm.RECIPE and cal.extra["contrast"]["bank_rows"] == 400
    assert cal.extra["p_clean"]["recipe"] == "corpus-mixture"
    plain = calibrate(beta_recipe="gmm", k=32, seed=0, weighting="p-clean", batch_size=64, similarities=sims,
                      image_emb=img, text_emb=txt, random_beta=lambda: 0.0)
    assert "contrast" not in plain.extra
    from pairclean import osa

    assert c is not None
    p = osa.apply_weighting(c.adjust(sims, img, txt), cal.beta, cal.p_clean_params())
    p_plain = osa.apply_weighting(sims, plain.beta, plain.p_clean_params())
    assert roc_auc(p, clean) > roc_auc(p_plain, clean)


def test_the_bank_file_is_checked_where_read(tmp_path) -> None:
    out = OutputDir(str(tmp_path / "out"))
    with pytest.raises(InputError, match="contrast-bank.npy is missing"):
        out.read_contrast_bank()
    img, txt, _ = _corpus()
    c = cm.fit_contrast(img, txt)
    assert c is not None
    out.write_contrast_bank(c.bank)
    np.testing.assert_array_equal(out.read_contrast_bank(), c.bank)
    from pairclean import schema

    for data in (b"not an array", b""):  # an empty file too (np.load raises EOFError there)
        out.store.put(schema.CONTRAST_BANK_FILE, data)
        with pytest.raises(InputError, match="damaged"):
            out.read_contrast_bank()


def test_copied_captions_floor_the_near_miss_share() -> None:
    img, txt, clean = _corpus(n=400, near=0.3)
    sims = (img * txt).sum(1)
    share = cm.copied_caption_share(sims, img, txt)
    # a near-miss whose twin kept its own caption carries a copy of it; most fit the twin better
    copied = np.array([(not clean[i]) and clean[i ^ 1] for i in range(len(clean))])
    assert 0.3 * copied.mean() < share <= copied.mean() + 0.02
    plain_img, plain_txt, _ = _corpus(n=400, near=0.0)
    assert cm.copied_caption_share((plain_img * plain_txt).sum(1), plain_img, plain_txt) == 0.0
    c = cm.fit_contrast(img, txt)
    assert c is not None and c.owner_min_fit is not None
    cal = calibrate(beta_recipe="gmm", k=32, seed=0, weighting="p-clean", batch_size=64, similarities=sims,
                    image_emb=img, text_emb=txt, random_beta=lambda: 0.0, contrast=c)
    fit = cal.extra["p_clean"]["fit"]
    # version 4: a copy counts only where the better pair fits plausibly (a few do not here)
    bounded = cm.copied_caption_share(sims, img, txt, min_fit=c.owner_min_fit)
    assert fit["min_near_share"] == pytest.approx(bounded) and share - 0.05 <= bounded <= share
    assert fit["near_share"] >= bounded


def test_a_word_check_leaves_the_profiles_guess_out() -> None:
    """Under a judge's word check the near-miss share is what copies show, never the
    similarity profile's guess: the word-level near-misses are the check's to count."""
    img, txt, _ = _corpus(n=400, near=0.3)
    sims = (img * txt).sum(1)
    c = cm.fit_contrast(img, txt)
    assert c is not None
    share = cm.copied_caption_share(sims, img, txt, min_fit=c.owner_min_fit)
    kw = dict(beta_recipe="gmm", k=32, seed=0, weighting="p-clean", batch_size=64, similarities=sims,
              image_emb=img, text_emb=txt, random_beta=lambda: 0.0, contrast=c)
    checked = calibrate(**kw, word_check=True).extra["p_clean"]["fit"]  # type: ignore[arg-type]
    assert checked["near_share"] == pytest.approx(share) and checked["near_share_source"].startswith("copies only")
    assert checked["share_profile"] == []  # the profile was not consulted
    default = calibrate(**kw).extra["p_clean"]["fit"]  # type: ignore[arg-type]
    assert default["share_profile"] and default["near_share"] >= checked["near_share"]


def test_a_caption_that_fits_no_image_is_not_lifted() -> None:
    """Version 4: boilerplate (a caption whose embedding is near no image's) has a caption
    rival far below the sample's; version 3 lifted such a pair by that gap, from a cosine
    near 0 to about the clean pairs' median. Now its lift is at most how much it beats its
    rival (nothing), while a specific caption (low rival, high similarity) keeps its lift."""
    img, txt, _ = _corpus(n=400, near=0.0)
    pad = np.zeros((400, 8), np.float32)
    img, txt = np.hstack([img, pad]), np.hstack([txt, pad])
    rng = np.random.default_rng(3)
    junk = np.hstack([0.1 * rng.normal(size=(80, 32)), rng.normal(size=(80, 8))])  # near no image
    txt[:80] = _unit(junk)
    sims = (img * txt).sum(1)
    c = cm.fit_contrast(img, txt)
    assert c is not None and c.caption_floor is not None and c.caption_floor < 0
    assert c.to_json()["version"] == 4 and cm.from_json(c.to_json(), c.bank).caption_floor == c.caption_floor
    old = replace(c, caption_floor=None, image_floor=None)
    new_adj, old_adj = c.adjust(sims, img, txt), old.adjust(sims, img, txt)
    assert abs(float(sims[:80].mean())) < 0.05 and float(old_adj[:80].mean()) > 0.25  # version 3 lifted them from ~0
    assert float(new_adj[:80].mean()) < float(old_adj[:80].mean()) - 0.15
    assert roc_auc(new_adj, np.arange(400) >= 80) > roc_auc(old_adj, np.arange(400) >= 80) + 0.05
    # clean pairs barely move: the floor sits below what the sample calls typical
    assert np.mean(np.abs(new_adj[80:] - old_adj[80:]) > 1e-6) < 0.1


def test_the_floor_reads_the_upper_quantiles() -> None:
    rng = np.random.default_rng(0)
    clean = rng.normal(0.5, 0.1, 4000)
    floor = cm.deviation_floor(clean, 0.5)
    assert floor == pytest.approx(-cm.FLOOR_Z * 0.1, abs=0.02)
    # a fifth of the sample far below moves it less than a median and spread over all would
    mixed = np.r_[clean[:3200], rng.normal(0.05, 0.03, 800)]
    med = float(np.median(mixed))
    over_all = med - cm.FLOOR_Z * 1.4826 * float(np.median(np.abs(mixed - med))) - 0.5
    assert over_all + 0.04 < cm.deviation_floor(mixed, 0.5) < floor
    assert cm.deviation_floor(np.array([np.nan]), 0.0) == -np.inf
    assert cm.deviation_floor(clean, -1.0) == 0.0  # never above 0


def test_a_repeated_string_that_fits_no_photo_has_no_owner_and_is_no_copy() -> None:
    """Version 4: boilerplate repeated over many photos ("untitled") fits none of them; the
    photo it fits least badly is no owner, and the copies are not near-miss captions."""
    img, txt, _ = _corpus(n=400, near=0.0)
    pad = np.zeros((400, 8), np.float32)
    img, txt = np.hstack([img, pad]), np.hstack([txt, pad])
    rng = np.random.default_rng(5)
    for start in range(0, 80, 8):  # ten strings, each on eight photos, each near no image
        txt[start:start + 8] = _unit(np.hstack([0.1 * rng.normal(size=32), rng.normal(size=8)]))[None, :]
    sims = (img * txt).sum(1)
    c = cm.fit_contrast(img, txt)
    assert c is not None and c.owner_min_fit is not None and c.owner_min_fit > float(sims[:80].max())
    assert not cm.has_owner(c.owner_margin(sims, img, txt))[:80].any()
    assert cm.has_owner(replace(c, owner_min_fit=None).owner_margin(sims, img, txt))[:80].mean() > 0.5  # version 3 found owners
    assert cm.copied_caption_share(sims, img, txt, min_fit=c.owner_min_fit) == 0.0
    assert cm.copied_caption_share(sims, img, txt) > 0.1
    assert cm.from_json(c.to_json(), c.bank).owner_min_fit == c.owner_min_fit


def test_an_image_that_fits_no_caption_is_not_lifted() -> None:
    """Version 4 on the image side: a placeholder photo (an embedding near no caption: a
    failed download's "image not available") has an image rival far below the sample's;
    version 3 lifted any caption on it by that gap."""
    img, txt, _ = _corpus(n=400, near=0.0)
    pad = np.zeros((400, 8), np.float32)
    img, txt = np.hstack([img, pad]), np.hstack([txt, pad])
    rng = np.random.default_rng(4)
    img[:80] = _unit(np.hstack([0.1 * rng.normal(size=(80, 32)), rng.normal(size=(80, 8))]))
    sims = (img * txt).sum(1)
    c = cm.fit_contrast(img, txt)
    assert c is not None and c.image_floor is not None and c.image_floor < 0
    assert cm.from_json(c.to_json(), c.bank).image_floor == c.image_floor
    old_adj, new_adj = replace(c, caption_floor=None, image_floor=None).adjust(sims, img, txt), c.adjust(sims, img, txt)
    assert float(new_adj[:80].mean()) < float(old_adj[:80].mean()) - 0.1
    clean = np.arange(400) >= 80
    assert roc_auc(new_adj, clean) > roc_auc(old_adj, clean) + 0.02


def test_a_junk_heavy_corpus_is_calibrated_again_with_every_random_level_pair_gated() -> None:
    """Half the photos placeholders (near no caption): more pairs fit at random level than
    p_clean's random part explains (``p_clean.unexplained_random``), so ``calibrate`` fits
    once more with ``random_fit`` set, records it, and the placeholders' p_clean falls; a
    corpus without junk (its similarities skewed, as cosines are) is calibrated once, as
    before."""
    from pairclean.calibrate.p_clean import PCleanCurve, unexplained_random

    def calibrated(img: np.ndarray, txt: np.ndarray, c: cm.Contrast) -> tuple[dict, cm.Contrast, np.ndarray]:
        sims = (img * txt).sum(1).astype(np.float32)
        cal = calibrate(beta_recipe="gmm", k=32, seed=0, weighting="p-clean", batch_size=64, similarities=sims,
                        image_emb=img, text_emb=txt, random_beta=lambda: 0.0, contrast=c)
        back = cm.from_json(cal.extra["contrast"], c.bank)
        return cal.extra, back, PCleanCurve.from_json(cal.extra["p_clean"])(back.adjust(sims, img, txt))

    img, txt, _ = _corpus(n=800, near=0.0)
    pad = np.zeros((800, 8), np.float32)
    img, txt = np.hstack([img, pad]), np.hstack([txt, pad])
    c = cm.fit_contrast(img, txt)
    assert c is not None and c.caption_floor is not None
    extra, back, _ = calibrated(img, txt, c)
    assert "random_fit" not in extra["contrast"] and back.random_fit is None  # no junk: one fit, as before
    assert unexplained_random(extra["p_clean"]["fit"]) is None and extra["p_clean"]["fit"]["random_level"]["share"] < 0.05
    rng = np.random.default_rng(6)
    junk = img.copy()
    junk[:400] = _unit(np.hstack([0.1 * rng.normal(size=(400, 32)), rng.normal(size=(400, 8))]))
    c = cm.fit_contrast(junk, txt)
    assert c is not None and c.caption_floor is not None
    first, _, p_first = calibrated(junk, txt, replace(c, random_fit=-np.inf))  # a gate that never acts: the first fit
    assert unexplained_random(first["p_clean"]["fit"]) is not None
    extra, back, p = calibrated(junk, txt, c)
    assert extra["contrast"]["version"] == 4 and back.random_fit == pytest.approx(cm.random_fit(junk, txt))
    # the gate only lowers: no placeholder reads cleaner (end to end, on Flickr8k dev photos, their
    # p_clean fell from 0.76 to 0.10 on average: docs/hard_noise.md)
    assert float(p[:400].mean()) <= float(p_first[:400].mean()) + 1e-6 and float(p[:400].mean()) < 0.3
    assert float(p[400:].mean()) > 0.5


def _with_generic_caption(carriers: int, seed: int = 7) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A clean corpus whose first ``carriers`` photos (alike: one kind of scene) all carry one
    caption that fits each of them ("a dog" on dog photos). Returns img, txt, sims."""
    img, txt, _ = _corpus(n=400, near=0.0)
    rng = np.random.default_rng(seed)
    base = rng.normal(size=32)
    img[:carriers] = _unit(base + 0.6 * rng.normal(size=(carriers, 32)))
    txt[:carriers] = _unit(base)[None, :]
    return img, txt, (img * txt).sum(1)


def _words(n: int, shared: int, count: int) -> np.ndarray:
    """Content-word counts of ``n`` captions: ``count`` for the first ``shared``, 8 (a full
    caption) for the rest."""
    words = np.full(n, 8, np.int16)
    words[:shared] = count
    return words


def test_a_short_caption_many_photos_carry_is_shared_no_owner_and_p_clean_in_the_middle() -> None:
    """A short caption on a dozen alike photos (more than ``REPEAT_CARRIERS``): whether it is right
    for each (generic alt-text) or wrong on most (a short caption pasted over look-alikes), the
    corpus cannot say. No owner (the owner rule called right ones noisy with confidence), and
    ``p_clean`` at most ``SHARED_P_CLEAN`` (exempted alone, wrong ones were called clean with
    confidence); its copies still count towards the near-miss share."""
    carriers = cm.REPEAT_CARRIERS + 2
    img, txt, sims = _with_generic_caption(carriers)
    words = _words(400, carriers, 1)
    c = cm.fit_contrast(img, txt)
    assert c is not None and c.repeat_carriers == cm.REPEAT_CARRIERS and c.repeat_max_words == cm.SHARED_CAPTION_WORDS
    assert c.shared_p_clean == cm.SHARED_P_CLEAN
    assert sims[:carriers].min() > c.owner_min_fit  # it fits each photo plausibly: only the repeat rule spares them
    margin = c.owner_margin(sims, img, txt, words=words)
    assert cm.is_shared(margin)[:carriers].all() and not cm.is_shared(margin)[carriers:].any()
    assert not cm.has_owner(margin)[:carriers].any()
    assert cm.has_owner(replace(c, repeat_carriers=None).owner_margin(sims, img, txt, words=words))[:carriers].sum() >= cm.REPEAT_CARRIERS
    # p_clean: a shared caption's at most SHARED_P_CLEAN, never raised; an owned one's odds lowered
    p = np.full(400, 0.95, np.float32)
    p[0] = 0.2
    out = cm.owner_p_clean(p, margin, c.owner_odds, c.shared_p_clean)
    assert out[0] == pytest.approx(0.2) and np.allclose(out[1:carriers], cm.SHARED_P_CLEAN)
    assert np.allclose(out[carriers:], 0.95)
    assert np.allclose(cm.owner_p_clean(p, margin, c.owner_odds), p)  # a contrast recorded without the rule caps nothing
    assert cm.copied_caption_share(sims, img, txt, min_fit=c.owner_min_fit) >= cm.REPEAT_CARRIERS / 400
    # counts unknown (a sidecar written before them): no caption is short, every owner stays
    assert cm.has_owner(c.owner_margin(sims, img, txt))[:carriers].sum() >= cm.REPEAT_CARRIERS
    # carriers must fit it better than most mismatched pairs fit theirs (repeat_min_fit): boilerplate
    # ("untitled", "photo") repeated over photos it fits at random level keeps its owners
    assert c.repeat_min_fit == max(c.owner_min_fit, cm.random_fit(img, txt))
    above = replace(c, repeat_min_fit=float(sims[:carriers].max()) + 0.01)
    assert not cm.is_shared(above.owner_margin(sims, img, txt, words=words)).any()
    assert cm.has_owner(above.owner_margin(sims, img, txt, words=words))[:carriers].sum() >= cm.REPEAT_CARRIERS
    # recorded with the contrast; a contrast recorded before the rule reads back without it
    back = cm.from_json(c.to_json(), c.bank)
    assert (back.repeat_carriers, back.repeat_max_words, back.shared_p_clean, back.repeat_min_fit) == (
        cm.REPEAT_CARRIERS, cm.SHARED_CAPTION_WORDS, cm.SHARED_P_CLEAN, c.repeat_min_fit)
    old = {k: v for k, v in c.to_json().items() if k not in ("repeat_carriers", "repeat_max_words", "shared_p_clean", "repeat_min_fit")}
    assert cm.from_json(old, c.bank).repeat_carriers is None and cm.from_json(old, c.bank).short(words, 400) is None
    for name in ("repeat_carriers", "repeat_max_words"):
        for bad in (0, -1, 2.5, "4", True):
            with pytest.raises(ValueError, match=name):
                cm.from_json({**c.to_json(), name: bad}, c.bank)
    for bad in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="shared_p_clean"):
            cm.from_json({**c.to_json(), "shared_p_clean": bad}, c.bank)


def test_a_long_caption_pasted_onto_many_look_alikes_keeps_its_owner() -> None:
    """One photo's full caption pasted onto a dozen look-alike photos it fits plausibly (the
    hard-noise kind ``pasted``) is wrong on all but its own: however many photos carry it, a
    caption of more than ``SHARED_CAPTION_WORDS`` content words keeps its owner."""
    carriers = cm.REPEAT_CARRIERS + 2
    img, txt, sims = _with_generic_caption(carriers)
    c = cm.fit_contrast(img, txt)
    assert c is not None
    for count in (cm.SHARED_CAPTION_WORDS + 1, 8):
        margin = c.owner_margin(sims, img, txt, words=_words(400, carriers, count))
        assert cm.has_owner(margin)[:carriers].sum() == carriers - 1  # all but the best-fitting photo
        assert not cm.is_shared(margin).any()
    # -1 (a row that is not ok) is never short
    assert c.short(np.full(400, -1, np.int16), 400) is not None and not c.short(np.full(400, -1, np.int16), 400).any()


def test_a_short_caption_borrowed_by_fewer_photos_than_a_repeat_keeps_its_owner() -> None:
    """A caption written for one photo and carried by a few look-alikes (a near-miss from a
    hub photo) is no repeat: the photo that fits it best still owns it, in the bank and in
    the shard alike."""
    img, txt, sims = _with_generic_caption(cm.REPEAT_CARRIERS)  # the photo itself and 9 others: below the rule
    words = _words(400, cm.REPEAT_CARRIERS + 1, 1)
    c = cm.fit_contrast(img, txt)
    assert c is not None
    margin = c.owner_margin(sims, img, txt, words=words)
    assert cm.has_owner(margin)[: cm.REPEAT_CARRIERS].sum() == cm.REPEAT_CARRIERS - 1  # all but the best-fitting photo
    assert not cm.is_shared(margin).any()
    img, txt, sims = _with_generic_caption(cm.REPEAT_CARRIERS + 1)  # one more carrier: a repeat
    c = cm.fit_contrast(img, txt)
    assert c is not None and cm.is_shared(c.owner_margin(sims, img, txt, words=words))[: cm.REPEAT_CARRIERS + 1].all()


def test_a_short_caption_copied_onto_many_photos_it_does_not_fit_keeps_its_owner() -> None:
    """Only carriers that fit the caption plausibly make it a shared caption: one photo's
    caption pasted onto a dozen unrelated photos (spam, a scraper's off-by-one) is still
    owned by that photo."""
    img, txt, _ = _corpus(n=400, near=0.0)
    pasted = np.arange(2, 2 * cm.REPEAT_CARRIERS + 6, 2)  # not photo 0's look-alike (photo 1)
    txt[pasted] = txt[0]  # photo 0's own caption on unrelated photos
    sims = (img * txt).sum(1)
    words = np.full(400, 8, np.int16)
    words[pasted], words[0] = 1, 1
    c = cm.fit_contrast(img, txt)
    assert c is not None and c.owner_min_fit is not None and sims[pasted].max() < c.owner_min_fit < sims[0]
    margin = c.owner_margin(sims, img, txt, words=words)
    assert len(pasted) > cm.REPEAT_CARRIERS and cm.has_owner(margin)[pasted].all() and not cm.has_owner(margin)[0]
    assert not cm.is_shared(margin).any()
