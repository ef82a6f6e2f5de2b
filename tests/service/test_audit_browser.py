"""The audit's labelling page in a real browser (Debian's headless Chromium, Playwright), on a
real scored job: a person labels 20 pairs with the keyboard and sees the estimate.

Skips without ``/usr/bin/chromium`` or the ``playwright`` package (as test_pages_browser.py).
``PAIRCLEAN_SCREENSHOTS=docs/screenshots`` saves the README's screenshots of the page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_pages_browser import CHROMIUM, SHOTS, Watched
from test_pages_browser import browser  # noqa: F401  (the one launch of Chromium, shared as a fixture)

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed (pip install '.[test]')")
if not CHROMIUM.exists():
    pytest.skip(f"no browser: {CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)

pytestmark = pytest.mark.slow


def _ready(page) -> str:
    page.wait_for_selector('#labeller[data-state="ready"]', timeout=120_000)
    page.wait_for_function("() => { const i = document.getElementById('audit-image'); return i.complete && i.naturalWidth > 0; }",
                           timeout=60_000)
    return page.get_attribute("figure.audit-pair", "data-key")


def _progress(page) -> int:
    return int(page.inner_text('[data-audit="progress"]').split(" of ")[0])


def test_label_20_pairs_with_the_keyboard_and_see_the_estimate(browser, demo_service) -> None:  # noqa: F811 (fixture)
    job = demo_service.audit_job("audit-browser")
    watched = Watched(browser, demo_service.url, demo_service.keys["team-a"])
    page = watched.page
    watched.visit(f"/ui/jobs/{job}/audit", settle=False)
    assert page.locator("main h1").inner_text().startswith("Audit")

    # a label, then Backspace: the same pair comes back and the count goes down again
    key = _ready(page)
    page.keyboard.press("u")
    page.wait_for_function("() => document.querySelector('[data-audit=\"progress\"]').textContent.startsWith('1 of')")
    _ready(page)
    page.keyboard.press("Backspace")
    page.wait_for_function("() => document.querySelector('[data-audit=\"progress\"]').textContent.startsWith('0 of')")
    assert _ready(page) == key

    seen: list[str] = []
    while _progress(page) < 20:
        key = _ready(page)
        seen.append(key)
        before = page.inner_text('[data-audit="progress"]')
        page.keyboard.press("n" if key in demo_service.swapped else "c")
        page.wait_for_function("before => document.querySelector('[data-audit=\"progress\"]').textContent !== before", arg=before)
        assert len(seen) < 40
    summary = page.inner_text('[data-audit="summary"]')
    found = re.match(r"noise rate (\d+\.\d)% \[(\d+\.\d), (\d+\.\d)\] \(95%, 20 pairs labelled\)", summary)
    assert found, summary
    estimate, lower, upper = (float(g) / 100 for g in found.groups())
    assert lower <= 0.4 <= upper and lower <= estimate <= upper  # 12 of the 30 pairs are swapped
    assert len(seen) > 20  # a blind repeat came back (the labeller answered it the same way)
    if SHOTS:
        _ready(page)
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / "audit.png"), full_page=True)

    # the job page shows the figures once labels exist
    watched.visit(f"/ui/jobs/{job}")
    section = page.locator("section#audit")
    assert section.count() == 1
    assert page.inner_text('[data-audit="noise-rate"]').startswith(f"{100 * estimate:.1f}%")
    assert section.locator("svg.reliability circle").count() >= 1
    assert "100.0%" in section.inner_text()  # self-agreement on the repeats
    if SHOTS:
        section.screenshot(path=str(Path(SHOTS) / "audit-figures.png"))
    assert watched.problems == []
    watched.close()


def test_another_tenant_cannot_open_the_labelling_page(browser, demo_service) -> None:  # noqa: F811 (fixture)
    job = demo_service.job_id
    other = Watched(browser, demo_service.url, demo_service.keys["team-b"])
    for path in (f"/ui/jobs/{job}/audit", f"/ui/jobs/{job}/audit/next.json", f"/ui/jobs/{job}/audit/labels.csv"):
        assert other.page.goto(f"{demo_service.url}{path}").status == 404, path
    other.close()
