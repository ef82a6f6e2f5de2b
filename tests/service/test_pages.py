"""The web pages over real HTTP (uvicorn on loopback, httpx) against a real scored job:
sessions, tenancy, CSRF, thumbnails and their allow-list, placeholders, escaping, filters.

The same pages in a real browser: test_pages_browser.py.
"""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("jinja2")

from pairclean.lite.evaldata import write_shard  # noqa: E402

pytestmark = pytest.mark.slow

PAGES = ["/ui/jobs/{id}", "/ui/jobs/{id}/gallery", "/ui/jobs/{id}/gallery?kind=borderline", "/ui/jobs/{id}/shards/demo-000000"]


def _login(service, owner: str = "team-a", url: str | None = None) -> httpx.Client:
    client = httpx.Client(base_url=url or service.url)
    r = client.post("/ui/login", data={"api_key": service.keys[owner]})
    assert r.status_code == 303 and r.headers["location"] == "/ui/jobs", r.text
    return client


def _keys_on(html: str) -> list[str]:
    return re.findall(r'data-key="([^"]*)"', html)


def test_every_page_needs_a_session(demo_service) -> None:
    anonymous = httpx.Client(base_url=demo_service.url)
    bearer = {"Authorization": f"Bearer {demo_service.keys['team-a']}"}  # an API key header is not a session
    for path in ["/ui/jobs", *(p.format(id=demo_service.job_id) for p in PAGES)]:
        for headers in ({}, bearer):
            r = anonymous.get(path, headers=headers)
            assert r.status_code == 303 and r.headers["location"].startswith("/ui/login?next="), path
    for path in ["/ui/jobs.json", f"/ui/jobs/{demo_service.job_id}/progress.json", f"/ui/jobs/{demo_service.job_id}/thumbs/demo-000000/0"]:
        assert anonymous.get(path).status_code == 401, path
    # a forged or stale cookie is no session
    anonymous.cookies.set("pairclean_session", "x" * 43, path="/ui")
    assert anonymous.get("/ui/jobs").status_code == 303
    # the root leads a new user to the login
    assert anonymous.get("/").headers["location"] == "/ui/jobs"


def test_login_sets_a_strict_cookie_and_logout_revokes_it(demo_service) -> None:
    client = httpx.Client(base_url=demo_service.url)
    bad = client.post("/ui/login", data={"api_key": "pc_not-a-key"})
    assert bad.status_code == 401 and "not valid" in bad.text and "set-cookie" not in bad.headers
    assert "pc_not-a-key" not in bad.text  # never echoed
    r = client.post("/ui/login", data={"api_key": demo_service.keys["team-a"], "next": f"/ui/jobs/{demo_service.job_id}"})
    assert r.status_code == 303 and r.headers["location"] == f"/ui/jobs/{demo_service.job_id}"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert demo_service.keys["team-a"] not in cookie  # the key never becomes the cookie
    token = client.cookies.get("pairclean_session")
    assert client.get("/ui/jobs").status_code == 200
    assert client.post("/ui/logout").status_code == 303
    # the server forgot the session: the old cookie, sent again, no longer works
    replay = httpx.Client(base_url=demo_service.url, cookies={"pairclean_session": token})
    assert replay.get("/ui/jobs").status_code == 303


