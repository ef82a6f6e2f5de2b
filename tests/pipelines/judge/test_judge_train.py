"""``pairclean train-judge``'s library path end to end on a tiny config: a Flickr8k-shaped
folder made from the bundled sample's photos, the tiny real estimator's regions and tokens
cached by ``build_cache``, a judge trained for one epoch, its Platt maps and dev figures."""

from __future__ import annotations

import json
import tarfile
from typing import Any
from pathlib import Path

import numpy as np
import pytest

from pairclean.embed.estimators import EstimatorSpec, load_estimator
from pairclean.judge.features import COLOUR_BINS
from pairclean.lite.judge_data import build_cache, load_split
from pairclean.lite.judge_train import JudgeRecipe, calibrated_report, fit_platts, train_judge

SAMPLE = Path(__file__).resolve().parents[3] / "pipelines" / "data" / "sample" / "demo-000000.tar"
# Captions with words the edits know (nouns, colours, numbers, actions), five per photo.
CAPTIONS = (
    "a brown dog runs on the grass", "two men ride bikes on a street", "a little girl sits on a beach",
    "a white horse stands in a field", "a man in a red hat walks in the snow",
)


def _flickr_folder(root: Path) -> Path:
    """Ten sample photos, five captions each: six in train, four in dev."""
    (root / "images").mkdir(parents=True)
    lines = []
    with tarfile.open(SAMPLE) as tar:
        photos = [m for m in tar.getmembers() if m.name.endswith(".jpg")]
        for k, member in enumerate(photos):
            name = f"{k:04d}.jpg"
            (root / "images" / name).write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
            split = "train" if k < 6 else "dev"
            for c in range(5):
                caption = CAPTIONS[(k + c) % len(CAPTIONS)]
                lines.append(json.dumps({"image": name, "caption": caption, "split": split}))
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = _flickr_folder(tmp_path_factory.mktemp("flickr"))
    cache = tmp_path_factory.mktemp("judge-cache")
    estimator = load_estimator(EstimatorSpec(model="pairclean-tiny-test", engine="torch"))
    build_cache(root, cache, estimator, batch=4, train_captions=2)
    return cache


def test_build_cache_stores_regions_tokens_edits_and_colours(cached: Path) -> None:
    train, dev = load_split(cached, "train", colours=True), load_split(cached, "dev")
    assert train.regions.shape[0] == 6 and dev.regions.shape[0] == 4 and dev.colours is None
    assert train.colours is not None and train.colours.shape == (6, train.regions.shape[1], COLOUR_BINS)
    real = train.kind == ""
    assert real.sum() == 12  # two captions per train photo
    edited = np.nonzero(~real)[0]
    assert len(edited) > 0 and (train.source[edited] >= 0).all()
    # an edit belongs to the photo of the caption it was made from, and differs from it
    assert (train.image[edited] == train.image[train.source[edited]]).all()
    assert all(train.texts[r] != train.texts[train.source[r]] for r in edited)
    assert (dev.kind == "").sum() == 20 and set(dev.kind[dev.kind != ""]) <= {"object", "attribute", "count", "action", "swap"}


@pytest.mark.parametrize("colours", [False, True])
def test_a_tiny_judge_trains_and_reports(cached: Path, colours: bool) -> None:
    train, dev = load_split(cached, "train", colours), load_split(cached, "dev", colours)
    recipe = JudgeRecipe(width=16, heads=2, epochs=1, batch=8, top_k=2, warmup=1, colours=colours)
    model, report = train_judge(train, dev, recipe)
    assert model.config.colour_bins == (COLOUR_BINS if colours else 0)
    assert len(report["history"]) == 1 and np.isfinite(report["history"][0]["loss"])
    assert {"random", "nearest_image"} <= set(report["dev"]) and report["train_pairs_per_epoch"] > 12
    platt, platt_fine = fit_platts(model, dev)
    assert np.isfinite(platt).all() and np.isfinite(platt_fine).all()
    figures = calibrated_report(model, dev, platt)
    assert all(0.0 <= row["ece"] <= 1.0 for row in figures.values())
    # one scoring of dev shared by the maps, the rates and the figures gives what each computed alone
    from pairclean.lite.judge_train import dev_scores, fine_rates

    scores = dev_scores(model, dev)
    assert fit_platts(model, dev, scores=scores) == (platt, platt_fine)
    assert fine_rates(model, dev, platt_fine, scores=scores) == fine_rates(model, dev, platt_fine)
    assert calibrated_report(model, dev, platt, scores=scores) == figures


