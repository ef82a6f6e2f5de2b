"""The judge's word grounding (``pairclean.judge.words``): the caption's word split, the
score of a caption (the mean of its two lowest PMIs with the photo), how the judge file
stores it, and how the runner adds it to the judge's logit, a failure staying one pair's."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pairclean.embed.estimators import EstimatorSpec, load_estimator
from pairclean.errors import ModelLoadError
from pairclean.judge.posterior import llr_of
from pairclean.judge.runner import JudgeRunner, load_judge
from pairclean.judge.words import MASK, PAD, UNK, WordConfig, WordGrounding, WordModel, WordVocab, split_words, word_scores
from pairclean.lite.word_train import WordRecipe, choose_weight, round_to_stored, train_words


@pytest.fixture(scope="module")
def tiny_estimator():
    return load_estimator(EstimatorSpec(model="pairclean-tiny-test", engine="torch"))


def _vocab() -> WordVocab:
    return WordVocab.of(["a brown dog runs on the grass", "two dogs run", "a man in a red hat"], 1)


def test_captions_split_into_known_content_words() -> None:
    vocab = _vocab()
    assert split_words("A Brown-dog, 2 CATS!") == ["a", "brown", "dog", "2", "cats"]
    ids = vocab.encode(["a brown dog runs on the zebra", "", "two " * 30], 24)
    assert ids.shape == (3, 24) and (ids[1] == PAD).all() and (ids[2] != PAD).all()  # cut at 24 words
    first = [vocab.words[i] for i in ids[0] if i not in (PAD, UNK)]
    assert first == ["a", "brown", "dog", "runs", "on", "the"] and ids[0][6] == UNK
    content = vocab.content(ids)
    assert [vocab.words[i] for i in ids[0][content[0]]] == ["brown", "dog", "runs"]  # not "a", "on", "the", nor the unknown word
    with pytest.raises(ValueError, match="starts with"):
        WordVocab(["dog", "cat"])


def _grounding(seed: int = 0) -> WordGrounding:
    torch.manual_seed(seed)
    vocab = _vocab()
    return WordGrounding(WordModel(WordConfig(vocab=len(vocab), image_dim=8, regions=4, width=16, layers=1, heads=2)).eval(), vocab, 1.0)


def test_a_caption_scores_the_mean_of_its_two_lowest_pmis() -> None:
    g = _grounding()
    regions = torch.randn(4, 4, 8)
    captions = ["a brown dog runs", "the zebra of a", "two dogs", "the dog"]
    got = word_scores(g, regions, captions)
    assert got[1] == 0.0  # no known content word: nothing to say
    # by hand: each content word hidden (all at once), log P with the photo less log P without;
    # "the dog" has one scored word, which is its score
    ids = torch.from_numpy(g.vocab.encode(captions, 24))
    for row in (0, 2, 3):
        at = torch.from_numpy(g.vocab.content(ids.numpy()))[row : row + 1]
        x = ids[row : row + 1].masked_fill(at, MASK)
        target = ids[row : row + 1][at]
        with torch.no_grad():
            lp = [g.model(x, regions[row : row + 1], torch.tensor([use]), at).log_softmax(-1)[torch.arange(len(target)), target]
                  for use in (True, False)]
        pmi = np.sort((lp[0] - lp[1]).numpy())
        assert got[row] == pytest.approx(pmi[:2].mean(), abs=1e-5)
    # scoring in batches of one changes nothing
    np.testing.assert_allclose(word_scores(g, regions, captions, batch=1), got, atol=1e-6)


def test_the_photo_moves_the_score() -> None:
    g = _grounding(1)
    regions = torch.randn(2, 4, 8)
    a = word_scores(g, regions, ["a brown dog runs", "a brown dog runs"])
    assert a[0] != pytest.approx(a[1])  # two photos, one caption: two scores


def test_a_tiny_word_model_learns_which_word_its_photo_shows() -> None:
    """Photos 0 and 1 differ in one channel; their captions in one word. After training the
    caption fits its own photo better than the other photo's (a positive PMI margin)."""
    regions = np.zeros((2, 4, 8), np.float32)
    regions[0, :, 0], regions[1, :, 1] = 3.0, 3.0
    captions = ["a brown dog runs", "a white dog runs"] * 40
    owner = np.array([0, 1] * 40)
    model, vocab, report = train_words(captions, owner, regions, WordRecipe(epochs=30, batch=16, width=16, heads=2, layers=1,
                                                                             min_count=1, mask_rate=0.5, lr=3e-3))
    assert [h["epoch"] for h in report["history"]] == list(range(1, 31)) and report["vocabulary"] == len(vocab)
    g = WordGrounding(round_to_stored(model), vocab, 1.0)
    own = word_scores(g, torch.from_numpy(regions), ["a brown dog runs", "a white dog runs"])
    swapped = word_scores(g, torch.from_numpy(regions[::-1].copy()), ["a brown dog runs", "a white dog runs"])
    assert (own > swapped + 0.1).all()