def test_cross_site_posts_and_open_redirects_are_refused(demo_service) -> None:
    client = httpx.Client(base_url=demo_service.url)
    form = {"api_key": demo_service.keys["team-a"]}
    assert client.post("/ui/login", data=form, headers={"Origin": "http://evil.example"}).status_code == 403
    assert client.post("/ui/login", data=form, headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert client.post("/ui/login", json=form).status_code == 415
    for target in ("//evil.example/x", "https://evil.example/", "/ui/../v1/jobs", "/\\evil.example"):
        r = client.post("/ui/login", data={**form, "next": target})
        assert r.headers["location"] == "/ui/jobs", target
    logged_in = _login(demo_service)
    assert logged_in.post("/ui/logout", headers={"Origin": "http://evil.example"}).status_code == 403
    assert logged_in.get("/ui/jobs").status_code == 200  # still logged in
    assert logged_in.get("/ui/logout").status_code == 405  # no state-changing GET


def test_pages_render_with_security_headers(demo_service) -> None:
    client = _login(demo_service)
    for path in ["/ui/jobs", *(p.format(id=demo_service.job_id) for p in PAGES)]:
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
        assert "script-src 'self'" in r.headers["content-security-policy"] and "'unsafe-inline'" not in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
        assert r.headers["cache-control"] == "no-store"
    job = client.get(f"/ui/jobs/{demo_service.job_id}").text
    assert "<svg" in job and "β = " in job and "random-inputs" in job and "demo-000000" in job
    # the demo's 10 pairs are too few for the corpus contrast (16): the page says what weights read
    assert 'data-why="contrast"' in job and "Corpus contrast: off: weights read the similarity" in job
    # the judge ran (pairclean-lite's default) but 10 pairs are too few to trust its word check
    assert 'data-why="judge"' in job and "its word check is left out of p_clean (10 judged calibration pairs, fewer than 100" in job
    assert not [p for p in httpx.get(f"{demo_service.url}/openapi.json").json()["paths"] if p.startswith("/ui") or p == "/"]


def test_lowest_weight_gallery_starts_with_the_swapped_pairs(demo_service) -> None:
    html = _login(demo_service).get(f"/ui/jobs/{demo_service.job_id}/gallery").text
    keys = _keys_on(html)
    assert len(keys) == 10
    assert set(keys[: len(demo_service.swapped)]) == set(demo_service.swapped)
    # captions come from the tar: the astronaut was given the cat's caption
    assert "An orange cat sits on the floor" in html


def test_another_tenant_gets_404_and_an_admin_sees_the_job(demo_service) -> None:
    other = _login(demo_service, "team-b")
    assert demo_service.job_id not in other.get("/ui/jobs").text
    for path in [*PAGES, "/ui/jobs/{id}/progress.json", "/ui/jobs/{id}/thumbs/demo-000000/0"]:
        r = other.get(path.format(id=demo_service.job_id))
        assert r.status_code == 404, path
        assert str(demo_service.root) not in r.text
    assert demo_service.job_id not in other.get("/ui/jobs.json").text
    admin = _login(demo_service, "ops")
    assert demo_service.job_id in admin.get("/ui/jobs").text
    assert admin.get(f"/ui/jobs/{demo_service.job_id}").status_code == 200


def test_thumbnails_are_small_images_from_the_jobs_own_shards(demo_service) -> None:
    from PIL import Image

    client = _login(demo_service)
    base = f"/ui/jobs/{demo_service.job_id}/thumbs"
    r = client.get(f"{base}/demo-000000/0")
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg" and r.headers["x-pairclean-image"] == "thumbnail"
    assert r.headers["x-content-type-options"] == "nosniff"
    with Image.open(io.BytesIO(r.content)) as img:
        assert max(img.size) <= 192 and img.format == "JPEG"
    # a row past the end: a placeholder image, not an error page
    r = client.get(f"{base}/demo-000000/99")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png" and r.headers["x-pairclean-image"].startswith("placeholder")
    # only the job's own committed shards, by stem: names of other files are refused
    for stem in ("other", "..%2F..%2Fetc%2Fpasswd", "demo-000000.tar", "%2Ftmp%2Fdemo-000000"):
        assert client.get(f"{base}/{stem}/0").status_code == 404, stem
    assert client.get(f"{base}/demo-000000/-1").status_code == 422


def test_thumbnails_follow_todays_allow_list(demo_service, live_server_cls, tmp_path: Path) -> None:
    """A service whose input allow-list no longer holds the job's shards shows placeholders
    (and never reads the shard), though the job and its table are still there."""
    db = f"sqlite:///{demo_service.root / 'jobs.db'}"
    with live_server_cls(tmp_path, database_url=db, allowed_inputs=[str(tmp_path)], allowed_outputs=[str(demo_service.root)]) as narrow:
        client = _login(demo_service, url=narrow.url)
        r = client.get(f"/ui/jobs/{demo_service.job_id}/thumbs/demo-000000/0")
        assert r.status_code == 200 and r.headers["x-pairclean-image"] == "placeholder: image unreadable or not allowed"
        html = client.get(f"/ui/jobs/{demo_service.job_id}/gallery").text
        assert "caption not recorded" in html and "An orange cat" not in html
    # ... and one whose output allow-list no longer holds the job's folder reads nothing of it
    with live_server_cls(tmp_path, database_url=db, allowed_outputs=[str(tmp_path)]) as narrow:
        client = _login(demo_service, url=narrow.url)
        r = client.get(f"/ui/jobs/{demo_service.job_id}/gallery")
        assert r.status_code == 409 and "no longer resolves where it did" in r.text and "An orange cat" not in r.text


def test_shard_filters_are_validated(demo_service) -> None:
    client = _login(demo_service)
    page = f"/ui/jobs/{demo_service.job_id}/shards/demo-000000"
    assert len(_keys_on(client.get(page).text)) == 10
    noisy = _keys_on(client.get(page, params={"noisy": "yes", "status": "ok"}).text)
    assert sorted(noisy) == sorted(demo_service.swapped)
    clean = _keys_on(client.get(page, params={"noisy": "no", "weight_min": 0.0001}).text)
    assert len(clean) == 10 - len(noisy) and not set(clean) & set(noisy)
    assert _keys_on(client.get(page, params={"status": "decode_error"}).text) == []
    for bad in ({"status": "<script>"}, {"noisy": "maybe"}, {"weight_min": 2}, {"weight_max": "nan"}, {"offset": -1}):
        r = client.get(page, params=bad)
        assert r.status_code == 422 and r.headers["content-type"].startswith("text/html"), bad
        assert "<script>" not in r.text
    assert client.get(f"/ui/jobs/{demo_service.job_id}/gallery", params={"page": 1000}).status_code == 422
    assert client.get(f"/ui/jobs/{demo_service.job_id}/gallery", params={"kind": "random"}).status_code == 422


def _hostile_shard(folder: Path, image: bytes) -> Path:
    return write_shard(folder / "hostile-000000.tar", [
        {"__key__": "hostile/<b>0</b>", "jpg": image, "txt": '<script>alert("caption")</script> & <img src=x onerror=alert(1)>'},
        {"__key__": "hostile/1", "jpg": b"\xff\xd8 not really a jpeg", "txt": "a corrupt image"},
        {"__key__": "hostile/2", "txt": "no image at all"},
        {"__key__": "hostile/3", "jpg": image, "txt": "a good one"},
    ])


def test_hostile_captions_are_escaped_and_bad_images_get_placeholders(demo_service) -> None:
    from pairclean.read.shards import iter_pairs

    folder = demo_service.root / "hostile"
    image = next(iter(iter_pairs(str(demo_service.shard)))).image  # a real JPEG
    shard = _hostile_shard(folder, image)
    job = demo_service.submit([str(shard)], str(folder / "out"), estimator="pairclean-tiny-test")
    demo_service.wait(job)
    client = _login(demo_service)
    html = client.get(f"/ui/jobs/{job}/shards/hostile-000000").text
    assert "<script>alert" not in html and "<img src=x" not in html and "<b>0</b>" not in html
    assert "&lt;script&gt;alert(&#34;caption&#34;)&lt;/script&gt; &amp; &lt;img src=x onerror=alert(1)&gt;" in html
    kinds = {row: client.get(f"/ui/jobs/{job}/thumbs/hostile-000000/{row}").headers["x-pairclean-image"] for row in range(3)}
    assert kinds == {0: "thumbnail", 1: "placeholder: image cannot be decoded", 2: "placeholder: no image member recorded"}
    # the shard is gone (moved away after scoring): placeholders and a page, never an error
    shutil.move(shard, folder / "moved.tar")
    fresh = client.get(f"/ui/jobs/{job}/thumbs/hostile-000000/3")  # row 3 was never fetched: not cached
    assert fresh.status_code == 200 and fresh.headers["x-pairclean-image"] == "placeholder: image unreadable or not allowed"
    assert client.get(f"/ui/jobs/{job}").status_code == 200


def test_tables_without_member_columns_show_placeholders(demo_service) -> None:
    """Score tables written before the member columns existed: pages work, no thumbnails."""
    import pyarrow.parquet as pq

    from pairclean import schema

    folder = demo_service.root / "old"
    folder.mkdir()
    shard = shutil.copy(demo_service.shard, folder / "old-000000.tar")
    job = demo_service.submit([str(shard)], str(folder / "out"), estimator="pairclean-tiny-test")
    demo_service.wait(job)
    table_path = folder / "out" / "old-000000.parquet"
    table = pq.read_table(table_path)
    pq.write_table(table.drop_columns(list(schema.MEMBER_COLUMNS)), table_path)  # as an older pairclean wrote it
    client = _login(demo_service)
    for path in (f"/ui/jobs/{job}", f"/ui/jobs/{job}/gallery", f"/ui/jobs/{job}/shards/old-000000"):
        assert client.get(path).status_code == 200, path
    assert "caption not recorded" in client.get(f"/ui/jobs/{job}/gallery").text
    r = client.get(f"/ui/jobs/{job}/thumbs/old-000000/0")
    assert r.headers["x-pairclean-image"] == "placeholder: the score table records no image offsets"


def test_progress_json_reports_the_jobs_numbers(demo_service) -> None:
    client = _login(demo_service)
    items = client.get(f"/ui/jobs/{demo_service.job_id}/progress.json").json()["items"]
    assert items[0]["state"] == "SUCCEEDED"
    assert items[0]["fields"]["shards"] == "1 / 1" and items[0]["fields"]["pairs"] == "10"
    listed = client.get("/ui/jobs.json").json()["items"]
    assert demo_service.job_id in [j["id"] for j in listed]


def test_serve_demo_queues_the_sample_and_prints_its_page_and_a_key(tmp_path: Path) -> None:
    """A new user's path: `pairclean serve --demo`, open the printed page, log in with the
    printed key, and the swapped pairs lead the gallery."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import threading
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PAIRCLEAN_DATABASE_URL": f"sqlite:///{tmp_path / 'jobs.db'}", "PAIRCLEAN_EXECUTOR": "local",
           "PAIRCLEAN_POLL_INTERVAL_S": "0.2"}
    proc = subprocess.Popen([sys.executable, "-m", "pairclean_service.cli", "serve", "--demo", "--port", str(port), "--state-dir",
                             str(tmp_path / "state")], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining: a full pipe would block the server
        page = re.search(r"open (http://127\.0\.0\.1:\d+/ui/jobs/[0-9a-f-]+)", "".join(lines))
        assert page, lines
        key = lines[2].strip()
        assert key.startswith("pc_")
        base = f"http://127.0.0.1:{port}"
        client = httpx.Client(base_url=base)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert client.post("/ui/login", data={"api_key": key, "next": "/ui/demo"}).headers["location"] == "/ui/demo"
        job_path = client.get("/ui/demo").headers["location"]
        assert f"{base}{job_path}" == page.group(1)
        deadline = time.time() + 600
        while client.get(f"{job_path}/progress.json").json()["items"][0]["state"] != "SUCCEEDED":
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.5)
        keys = _keys_on(client.get(f"{job_path}/gallery").text)
        assert set(keys[:4]) == {"skimage/astronaut", "skimage/chelsea", "skimage/camera", "skimage/horse"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def test_a_failed_job_without_tables_still_has_pages(demo_service) -> None:
    import time

    folder = demo_service.root / "broken"
    folder.mkdir()
    (folder / "broken-000000.tar").write_bytes(b"this is not a tar archive" * 100)
    job = demo_service.submit([str(folder / "broken-000000.tar")], str(folder / "out"), estimator="pairclean-tiny-test")
    client = _login(demo_service)
    seen_running = client.get(f"/ui/jobs/{job}")  # queued or running: no tables yet
    assert seen_running.status_code == 200
    deadline = time.time() + 300
    while client.get(f"/ui/jobs/{job}/progress.json").json()["items"][0]["state"] in ("QUEUED", "RUNNING"):
        assert time.time() < deadline
        time.sleep(0.3)
    html = client.get(f"/ui/jobs/{job}").text
    assert "FAILED" in html and "No shard is committed yet" in html and "Quarantined shards" in html and "broken-000000" in html
    assert "No pairs to show yet" in client.get(f"/ui/jobs/{job}/gallery").text
    assert client.get(f"/ui/jobs/{job}/shards/broken-000000").status_code == 404  # quarantined: no table to list


def test_a_job_without_any_ok_pair_has_a_page_not_a_500(demo_service) -> None:
    folder = demo_service.root / "no-ok"
    folder.mkdir()
    # One shard with only failed rows (no image, an undecodable one), one empty shard.
    write_shard(folder / "failed-000000.tar", [{"__key__": "a", "txt": "no image"}, {"__key__": "b", "jpg": b"not a jpeg", "txt": "x"}])
    write_shard(folder / "empty-000000.tar", [])
    job = demo_service.submit([str(folder / "failed-000000.tar"), str(folder / "empty-000000.tar")], str(folder / "out"),
                              estimator="pairclean-tiny-test")
    demo_service.wait(job)
    client = _login(demo_service)
    r = client.get(f"/ui/jobs/{job}")
    assert r.status_code == 200 and "No ok pair in the committed shards" in r.text

