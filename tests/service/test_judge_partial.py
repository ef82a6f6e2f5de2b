"""The job page's judge sentence (``templates/_judge.html``) for every shape of judge record a
job's calibration can hold, rendered as the app renders it (StrictUndefined): a record
written before a key existed must not break the page."""

from __future__ import annotations

from importlib import resources

import pytest

jinja2 = pytest.importorskip("jinja2")

from pairclean_service.routers.pages import _pct  # noqa: E402

CHECK = {"mode": "all", "platt_fine": [0.5, 1.4], "fine_rates": [0.8, 0.3]}


def _render(judge: dict | None) -> str:
    folder = resources.files("pairclean_service") / "templates"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), autoescape=True, undefined=jinja2.StrictUndefined)
    return " ".join(env.get_template("_judge.html").render(why={"judge": judge}, pct=_pct).split())


@pytest.mark.parametrize("judge, says", [
    (None, "Judge: off."),
    ({"mode": "band"}, "p_clean is its posterior where it judged"),
    ({**CHECK, "fine_prior": None, "fine_off": "too few pairs"}, "its word check is left out of p_clean (too few pairs)"),
    # a job calibrated before the near-miss mixture: no fine_mixture_fit at all
    ({**CHECK, "fine_prior": 0.9}, "(corpus share with every word right: 90.0%)"),
    ({**CHECK, "fine_prior": 0.9, "fine_mixture_fit": None}, "(corpus share with every word right: 90.0%)"),
    ({**CHECK, "fine_prior": 0.9, "fine_mixture_fit": {"shares": [0.6, 0.1, 0.3], "gain": 3.0, "used": False}},
     "(corpus share with every word right: 90.0%)"),
    ({**CHECK, "fine_prior": 0.9, "fine_mixture_fit": {"shares": [0.6, 0.1, 0.3], "gain": 30.0, "used": True}},
     "under the near-miss mixture (every word right 60.0%, wrong in the judge's own words 10.0%, in words it never saw changed 30.0%)"),
])
def test_the_judge_sentence_reads_every_record_shape(judge: dict | None, says: str) -> None:
    text = _render(judge)
    assert says in text and text.startswith('<p data-why="judge">Judge:')
    assert ("near-miss mixture" in text) == bool(judge and (judge.get("fine_mixture_fit") or {}).get("used"))