def test_a_tiny_word_grounding_is_fitted_beside_the_judge_and_counted_in_its_maps(cached: Path, tmp_path: Path) -> None:
    import torch

    from pairclean.judge.runner import load_judge, save_judge
    from pairclean.judge.words import WordGrounding, split_words, word_scores
    from pairclean.lite.judge_train import dev_pairs, score_pairs
    from pairclean.lite.word_train import WEIGHTS, WordRecipe, fit_word_grounding

    train, dev = load_split(cached, "train"), load_split(cached, "dev")
    model, _ = train_judge(train, dev, JudgeRecipe(width=16, heads=2, epochs=1, batch=8, top_k=2, warmup=1))
    words, report = fit_word_grounding(model, train, dev, WordRecipe(epochs=2, batch=4, width=16, heads=2, layers=1, min_count=1))
    assert words.weight == report["weight"] and report["weight"] in WEIGHTS
    assert set(report["dev_mean_auc_by_weight"]) == {str(w) for w in WEIGHTS} and len(report["history"]) == 2
    # the vocabulary is that of the real train captions, never of an edit
    real = np.nonzero(train.kind == "")[0]
    assert set(words.vocab.words[3:]) == {w for r in real for w in split_words(train.texts[r])}
    # scoring with the grounding adds weight x its score to the judge's logit, as the runner does
    img, txt = dev_pairs(dev)["clean"]
    probe = WordGrounding(words.model, words.vocab, 0.5)
    added = score_pairs(model, dev, img, txt, words=probe) - score_pairs(model, dev, img, txt)
    expected = 0.5 * word_scores(probe, torch.from_numpy(dev.regions[img]), [dev.texts[t] for t in txt])
    np.testing.assert_allclose(added, expected, atol=1e-5)
    assert np.abs(expected).max() > 0
    platt, platt_fine = fit_platts(model, dev, words)
    assert np.isfinite(platt).all() and np.isfinite(platt_fine).all()
    # stored in float16 and read back, the grounding scores as it did (it was rounded before its weight was chosen)
    path = tmp_path / "with-words.safetensors"
    save_judge(str(path), model, platt, "pairclean-tiny-test", {}, words)
    loaded = load_judge(str(path))
    assert loaded.words is not None and loaded.words.weight == words.weight
    regions = torch.from_numpy(dev.regions[img])
    texts = [dev.texts[t] for t in txt]
    np.testing.assert_allclose(word_scores(loaded.words, regions, texts), word_scores(words, regions, texts), atol=1e-5)


def test_a_recipe_and_its_features_must_agree_on_colours(cached: Path) -> None:
    with pytest.raises(ValueError, match="reads colours"):
        train_judge(load_split(cached, "train"), load_split(cached, "dev"), JudgeRecipe(width=16, heads=2, epochs=1, top_k=2, colours=True))


def test_members_train_from_successive_seeds_and_average(cached: Path, tmp_path: Path) -> None:
    import torch

    from pairclean.judge.model import Judge, JudgeEnsemble
    from pairclean.judge.runner import load_judge, save_judge
    from pairclean.lite.judge_train import _tensors, train_members

    train, dev = load_split(cached, "train"), load_split(cached, "dev")
    recipe = JudgeRecipe(width=16, heads=2, epochs=1, batch=8, top_k=2, warmup=1, seed=3)
    ensemble, report = train_members(train, dev, recipe, 2)
    assert isinstance(ensemble, JudgeEnsemble) and ensemble.config.members == 2
    assert [h["member"] for h in report["history"]] == [3, 4] and report["members"] == 2
    single, _ = train_judge(train, dev, JudgeRecipe(width=16, heads=2, epochs=1, batch=8, top_k=2, warmup=1, seed=4))
    rows = np.arange(len(dev.kind))
    inputs = _tensors(dev, dev.image[rows], rows)
    with torch.inference_mode():
        members = torch.stack([m(*inputs) for m in ensemble.members])
        both = ensemble(*inputs)
        torch.testing.assert_close(both, members.mean(0))
        torch.testing.assert_close(members[1], single(*inputs))  # member k is the judge of seed SEED + k
    path = tmp_path / "ensemble.safetensors"
    save_judge(str(path), ensemble, (1.0, 0.0), "pairclean-tiny-test", {})
    loaded = load_judge(str(path))
    assert isinstance(loaded.model, JudgeEnsemble) and loaded.identity()["config"]["members"] == 2
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model(*inputs), both)
    with pytest.raises(ValueError, match="share one config"):
        JudgeEnsemble.of([single, Judge(single.config.__class__(width=32, heads=2))])
    assert isinstance(train_members(train, dev, recipe, 1)[0], Judge)


