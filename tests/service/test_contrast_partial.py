"""The job page's corpus-contrast sentence (``templates/_contrast.html``) for every shape of
contrast record a job's calibration can hold (off, version 2 without owners, version 3 with
them, version 4 with its gate), and its p_clean mixture sentences (``templates/_mixture.html``),
rendered as the app renders them (StrictUndefined)."""

from __future__ import annotations

from importlib import resources

import pytest

jinja2 = pytest.importorskip("jinja2")

OFF = {"contrast_rows": None, "owner_odds": None, "caption_floor": None, "random_fit": None, "shared_p_clean": None,
       "repeat_max_words": None, "repeat_carriers": None}
V2 = {**OFF, "contrast_rows": 4096}
V3 = {**V2, "owner_odds": 0.1}
V4 = {**V3, "caption_floor": -0.153}


def _render(why: dict) -> str:
    folder = resources.files("pairclean_service") / "templates"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), autoescape=True, undefined=jinja2.StrictUndefined)
    return " ".join(env.get_template("_contrast.html").render(why=why).split())


@pytest.mark.parametrize("why, says, owner, gate", [
    (OFF, "Corpus contrast: off: weights read the similarity.", False, False),
    (V2, "a bank of 4,096 calibration pairs", False, False),
    (V3, "keeps 0.1 of its odds of being clean", True, False),
    (V4, "a caption that fits no photo well (its best fit elsewhere more than 0.153 below the sample's)", True, True),
    ({**V4, "caption_floor": 0.0}, "more than 0.000 below", True, True),  # never "-0.000"
    ({**V4, "random_fit": 0.0999}, "a <b>junk-heavy</b> corpus", True, True),
    ({**V4, "shared_p_clean": 0.6, "repeat_max_words": 2, "repeat_carriers": 10},
     "unless its caption is a <i>shared</i> one (at most 2 content words, carried by 10 or more other photos that fit it: "
     "\"a dog\"), whose <code>p_clean</code> is at most 0.6", True, True),
])
def test_the_contrast_sentence_reads_every_record_shape(why: dict, says: str, owner: bool, gate: bool) -> None:
    text = _render(why)
    assert text.startswith('<p data-why="contrast">Corpus contrast:') and says in text
    assert ("better <i>owner</i>" in text) == owner
    assert ("a photo that fits no caption well (a placeholder)" in text) == gate
    assert "-0.000" not in text
    assert ("junk-heavy" in text) == (why["random_fit"] is not None)
    if why["random_fit"] is not None:
        assert "(below 0.100) is lifted only as far as it beats each rival" in text


def _render_mixture(why: dict) -> str:
    from pairclean_service.routers.pages import _pct

    folder = resources.files("pairclean_service") / "templates"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), autoescape=True, undefined=jinja2.StrictUndefined)
    return " ".join(env.get_template("_mixture.html").render(why=why, pct=_pct).split())


@pytest.mark.parametrize("why, shares, warns", [
    ({"mixture_noise": None, "unexplained_random": None}, False, False),
    ({"mixture_noise": (0.2, 0.05), "unexplained_random": None}, True, False),
    ({"mixture_noise": (0.13, 0.0), "unexplained_random": 0.276}, True, True),
])
def test_the_mixture_sentences_warn_where_random_level_pairs_go_unexplained(why: dict, shares: bool, warns: bool) -> None:
    text = _render_mixture(why)
    assert ('data-why="mixture-noise"' in text) == shares
    assert ('data-why="junk"' in text) == warns
    if warns:
        assert "27.6% of the calibration pairs fit no better than most random pairs" in text