def test_choose_weight_takes_the_weight_that_ranks_best() -> None:
    rng = np.random.default_rng(0)
    judge = {"clean": rng.normal(1, 1, 200), "edit": rng.normal(0, 1, 200)}
    helpful = {"clean": rng.normal(1, 0.3, 200), "edit": rng.normal(-1, 0.3, 200)}
    weight, by_weight = choose_weight(judge, helpful)
    assert weight > 0 and by_weight[str(weight)] == max(by_weight.values())
    noise = {"clean": rng.normal(0, 1, 200), "edit": rng.normal(0, 1, 200)}
    judge_sharp = {"clean": rng.normal(3, 1, 200), "edit": rng.normal(-3, 1, 200)}
    assert choose_weight(judge_sharp, noise)[0] <= 0.2


def test_the_judge_file_keeps_its_word_grounding(tmp_path: Path, tiny_judge) -> None:
    with_words = load_judge(str(tiny_judge(tmp_path / "w.safetensors", words=0.5)))
    assert with_words.words is not None and with_words.words.weight == 0.5
    ident = with_words.identity()["words"]
    assert ident["weight"] == 0.5 and ident["config"]["vocab"] == len(with_words.words.vocab)
    assert "word_vocab" not in with_words.meta  # the vocabulary is the grounding's, not metadata shown as such
    assert load_judge(str(tiny_judge(tmp_path / "plain.safetensors"))).words is None
    # a file whose grounding tensors lost their config is refused in one line
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as fh:
        meta = dict(fh.metadata())
    del meta["word_config"]
    save_file(load_file(str(tmp_path / "w.safetensors")), str(tmp_path / "broken.safetensors"), metadata=meta)
    with pytest.raises(ModelLoadError, match="not a pairclean judge file"):
        load_judge(str(tmp_path / "broken.safetensors"))