def test_train_edits_give_a_caption_edits_of_distinct_kinds_and_keep_one_edit_caches_as_they_were() -> None:
    from types import SimpleNamespace

    from pairclean.lite.judge_data import _texts_of
    from pairclean.lite.judge_train import _edits_by_source, _one_edit

    images = [SimpleNamespace(captions=list(CAPTIONS)) for _ in range(4)]
    one, three = _texts_of(images, "train", 0, 5, 1), _texts_of(images, "train", 0, 5, 3)
    real = [t for t, k in zip(one[0], one[2]) if k == ""]
    assert real == [t for t, k in zip(three[0], three[2]) if k == ""] and len(real) == 20
    by_one, by_three = _edits_by_source(np.array(one[3])), _edits_by_source(np.array(three[3]))
    assert max(len(v) for v in by_one.values()) == 1
    assert max(len(v) for v in by_three.values()) == 3 and len(by_three) == len(by_one)
    for rows in by_three.values():  # each edit of a caption is of another kind
        assert len({three[2][r] for r in rows}) == len(rows)
    # one edit per caption: no draw from the trainer's generator, so older caches train as before
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    assert _one_edit([7], rng) == 7 and _one_edit(None, rng) == -1 and rng.bit_generator.state == state
    picks = {_one_edit([1, 2, 3], rng) for _ in range(50)}
    assert picks == {1, 2, 3} and rng.bit_generator.state != state


def _four_photo_features(texts: list[str], owner: list[int], kinds: list[str], source: list[int]) -> Any:
    """``SplitFeatures`` of four photos and ``texts`` (``_texts_of``'s lists), zero features:
    for tests of which rows an epoch draws."""
    from pairclean.lite.judge_data import SplitFeatures

    n = len(texts)
    return SplitFeatures(regions=np.zeros((4, 1, 1), np.float16), image_emb=np.eye(4, dtype=np.float32),
                         tokens=np.zeros((n, 1, 1), np.float16), mask=np.ones((n, 1), bool),
                         text_emb=np.zeros((n, 4), np.float32), image=np.array(owner), kind=np.array(kinds),
                         source=np.array(source), texts=texts)


def test_two_edits_per_positive_show_both_edits_of_a_caption_each_epoch_and_never_one_twice() -> None:
    from types import SimpleNamespace

    from pairclean.judge.edits import TRAINING
    from pairclean.lite.judge_data import _texts_of
    from pairclean.lite.judge_train import _edits_by_source, _epoch_pairs, _other_edit

    images = [SimpleNamespace(captions=list(CAPTIONS)) for _ in range(4)]
    texts, owner, kinds, source = _texts_of(images, "train", 0, 5, 2, TRAINING)
    feats = _four_photo_features(texts, owner, kinds, source)
    real = np.nonzero(np.array(kinds) == "")[0]
    edit_of = _edits_by_source(feats.source)
    top = (np.zeros((len(real), 2), np.int64), np.zeros((len(real), 2), np.float32))
    img_top = (np.zeros((4, 2), np.int64), np.zeros((4, 2), np.float32))
    both = JudgeRecipe(edits_per_positive=2, random_rate=0.0)
    _, txt, labels = _epoch_pairs(feats, real, edit_of, top, img_top, both, np.random.default_rng(0))
    shown = txt[np.isin(txt, np.nonzero(feats.source >= 0)[0])]
    # every edit row of the cache is a negative exactly once in the epoch
    assert sorted(shown.tolist()) == sorted(r for rows in edit_of.values() for r in rows)
    assert (labels[np.isin(txt, shown)] == 0).all()
    _, txt1, _ = _epoch_pairs(feats, real, edit_of, top, img_top, JudgeRecipe(random_rate=0.0), np.random.default_rng(0))
    assert np.isin(txt1, shown).sum() == len(edit_of)  # one edit per caption by default
    rng = np.random.default_rng(0)
    assert _other_edit([5], 5, rng) == -1 and _other_edit([5, 6], 5, rng) == 6 and _other_edit(None, -1, rng) == -1


