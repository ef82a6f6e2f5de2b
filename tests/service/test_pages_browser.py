"""The web pages in a real browser: Debian's headless Chromium driven by Playwright, against
the real app on loopback and a real job scored from the bundled demo sample.

Never ``playwright install``: the browser is the system's ``/usr/bin/chromium``
(``apt-get install chromium``; ``.ci/run`` installs it). Without it, or without the
``playwright`` package, these tests skip and say why.

Set ``PAIRCLEAN_SCREENSHOTS=docs/screenshots`` to save a screenshot of each page (the
README shows them); CI leaves it unset so the tree stays clean.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"no browser: {CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed (pip install '.[test]')")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.slow

# Flags for a headless browser in a container with no network to reach: no sandbox (root in
# CI), no GPU, and none of the background traffic Chromium starts on its own.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
SHOTS = os.environ.get("PAIRCLEAN_SCREENSHOTS")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


class Watched:
    """A logged-in page whose console errors, page errors and failed requests are kept."""

    def __init__(self, browser, base: str, key: str | None) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 860})
        self.page = self.context.new_page()
        self.base, self.problems = base, []
        self.page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        # ERR_ABORTED: a load the browser itself cancelled because the page navigated on
        self.page.on("requestfailed", lambda r: self.problems.append(f"request failed: {r.url} {r.failure}")
                     if r.failure != "net::ERR_ABORTED" else None)
        self.page.on("response", lambda r: self.problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
        if key is not None:
            self.page.goto(f"{base}/")
            self.page.fill("#api_key", key)
            self.page.click("button[type=submit]")
            self.page.wait_for_url(f"{base}/ui/jobs")

    def visit(self, path: str, shot: str | None = None, settle: bool = True):
        response = self.page.goto(f"{self.base}{path}")
        if settle:  # a page polling for progress never goes network-idle
            self.page.wait_for_load_state("networkidle")
        if shot and SHOTS:
            Path(SHOTS).mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(Path(SHOTS) / f"{shot}.png"), full_page=True)
        return response

    def close(self) -> None:
        self.context.close()


def test_pages_load_without_console_errors(browser, demo_service) -> None:
    if SHOTS:
        login = Watched(browser, demo_service.url, None)
        login.visit("/", "login")
        login.close()
    watched = Watched(browser, demo_service.url, demo_service.keys["team-a"])
    job = demo_service.job_id
    for path, shot in [("/ui/jobs", "jobs"), (f"/ui/jobs/{job}", "job"), (f"/ui/jobs/{job}/gallery", "gallery-lowest"),
                       (f"/ui/jobs/{job}/gallery?kind=borderline", "gallery-borderline"),
                       (f"/ui/jobs/{job}/shards/demo-000000?noisy=yes", "shard")]:
        assert watched.visit(path, shot).status == 200, path
        assert watched.page.locator("main h1").count() == 1, path
    # every thumbnail on the shard page was decoded by the browser
    widths = watched.page.eval_on_selector_all("table.rows img", "imgs => imgs.map(i => i.complete && i.naturalWidth)")
    assert widths and all(w and w > 0 for w in widths)
    assert watched.problems == []
    watched.close()


def test_the_planted_swapped_pairs_come_first_in_the_lowest_weight_gallery(browser, demo_service) -> None:
    watched = Watched(browser, demo_service.url, demo_service.keys["team-a"])
    watched.visit(f"/ui/jobs/{demo_service.job_id}/gallery")
    cards = watched.page.locator("figure.pair")
    keys = cards.evaluate_all("cards => cards.map(c => c.dataset.key)")
    first = keys[: len(demo_service.swapped)]
    assert set(first) == set(demo_service.swapped), keys
    for i in range(len(first)):
        card = cards.nth(i)
        assert "noisy" in card.get_attribute("class")
        assert card.locator("img").evaluate("i => i.complete && i.naturalWidth > 0")
    assert watched.problems == []
    watched.close()


def test_a_second_tenant_cannot_reach_the_job_by_url(browser, demo_service) -> None:
    other = Watched(browser, demo_service.url, demo_service.keys["team-b"])
    other.visit("/ui/jobs")
    assert demo_service.job_id not in other.page.content()
    job = demo_service.job_id
    for path in (f"/ui/jobs/{job}", f"/ui/jobs/{job}/gallery", f"/ui/jobs/{job}/shards/demo-000000",
                 f"/ui/jobs/{job}/thumbs/demo-000000/0"):
        response = other.page.goto(f"{demo_service.url}{path}")
        assert response.status == 404, path
        assert str(demo_service.root) not in other.page.content()
    other.close()


def test_progress_updates_while_a_job_runs(browser, demo_service) -> None:
    """The job list updates itself (no reload) as a real job moves through its shards."""
    folder = demo_service.root / "progress"
    folder.mkdir()
    shards = [str(shutil.copy(demo_service.shard, folder / f"copy-{i:06d}.tar")) for i in range(6)]
    job = demo_service.submit(shards, str(folder / "out"), estimator="pairclean-tiny-test", options={"batch_size": 2})
    watched = Watched(browser, demo_service.url, demo_service.keys["team-a"])
    watched.visit("/ui/jobs", settle=False)
    page = watched.page
    row = f'tr[data-job="{job}"]'
    assert page.locator(row).count() == 1
    first_state = page.locator(f'{row} [data-field="state"]').inner_text()
    assert first_state in ("QUEUED", "RUNNING")
    # Record every text the progress cells take, and mark the document: a reload would lose the mark.
    page.evaluate("""row => {
        window.__seen = [];
        window.__kept = true;
        const cells = document.querySelectorAll(row + ' [data-field]');
        const note = () => window.__seen.push(Array.from(cells).map(c => c.textContent).join('|'));
        note();
        new MutationObserver(note).observe(document.querySelector(row), {subtree: true, childList: true, characterData: true});
    }""", row)
    page.wait_for_function("row => document.querySelector(row + ' [data-field=\"state\"]').textContent === 'SUCCEEDED'", arg=row,
                           timeout=300_000)
    seen = page.evaluate("window.__seen")
    assert page.evaluate("window.__kept === true")  # updated in place
    states = [s.split("|")[0] for s in seen]
    done = [s.split("|")[1] for s in seen]
    assert states[-1] == "SUCCEEDED" and done[-1] == "6 / 6"
    assert len(set(seen)) >= 2 and len(set(done)) >= 2, seen
    assert watched.problems == []
    watched.close()