def _rewrite(src: Path, dst: Path, **changes: str) -> Path:
    """``src`` with some metadata values replaced (the tensors kept)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(src), framework="pt") as fh:
        meta = dict(fh.metadata())
    save_file(load_file(str(src)), str(dst), metadata={**meta, **changes})
    return dst


@pytest.mark.parametrize("key, change, message", [
    ("word_config", {"heads": 3}, "width 16 in 3 heads"),  # torch would assert, with a traceback
    ("word_config", {"vocab": 10**9}, "word vocabulary of"),  # never built: checked against the stored vocabulary
    ("word_config", {"width": 4096, "heads": 4}, "tensor embed.weight is not"),  # nor against the stored tensors
    ("word_config", {"layers": 10**6}, "layers"),
    ("judge_config", {"heads": 3}, "width 16 in 3 heads"),
    ("judge_config", {"width": 10**6}, "judge config width must be a whole number in 1-4096"),
    ("fine_rates", None, "not a pairclean judge file"),  # metadata that is not JSON
    ("fine_mixture", {"bandwidths": [0.3, 0.3]}, "bandwidths are not 3 numbers"),
    ("fine_mixture", {"components": {"clean": [1.0], "edits": [0.0], "other": list(range(2000))}}, "component 'other' is not"),
    ("fine_mixture", {"min_gain": float("nan")}, "min_gain holds a number that is not finite"),
    ("fine_mixture", {"min_gain": 10**400}, "min_gain holds a number too large"),
    ("platt", None, "not a pairclean judge file"),
])
def test_a_hostile_judge_file_is_one_line_and_builds_nothing_big(tmp_path: Path, tiny_judge, key: str, change, message: str) -> None:
    import json

    from safetensors import safe_open

    from pairclean.judge.posterior import FineMixture

    rng = np.random.default_rng(0)
    mixture = FineMixture.of({"clean": rng.normal(1, 1, 50), "edits": rng.normal(-1, 1, 50), "other": rng.normal(0, 1, 50)}, "extra", 2.0)
    src = tiny_judge(tmp_path / "w.safetensors", words=0.5, fine_rates=(0.8, 0.3), fine_mixture=mixture.to_doc())
    assert load_judge(str(src)).identity()["fine_mixture"] == mixture.to_doc()  # as written, before it is spoilt
    with safe_open(str(src), framework="pt") as fh:
        value = fh.metadata()[key]
    if key == "platt":  # a Platt map whose slope is a JSON integer too large for a float
        new = "[1" + "0" * 400 + ", 0.0]"
    else:
        new = "{" if change is None else json.dumps({**json.loads(value), **change})
    with pytest.raises(ModelLoadError, match="not a pairclean judge file") as caught:
        load_judge(str(_rewrite(src, tmp_path / "hostile.safetensors", **{key: new})))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def _batch(estimator, n: int) -> tuple[torch.Tensor, list[str]]:
    gen = torch.Generator().manual_seed(0)
    pixels = torch.rand((n, 3, estimator.image_size, estimator.image_size), generator=gen)
    return pixels, ["a dog runs on grass", "two men on a street", "a red car", "of the", "a cat sits", "the blue ball"][:n]


def test_the_runner_adds_the_weighted_grounding_to_the_judges_logit(tmp_path: Path, tiny_estimator, tiny_judge) -> None:
    from pairclean.judge.features import image_parts

    judged = load_judge(str(tiny_judge(tmp_path / "w.safetensors", words=0.7)))
    plain = load_judge(str(tmp_path / "w.safetensors"))
    plain.words = None
    pixels, texts = _batch(tiny_estimator, 6)
    with_words = JudgeRunner(judged, tiny_estimator).encode_batch(pixels, texts)
    without = JudgeRunner(plain, tiny_estimator).encode_batch(pixels, texts)
    assert judged.words is not None
    with torch.no_grad():
        _, regions = image_parts(tiny_estimator.model, pixels)
    expected = llr_of(np.zeros(6, np.float32) + 0.7 * word_scores(judged.words, regions.float(), texts), judged.platt) \
        - llr_of(np.zeros(6, np.float32), judged.platt)
    np.testing.assert_allclose(with_words.llr - without.llr, expected, atol=1e-4)
    assert np.abs(with_words.llr - without.llr).max() > 1e-4 and with_words.llr[3] == pytest.approx(without.llr[3], abs=1e-5)
    # judging a band (pairs 1, 3 and 5 here, not a prefix): each judged pair gets its own caption's grounding
    sims = np.einsum("nd,nd->n", with_words.image_emb, with_words.text_emb)
    pick = np.zeros(6, bool)
    pick[[1, 3, 5]] = True
    banded = JudgeRunner(judged, tiny_estimator).with_band((float(sims[pick].min()) - 1e-6, math.inf)).encode_batch(pixels, texts)
    judged_rows = np.isfinite(banded.llr)
    assert judged_rows.any() and not judged_rows.all()
    np.testing.assert_allclose(banded.llr[judged_rows], with_words.llr[judged_rows], atol=1e-5)


class _FailsOnThe(WordModel):
    """A real word model that fails on any scored caption holding the word "the" (which it
    sees: content words are hidden from it), a stand-in for any per-pair failure."""

    the = -1

    def forward(self, ids, regions, use_image, at):  # type: ignore[override]
        if (ids == self.the).any():
            raise RuntimeError("no articles here")
        return super().forward(ids, regions, use_image, at)


def test_a_grounding_failure_is_that_pairs_error_only(tmp_path: Path, tiny_estimator, tiny_judge) -> None:
    loaded = load_judge(str(tiny_judge(tmp_path / "w.safetensors", words=1.0)))
    assert loaded.words is not None
    failing = _FailsOnThe(loaded.words.model.config)
    failing.load_state_dict(loaded.words.model.state_dict())
    failing.the = loaded.words.vocab.index["the"]
    loaded.words = WordGrounding(failing.eval(), loaded.words.vocab, 1.0)
    pixels, texts = _batch(tiny_estimator, 6)
    out = JudgeRunner(loaded, tiny_estimator).encode_batch(pixels, texts)
    for text, llr, err in zip(texts, out.llr, out.errors):
        if text == "the blue ball":  # "of the" has no content word: not scored, so not failed
            assert np.isnan(llr) and err is not None and "no articles here" in err
        else:
            assert np.isfinite(llr) and err is None