def test_added_negatives_give_each_caption_one_clause_or_negation_beside_its_word_edit() -> None:
    """``--added-negatives on``: the word edits stay those of a cache without additions, and
    each epoch shows each caption's word edit and one of its clause or negation edits."""
    from types import SimpleNamespace

    from pairclean.judge.additions import ADDED_KINDS
    from pairclean.lite.judge_data import _texts_of
    from pairclean.lite.judge_train import _edits_by_source, _epoch_pairs

    images = [SimpleNamespace(captions=[f"{c} {extra}" for c in CAPTIONS])
              for extra in ("on the beach", "next to a red car", "in front of a tall building", "under a blue umbrella")]
    plain = _texts_of(images, "train", 0, 5, 1)
    texts, owner, kinds, source = _texts_of(images, "train", 0, 5, 1, added=True)
    assert texts[: len(plain[0])] == plain[0] and kinds[: len(plain[2])] == plain[2]
    added = [i for i, k in enumerate(kinds) if k in ADDED_KINDS]
    assert added and {kinds[i] for i in added} <= set(ADDED_KINDS)
    for i in added:  # an edit of its own source caption, for the source's photo
        assert source[i] >= 0 and owner[i] == owner[source[i]] and texts[i] != texts[source[i]]
    feats = _four_photo_features(texts, owner, kinds, source)
    real = np.nonzero(np.array(kinds) == "")[0]
    edit_of = _edits_by_source(feats.source, feats.kind)
    added_of = _edits_by_source(feats.source, feats.kind, ADDED_KINDS)
    assert not set(edit_of.get(0, [])) & set(added_of.get(0, []))
    top = (np.zeros((len(real), 2), np.int64), np.zeros((len(real), 2), np.float32))
    img_top = (np.zeros((4, 2), np.int64), np.zeros((4, 2), np.float32))
    recipe = JudgeRecipe(random_rate=0.0, added_negatives=True)
    _, txt, labels = _epoch_pairs(feats, real, edit_of, top, img_top, recipe, np.random.default_rng(0), added_of)
    assert np.isin(txt, added).sum() == len(added_of) and (labels[np.isin(txt, added)] == 0).all()
    assert np.isin(txt, [r for rows in edit_of.values() for r in rows]).sum() == len(edit_of)


@pytest.mark.slow
def test_train_judge_from_the_shipped_judge_adds_a_grounding_and_keeps_its_weights(tmp_path: Path) -> None:
    """`pairclean train-judge --judge-from FILE --words on` on a Flickr8k-shaped folder of ten
    photos: the judge's tensors are the source's, the grounding and both maps are new, and the
    metadata says where the judge came from."""
    import torch

    from pairclean.judge.runner import default_judge_path, load_judge
    from pairclean_workers.cli import main

    root = _flickr_folder(tmp_path / "flickr")
    out = tmp_path / "judge.safetensors"
    assert main(["train-judge", "--data", str(root), "--features-cache", str(tmp_path / "cache"), "--out", str(out),
                 "--judge-from", default_judge_path(), "--words", "on", "--word-epochs", "1", "--threads", "2"]) == 0
    source, made = load_judge(None), load_judge(str(out))
    for (name, a), (_, b) in zip(source.model.state_dict().items(), made.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert made.meta["judge_from"]["sha256"] == source.sha256 and made.meta["recipe"] == source.meta["recipe"]
    assert made.meta["judge_from"]["data"]["train_captions"] == 5 and made.meta["word_recipe"]["epochs"] == 1
    assert made.words is not None or made.meta["word_report"]["weight"] == 0  # weight 0 saves the judge without it
    if made.words is not None:
        assert made.words.weight == made.meta["word_report"]["weight"] > 0
        assert set(made.words.vocab.words) <= {"<pad>", "<unk>", "<mask>"} | {w for c in CAPTIONS for w in c.split()}
    assert made.platt != source.platt


def test_train_judge_words_keep_refits_only_the_maps_and_the_mixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--judge-from FILE --words keep`: the judge's and the grounding's tensors and the
    grounding's recipe are the source's; the maps are fitted anew on this dev split, the
    provenance chain keeps the source's own `judge_from`, and the near-miss mixture is
    fitted where the dev photos give enough edits with words the judge never trained on."""
    import torch

    from pairclean.judge.posterior import FineMixture
    from pairclean.judge.runner import default_judge_path, load_judge
    from pairclean_workers.cli import main

    root = _flickr_folder(tmp_path / "flickr")
    out = tmp_path / "judge.safetensors"
    assert main(["train-judge", "--data", str(root), "--features-cache", str(tmp_path / "cache"), "--out", str(out),
                 "--judge-from", default_judge_path(), "--words", "keep", "--threads", "2"]) == 0
    source, made = load_judge(None), load_judge(str(out))
    assert source.words is not None and made.words is not None and made.words.weight == source.words.weight
    for (name, a), (_, b) in zip(source.words.model.state_dict().items(), made.words.model.state_dict().items()):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(source.model.state_dict().items(), made.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert made.meta["word_recipe"] == source.meta["word_recipe"] and made.platt != source.platt
    assert made.meta["judge_from"]["sha256"] == source.sha256 and made.meta["judge_from"]["previous"] == source.meta["judge_from"]
    printed = capsys.readouterr().out
    if "fine_mixture" in made.meta:
        assert FineMixture.from_doc(made.meta["fine_mixture"]).other_words == "extra" and "near-miss mixture: " in printed
    else:
        assert "near-miss mixture: not fitted" in printed


def test_texts_added_to_dev_are_no_edit_kind_and_the_mixture_reads_its_components_apart(cached: Path,
                                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``with_texts`` rows (the mixture's other-word edits) must not become an ``edit_added``
    kind of ``dev_pairs``: they would be scored against photo -1 and counted as own-list edits."""
    import torch

    from pairclean.judge.model import Judge, JudgeConfig
    from pairclean.judge.posterior import llr_of
    from pairclean.lite.judge_data import with_texts, word_edits
    from pairclean.lite.judge_train import dev_pairs, fine_mixture, score_pairs
    from pairclean.judge.edits import CORE

    dev = load_split(cached, "dev")
    estimator = load_estimator(EstimatorSpec(model="pairclean-tiny-test", engine="torch"))
    made = word_edits(dev, CORE)
    assert made, "the sample's captions give core edits"
    grown, rows = with_texts(dev, estimator, [m[2] for m in made])
    assert set(dev_pairs(grown)) == set(dev_pairs(dev)) and len(grown.texts) == len(dev.texts) + len(made)
    torch.manual_seed(0)
    model = Judge(JudgeConfig(text_dim=dev.tokens.shape[2], image_dim=dev.regions.shape[2], regions=dev.regions.shape[1],
                              width=16, layers=1, heads=2)).eval()
    photos = np.array([m[1] for m in made], np.int64)
    from pairclean.judge import posterior

    monkeypatch.setattr(posterior, "MIN_COMPONENT_RATIOS", 2)  # four dev photos here
    mixture = fine_mixture(model, grown, (1.0, 0.0), (photos, rows), "core")
    own = np.concatenate([score_pairs(model, dev, *v) for k, v in dev_pairs(dev).items() if k.startswith("edit_")])
    probs = (np.arange(128) + 0.5) / 128
    np.testing.assert_allclose(mixture.quantiles[1], np.quantile(llr_of(own, (1.0, 0.0)).astype(np.float64), probs), atol=1e-5)
    np.testing.assert_allclose(mixture.quantiles[2], np.quantile(llr_of(score_pairs(model, grown, photos, rows), (1.0, 0.0)).astype(np.float64), probs),
                               atol=1e-5)
