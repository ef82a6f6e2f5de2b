"""The threat model of the service, as tests: hostile and broken input against the real
service over real HTTP (uvicorn on loopback, a real SQLite job store).

Each test is one threat: what an attacker or a careless user sends, and what they get.
Threats whose defence lives below the service are tested beside that code; they are
listed here so this table is the whole model.

Boundary (what a request may hold)
  Unknown callers reach no job route (no key, wrong key: 401) ........ test_authentication
  NUL, control characters, lone surrogates, NaN/Infinity, bad JSON: 422, never 500,
  never echoing the input ............................................ test_hostile_fields_are_422_never_500_and_never_echoed
  A job that cannot start (NUL in its output) blocks the queue ....... test_job_that_cannot_start_fails_clearly_and_the_next_one_runs
  A shard list too long for one command line ......................... test_shard_specs_go_to_the_job_through_a_list_file

Bounded work per request
  A chunked (or huge) body, before any key is checked: 413 ........... test_body_limit_holds_for_chunked_bodies_before_authentication
  Many slow bodies held before any key is checked (1.5 MB each) ...... test_serve_caps_the_connections_it_holds
  Brace and glob bombs, stopped while expanding ...................... test_brace_and_glob_limits_are_enforced_while_expanding
                                                                       (and tests/pipelines/test_uris.py::test_shard_limit_is_enforced_while_expanding)
  Slow or many :validate calls starving /healthz, /metrics, jobs ..... test_slow_validations_are_bounded_and_never_starve_the_other_routes
  45 submissions of slow shard specs taking every route's threads .... test_slow_submissions_never_starve_the_other_routes
  :validate reading a whole shard or member into memory .............. test_validate_reads_a_bounded_prefix
  A 1 GiB tar member in the scoring workers .......................... tests/pipelines/test_shards.py::test_member_over_the_limit_is_a_too_large_row_and_the_rest_still_reads

The allow-list decides on what will actually be touched
  Schemes, pipes, credentials in URIs (never echoed), paths outside,
  ``..``, an output that is a file ................................... test_refused_locations
  Symlinks, ``..`` and percent-escapes leading outside; existence of
  files outside never revealed ....................................... test_symlinks_dotdot_and_percent_escapes_cannot_leave_the_allow_list
  ``s3://laion`` admitting ``s3://laion-private/`` ................... test_remote_prefixes_match_on_segment_boundaries
  HTTP(S) redirects to places not allowed ............................ test_http_redirects_are_followed_only_to_allowed_urls

Tenants
  Another owner's job: get, shards, logs, cancel, retry, lists,
  idempotency keys; admins see all ................................... test_jobs_belong_to_their_owner_and_admins_see_all
  The admin role is set when the key is created ...................... test_apikey_admin_flag
  Two jobs writing to one output (any spelling of it): 409 ........... test_two_jobs_never_write_to_one_output

Broken shards are not silently short (tests/pipelines/test_shards.py)
  Truncated shards, corrupt headers .................................. test_shard_cut_at_a_member_boundary_is_an_error_not_a_shorter_shard,
                                                                       test_truncated_and_non_tar_shards_raise_naming_the_uri
  Duplicate keys and link members .................................... test_duplicate_keys_fields_and_link_members_become_status_rows
  16-bit PNGs clipped ................................................ test_sixteen_bit_png_keeps_its_tones_instead_of_clipping
  Pixel bombs ........................................................ test_pixel_bomb_is_refused_without_decoding
  16-bit pictures rescaled whole in float64 (1.7 GB) .................. test_sixteen_bit_png_is_rescaled_without_float_copies_of_the_picture
  A sample of FIFO or device members left out of the table ........... test_a_sample_of_fifo_or_device_members_is_a_row_not_skipped
  Progressive-JPEG scan bombs (42 s a 319 kB image), marker floods
  (2.2 GB) ........................................................... test_jpeg_scan_and_marker_bombs_are_refused_before_decoding
  PNG chunk and GIF comment floods (2.85 GB) ......................... test_png_chunk_and_gif_comment_floods_are_refused_before_opening
  ICO decoding 169 MP inside Image.open; any of PIL's 40 formats ..... test_only_web_image_formats_are_opened_whatever_the_extension
  A warning per bad Exif tag printed for every image ................. test_decoder_warnings_never_reach_the_log

No raw tracebacks for users
  An output that is an existing file on the CLI: one line, exit 1 .... tests/workers/test_score_cli.py::test_bad_input_gives_clear_errors_and_exit_codes
  A job process that crashes: job.error is its last line, no stack ... test_a_crashed_job_reports_one_line_not_its_stack

Hardening round 3 (issue 25)
  Thumbnail decode bombs (12 x 7999x7999 PNGs took the API to 5.5 GB): a pixel cap
  checked from the header at the decode scale, process-wide decode slots ....... test_thumbnail_decode_bombs_are_refused_and_bounded
  A stalled upstream (Range requests that never answer) starving /healthz and
  /v1/jobs through thumbnails: their own pool, 503 past a queue, one deadline
  per request that also cuts the connection .................................. test_a_stalled_upstream_never_starves_the_api_through_thumbnails
  :validate slots held for minutes past the deadline by a stalled read ........ test_validation_slots_are_freed_at_the_deadline
  A glob wildcard matching a symlinked folder (in/l*nk/p*) naming files
  outside the allow-list ..................................................... test_globs_never_go_through_symlinked_folders
  Tenant B submitting into tenant A's (finished) output folder and reading
  A's shards, captions and images through B's job; a 409 naming A's job ...... test_an_output_folder_belongs_to_the_tenant_that_made_it,
                                                                               test_two_jobs_never_write_to_one_output
  A 630-byte JPEG whose header claims 7990x8000 pixels scoring ok ............. test_thumbnail_decode_bombs_are_refused_and_bounded
  uvicorn's access log keeping ?api_key= values ............................... test_the_access_log_never_keeps_keys_from_query_strings
  /docs and /redoc loading unpinned CDN scripts on the pages' origin; API
  replies without a policy ..................................................... test_no_cdn_docs_and_every_reply_carries_a_policy
  The API process holding torch (building the CLI parser imported it) ......... tests/security/test_hostile_tables.py::test_the_api_process_never_loads_torch
  Hostile output folders through the real CLI (tests/security/test_hostile_tables.py):
    NaN embeddings: refine a constant score or sklearn's traceback ........... test_refine_refuses_nan_embeddings_and_rewrites_nothing
    NaN embeddings in pseudo-pair's pool ..................................... test_pseudo_pair_leaves_nan_rows_out_of_its_pool
    NaN/inf/null/negative/1e30 weights into export (NaN in strict JSON) ....... test_export_refuses_non_finite_or_foreign_weights,
                                                                               test_export_writes_strict_json
    Corrupt Parquet, a wrong schema, a cut job.json, an edited spec in
    export / refine / pseudo-pair: one line naming the file .................. test_damaged_folders_are_one_line_errors_naming_the_file
    "File too large" naming no file ........................................... test_a_write_over_the_file_size_limit_names_the_file
    WeightStage fed NaN/null/inf/negative/huge weights, duplicate keys, a
    table of another shard ..................................................... test_weight_stage_refuses_damaged_tables
    WeightStage(w_cap=NaN), default=NaN, WeightedSampler(num_samples=-1) ...... test_stage_and_sampler_parameters_must_be_finite
  Ctrl-C during a slow HTTP read quarantining a healthy shard (exit 3) ......... tests/security/test_cli_interrupts.py::test_ctrl_c_during_a_slow_http_read_exits_130_and_quarantines_nothing

The job lifecycle and the store
  Illegal state moves (a cancelled job revived, a queued one "succeeding") test_the_store_refuses_moves_the_lifecycle_does_not_allow
  An old database losing jobs or keys on upgrade, or a migration applied
  twice on restart ................................................... tests/service/test_migrations.py::test_pre_alembic_databases_are_adopted_and_keep_their_rows
  Replicas starting together migrating one database twice ............ tests/service/test_migrations.py::test_processes_starting_together_on_one_fresh_file,
                                                                       tests/service/test_store_postgres.py::test_replicas_starting_together_migrate_once
"""

from __future__ import annotations

import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402

from pairclean_service.app import create_app  # noqa: E402
from pairclean_service.runner import score_command  # noqa: E402
from pairclean_service.security import UriRefused, check_uri, hash_key, new_api_key  # noqa: E402
from pairclean_service.settings import ServiceSettings  # noqa: E402
from pairclean_service.store import JobStore  # noqa: E402


class Live:
    """A service on loopback with its own settings and three keys: alice, bob, admin."""

    def __init__(self, root: Path, **overrides: object) -> None:
        fields: dict[str, object] = dict(database_url=f"sqlite:///{root / 'jobs.db'}", allowed_inputs=[str(root / "in")],
                                         allowed_outputs=[str(root / "out")], executor="local", poll_interval_s=0.2)
        fields.update(overrides)
        self.settings = ServiceSettings(**fields)  # type: ignore[arg-type]
        self.app = create_app(self.settings, state_dir=root / "state")
        self.keys = {}
        for name, admin in (("alice", False), ("bob", False), ("admin", True)):
            key = new_api_key()
            self.app.state.store.add_key(hash_key(key), name, admin=admin)
            self.keys[name] = {"Authorization": f"Bearer {key}"}
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Live:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def post(self, path: str, who: str = "alice", **kwargs: object) -> httpx.Response:
        kwargs.setdefault("headers", self.keys[who])
        return httpx.post(f"{self.url}{path}", timeout=30, **kwargs)  # type: ignore[arg-type]

    def get(self, path: str, who: str = "alice", **kwargs: object) -> httpx.Response:
        kwargs.setdefault("headers", self.keys[who])
        return httpx.get(f"{self.url}{path}", timeout=30, **kwargs)  # type: ignore[arg-type]


def _shard(path: Path, n: int = 3, big_member: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            for ext, data in (("jpg", b"\xff" * (big_member or 10)), ("txt", b"a caption")):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    with Live(tmp_path, max_running_jobs=0) as srv:  # jobs stay QUEUED: these tests are about the API
        yield srv


# -- 1. validation at the boundary ----------------------------------------------------------

def test_authentication(live: Live) -> None:
    assert httpx.get(f"{live.url}/healthz").status_code == 200
    assert httpx.get(f"{live.url}/readyz").status_code == 200
    for path in ("/v1/jobs", "/v1/jobs/x", "/v1/jobs/x/logs", "/v1/jobs/x/shards"):
        assert httpx.get(f"{live.url}{path}").status_code == 401, path
    bad = httpx.get(f"{live.url}/v1/jobs", headers={"Authorization": "Bearer pc_wrong"})
    assert bad.status_code == 401 and bad.headers["www-authenticate"] == "Bearer"
    assert httpx.post(f"{live.url}/v1/jobs", json={"shards": ["x"], "output": "y"}, headers={"Authorization": "Basic pc_x"}).status_code == 401
    assert live.get("/v1/jobs").status_code == 200


MARKER = "SECRET-MARKER-7f3a"


@pytest.mark.parametrize("raw", [
    '{"shards": ["IN/a.tar"], "output": "OUT/o\\u0000x", "estimator": "%s"}',       # NUL byte
    '{"shards": ["IN/a\\u001b[2J.tar"], "output": "OUT/o", "estimator": "%s"}',     # control character
    '{"shards": ["IN/\\ud800.tar"], "output": "OUT/o", "estimator": "%s"}',          # lone surrogate
    '{"shards": ["IN/a.tar"], "output": "OUT/o", "options": {"max_failed_fraction": NaN}, "estimator": "%s"}',
    '{"shards": ["IN/a.tar"], "output": "OUT/o", "options": {"shard_timeout": Infinity}, "estimator": "%s"}',
    '{"shards": ["IN/a.tar"], "output": "OUT/o", "\\ud800%s": 1}',                      # hostile field name
    '{"shards": ["IN/a.tar"], "output": "OUT/o", "estimator": "%s", ',                  # not JSON
])
def test_hostile_fields_are_422_never_500_and_never_echoed(live: Live, tmp_path: Path, raw: str) -> None:
    body = raw.replace("IN", str(tmp_path / "in")).replace("OUT", str(tmp_path / "out")) % MARKER
    for path in ("/v1/jobs", "/v1/jobs:validate"):
        r = live.post(path, content=body.encode("utf-8", "surrogatepass"), headers={**live.keys["alice"], "content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert MARKER not in r.text and "Traceback" not in r.text
    bad_key = live.post("/v1/jobs", json={"shards": ["x"], "output": "y"}, headers={**live.keys["alice"], "Idempotency-Key": "a b"})
    assert bad_key.status_code == 422


def test_job_that_cannot_start_fails_clearly_and_the_next_one_runs(tmp_path: Path, make_shards) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    shards = make_shards(n_shards=1, per_shard=4, folder=tmp_path / "in")
    with Live(tmp_path) as srv:
        # A job stored before these checks (or by another replica) whose output holds a NUL:
        # the process cannot even start. It used to stay first in the queue for ever.
        broken, _ = srv.app.state.store.create({"shards": [str(shards[0])], "output": str(tmp_path / "out" / "a\x00b"),
                                                "estimator": "pairclean-tiny-test", "beta_recipe": "auto", "weighting": "paper",
                                                "options": {}}, "alice", None, 1)
        r = srv.post("/v1/jobs", json={"shards": [str(shards[0])], "output": str(tmp_path / "out" / "good"),
                                       "estimator": "pairclean-tiny-test"})
        assert r.status_code == 201, r.text
        good = r.json()["id"]
        deadline = time.time() + 240
        while time.time() < deadline and srv.get(f"/v1/jobs/{good}").json()["state"] in ("QUEUED", "RUNNING"):
            time.sleep(0.3)
        failed = srv.get(f"/v1/jobs/{broken.id}").json()
        assert failed["state"] == "FAILED" and "could not start" in failed["error"]
        assert srv.get(f"/v1/jobs/{good}").json()["state"] == "SUCCEEDED"
        # The shard specs travelled in a list file in the service's state folder, not in argv.
        assert (tmp_path / "state" / "shard-lists" / f"{good}.txt").read_text().split() == [str(shards[0])]


def test_a_crashed_job_reports_one_line_not_its_stack(tmp_path: Path) -> None:
    from pairclean_service.runner import _tail

    log = tmp_path / "job.log"
    log.write_text('Traceback (most recent call last):\n  File "/srv/app/secret_module.py", line 3, in run\n'
                   "    do()\nNotADirectoryError: [Errno 20] Not a directory: 'out/_pairclean/lock.json'\n")
    error = _tail(log)
    assert error == "job process failed: NotADirectoryError: [Errno 20] Not a directory: 'out/_pairclean/lock.json'"
    assert "secret_module" not in error and "\n" not in error


def test_shard_specs_go_to_the_job_through_a_list_file(tmp_path: Path) -> None:
    specs = [f"/data/{'x' * 2000}-{i}.tar" for i in range(2000)]  # 4 MB: over the kernel's argv limit
    cmd = score_command({"shards": specs, "output": "/o", "estimator": "e", "beta_recipe": "auto", "weighting": "paper"},
                        ServiceSettings(), shard_list=tmp_path / "l.txt")
    assert sum(len(a) for a in cmd) < 10_000 and f"@{tmp_path / 'l.txt'}" in cmd


# -- 2. bounded work per request --------------------------------------------------------------

def test_body_limit_holds_for_chunked_bodies_before_authentication(live: Live) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"shards": ["'
        for _ in range(300):
            yield b"x" * 10_000  # 3 MB in all, never announced in a Content-Length
        yield b'"], "output": "/o"}'

    r = httpx.post(f"{live.url}/v1/jobs", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "x" * 100 not in r.text  # no key needed to be refused, nothing echoed
    r = httpx.post(f"{live.url}/v1/jobs", content=b"{" + b" " * 2_000_000 + b"}", timeout=30)
    assert r.status_code == 413
    assert httpx.get(f"{live.url}/healthz").status_code == 200
    # counted (the metrics middleware, inside the limit, never saw them: no series at all)
    assert 'pairclean_http_requests_total{code="4xx",route="refused_body"} 2.0' in httpx.get(f"{live.url}/metrics").text


def test_brace_and_glob_limits_are_enforced_while_expanding(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    for i in range(6):
        _shard(tmp_path / "in" / f"s-{i}.tar", n=1)
    with Live(tmp_path, max_running_jobs=0, max_shards=5) as srv:
        started = time.perf_counter()
        r = srv.post("/v1/jobs", json={"shards": [str(tmp_path / "in" / "s-{0..999999999}{0..99999}.tar")], "output": str(tmp_path / "out" / "o")})
        assert r.status_code == 422 and "more than 5 shards" in r.json()["detail"]
        assert time.perf_counter() - started < 10
        r = srv.post("/v1/jobs", json={"shards": [str(tmp_path / "in" / "*.tar")], "output": str(tmp_path / "out" / "o")})
        assert r.status_code == 422 and "more than 5 shards" in r.json()["detail"]
        r = srv.post("/v1/jobs", json={"shards": [str(tmp_path / "in" / "s-{0..4}.tar")], "output": str(tmp_path / "out" / "o")})
        assert r.status_code == 201, r.text


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves /allowed/slow.tar (a few bytes per second), /allowed/redirect.tar (-> /secret/)
    and /secret/x.tar, counting the requests that reach /secret/."""

    secret_hits = 0

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path.startswith("/secret/"):
            type(self).secret_hits += 1
            self._send(_shard_bytes())
        elif self.path == "/allowed/redirect.tar":
            self.send_response(302)
            self.send_header("Location", "/secret/x.tar")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/allowed/ok.tar":
            self._send(_shard_bytes())
        elif self.path == "/allowed/slow.tar":
            data = _shard_bytes(n=200)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                for i in range(0, len(data), 512):
                    self.wfile.write(data[i : i + 512])
                    self.wfile.flush()
                    time.sleep(0.25)
            except (BrokenPipeError, ConnectionResetError):
                pass
        else:
            self.send_error(404)

    def _send(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def _shard_bytes(n: int = 3) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(n):
            for ext, data in (("jpg", b"\xff" * 10), ("txt", b"a caption")):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def origin(loopback_http) -> str:
    return str(loopback_http(_Handler))


def test_slow_validations_are_bounded_and_never_starve_the_other_routes(tmp_path: Path, origin: str) -> None:
    (tmp_path / "out").mkdir()
    with Live(tmp_path, max_running_jobs=0, allowed_inputs=[f"{origin}/allowed"], validate_concurrency=1,
              validate_timeout_s=2.0) as srv:
        body = {"shards": [f"{origin}/allowed/slow.tar"], "output": str(tmp_path / "out" / "o")}
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(srv.post("/v1/jobs:validate", json=body))) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        for path in ("/healthz", "/metrics", "/v1/jobs"):  # answered at once while validations read
            started = time.perf_counter()
            assert srv.get(path).status_code == 200
            assert time.perf_counter() - started < 1.5, path
        for t in threads:
            t.join()
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) >= 1 and set(codes) <= {200, 429}
        done = next(r.json() for r in results if r.status_code == 200)
        assert any("read only the first 2 s" in p for p in done["problems"]), done


def test_slow_submissions_never_starve_the_other_routes(tmp_path: Path) -> None:
    """Expanding a submission's shard specs ran on the threads that serve every route (40):
    42 submissions of a brace product of globs (65,536 patterns a spec, each refused only at
    the expansion deadline) held /healthz and another tenant's job list for 8 s. They now
    expand in their own pool (``submit_concurrency``) and wait for it at most the deadline."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    _shard(tmp_path / "in" / "evil-000000.tar", n=1)
    spec = str(tmp_path / "in" / "evil-000000.ta[r]") + "{,}" * 16
    with Live(tmp_path, max_running_jobs=0, validate_timeout_s=3.0, submit_concurrency=2) as srv:
        body = {"shards": [spec] * 3, "output": str(tmp_path / "out" / "never")}
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(srv.post("/v1/jobs", json=body))) for _ in range(45)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        for path, who in (("/healthz", "alice"), ("/v1/jobs", "bob")):  # answered at once while 45 expand
            started = time.perf_counter()
            assert srv.get(path, who=who).status_code == 200
            assert time.perf_counter() - started < 1.5, path
        for t in threads:
            t.join()
    codes = sorted(r.status_code for r in results)
    assert set(codes) <= {422, 429} and codes.count(429) >= 30, codes  # 2 at a time for 3 s: most wait, then 429
    refused = next(r for r in results if r.status_code == 429)
    assert refused.headers["retry-after"] == "5" and "too many submissions" in refused.text


def test_validate_reads_a_bounded_prefix(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    shard = _shard(tmp_path / "in" / "big.tar", n=4, big_member=300_000)
    with Live(tmp_path, max_running_jobs=0, validate_max_bytes=200_000) as srv:
        r = srv.post("/v1/jobs:validate", json={"shards": [str(shard)], "output": str(tmp_path / "out" / "o")})
        assert r.status_code == 200, r.text
        report = r.json()
        assert report["statuses"].get("too_large", 0) >= 1 or report["samples"] == 0
        assert any("read only the first 200000 bytes" in p for p in report["problems"])


# -- 3. the allow-list decides on what will actually be touched -----------------------------

@pytest.mark.parametrize("shard,output", [
    ("file:///etc/passwd", None), ("/etc/passwd", None), ("pipe:curl http://x | cat", None),
    ("{root}/in/../../etc/passwd", None), ("s3://user:secret@bucket/x.tar", None), ("{root}/in/a#b.tar", None),
    (None, "/etc/pairclean-out"), (None, "{root}/in/o"), (None, "{root}/out/a-file"),
])
def test_refused_locations(live: Live, tmp_path: Path, shard: str | None, output: str | None) -> None:
    (tmp_path / "out" / "a-file").write_text("not a folder")  # an output that is a file: refused up front
    body = {"shards": [(shard or "{root}/in/x.tar").format(root=tmp_path)], "output": (output or "{root}/out/o").format(root=tmp_path)}
    r = live.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    assert "Traceback" not in r.text and "secret" not in r.text


def test_symlinks_dotdot_and_percent_escapes_cannot_leave_the_allow_list(live: Live, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    _shard(outside / "exists.tar")
    (tmp_path / "in" / "link").symlink_to(outside)
    os.symlink(outside / "exists.tar", tmp_path / "in" / "file-link.tar")
    (tmp_path / "out" / "outlink").symlink_to(outside)
    out = str(tmp_path / "out" / "o")
    cases = [
        {"shards": [str(tmp_path / "in" / "link" / "exists.tar")], "output": out},
        {"shards": [str(tmp_path / "in" / "link" / "*.tar")], "output": out},
        {"shards": [str(tmp_path / "in" / "*.tar")], "output": out},                       # a match that is a symlink
        {"shards": [str(tmp_path / "in" / "file-link.tar")], "output": out},
        {"shards": ["@" + str(tmp_path / "in" / "link" / "list.txt")], "output": out},
        {"shards": [str(tmp_path / "in" / "x.tar")], "output": str(tmp_path / "out" / "outlink" / "o")},
        {"shards": [str(tmp_path / "in" / "x.tar")], "output": str(tmp_path / "out" / "%2e%2e" / "o")},
        {"shards": [str(tmp_path / "in" / "x.tar")], "output": str(tmp_path / "out" / "%73vcout")},
    ]
    for body in cases:
        r = live.post("/v1/jobs", json=body)
        assert r.status_code == 422, (body, r.text)
        assert str(outside) not in r.text and "elsewhere" not in r.text  # the target is never named
    assert not (tmp_path / "out" / "%73vcout").exists() and not (tmp_path / "out" / "svcout").exists()
    # Existing and missing files outside answer alike: nothing is learnt about them.
    seen = live.post("/v1/jobs", json={"shards": [str(tmp_path / "in" / "link" / "exists.tar")], "output": out}).json()["detail"]
    unseen = live.post("/v1/jobs", json={"shards": [str(tmp_path / "in" / "link" / "nope.tar")], "output": out}).json()["detail"]
    assert seen.replace("exists", "nope") == unseen


def test_remote_prefixes_match_on_segment_boundaries(tmp_path: Path) -> None:
    check_uri("s3://laion/x.tar", ["s3://laion"])
    for uri in ("s3://laion-private/x.tar", "s3://laion/../laion-private/x.tar", "S3://other/x.tar"):
        with pytest.raises(UriRefused):
            check_uri(uri, ["s3://laion"])
    (tmp_path / "out").mkdir()
    with Live(tmp_path, max_running_jobs=0, allowed_inputs=["s3://laion"]) as srv:
        r = srv.post("/v1/jobs", json={"shards": ["s3://laion-private/x.tar"], "output": str(tmp_path / "out" / "o")})
        assert r.status_code == 422
        assert srv.post("/v1/jobs", json={"shards": ["s3://laion/x.tar"], "output": str(tmp_path / "out" / "o")}).status_code == 201


def test_http_redirects_are_followed_only_to_allowed_urls(tmp_path: Path, origin: str) -> None:
    (tmp_path / "out").mkdir()
    with Live(tmp_path, max_running_jobs=0, allowed_inputs=[f"{origin}/allowed"]) as srv:
        ok = srv.post("/v1/jobs:validate", json={"shards": [f"{origin}/allowed/ok.tar"], "output": str(tmp_path / "out" / "o")}).json()
        assert ok["samples"] == 3 and ok["problems"] == []
        r = srv.post("/v1/jobs:validate", json={"shards": [f"{origin}/allowed/redirect.tar"], "output": str(tmp_path / "out" / "o")})
        assert r.status_code == 200 and r.json()["samples"] == 0
        assert any("redirects outside the allowed locations" in p for p in r.json()["problems"])
        assert "secret" not in r.text and _Handler.secret_hits == 0  # the target was never requested


# -- 4. tenants --------------------------------------------------------------------------------

def test_jobs_belong_to_their_owner_and_admins_see_all(live: Live, tmp_path: Path) -> None:
    shard = _shard(tmp_path / "in" / "a.tar")
    body = {"shards": [str(shard)], "output": str(tmp_path / "out" / "alice")}
    r = live.post("/v1/jobs", json=body, headers={**live.keys["alice"], "Idempotency-Key": "same-key"})
    assert r.status_code == 201
    job = r.json()["id"]
    for method, path in (("get", f"/v1/jobs/{job}"), ("get", f"/v1/jobs/{job}/shards"), ("get", f"/v1/jobs/{job}/logs"),
                         ("post", f"/v1/jobs/{job}:cancel"), ("post", f"/v1/jobs/{job}:retry")):
        r = getattr(live, method)(path, who="bob")
        assert r.status_code == 404 and r.json()["detail"] == getattr(live, method)(path.replace(job, "0" * 36), who="bob").json()["detail"].replace("0" * 36, job)
    assert live.get("/v1/jobs", who="bob").json()["total"] == 0
    assert live.get("/v1/jobs", who="alice").json()["total"] == 1
    assert live.get("/v1/jobs", who="admin").json()["total"] == 1
    assert live.get(f"/v1/jobs/{job}", who="admin").status_code == 200
    assert live.get(f"/v1/jobs/{job}/logs", who="alice").status_code == 200
    # Idempotency keys are per owner: bob's "same-key" is a new job of his own.
    bob_body = {"shards": [str(shard)], "output": str(tmp_path / "out" / "bob")}
    r = live.post("/v1/jobs", who="bob", json=bob_body, headers={**live.keys["bob"], "Idempotency-Key": "same-key"})
    assert r.status_code == 201 and r.json()["id"] != job
    assert live.get("/v1/jobs", who="admin").json()["total"] == 2


def test_two_jobs_never_write_to_one_output(live: Live, tmp_path: Path) -> None:
    shard = _shard(tmp_path / "in" / "a.tar")
    first = live.post("/v1/jobs", json={"shards": [str(shard)], "output": str(tmp_path / "out" / "o")}).json()["id"]
    for spelling in (str(tmp_path / "out" / "o"), str(tmp_path / "out" / "o") + "/", "file://" + str(tmp_path / "out" / "o")):
        r = live.post("/v1/jobs", json={"shards": [str(shard)], "output": spelling})  # the owner learns which job holds it
        assert r.status_code == 409 and first in r.json()["detail"], r.text
        r = live.post("/v1/jobs", who="bob", json={"shards": [str(shard)], "output": spelling})  # another tenant does not
        assert r.status_code == 409 and first not in r.text, r.text
    assert live.post(f"/v1/jobs/{first}:cancel").json()["state"] == "CANCELLED"
    # The folder stays alice's after her job ended: bob may not write into it (nor read it back).
    r = live.post("/v1/jobs", who="bob", json={"shards": [str(shard)], "output": str(tmp_path / "out" / "o")})
    assert r.status_code == 409 and "another owner" in r.json()["detail"] and first not in r.text
    assert live.post("/v1/jobs", json={"shards": [str(shard)], "output": str(tmp_path / "out" / "o")}).status_code == 201


def test_apikey_admin_flag(tmp_path: Path) -> None:
    env = dict(os.environ, PAIRCLEAN_DATABASE_URL=f"sqlite:///{tmp_path / 'k.db'}")
    key = subprocess.run([sys.executable, "-m", "pairclean_service.cli", "apikey", "boss", "--admin"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    principal = JobStore(env["PAIRCLEAN_DATABASE_URL"]).principal(hash_key(key))
    assert principal is not None and principal.admin and principal.name == "boss"
    json.dumps(principal.__dict__)


# -- 7. one home for the lifecycle --------------------------------------------------------------

def test_the_store_refuses_moves_the_lifecycle_does_not_allow(tmp_path: Path) -> None:
    import typing

    from pairclean.job.lifecycle import EXIT_CODES, STATES, TERMINAL, IllegalTransition, State, state_for_exit
    from pairclean_workers import cli
    from pairclean_service.client import TERMINAL as CLIENT_TERMINAL

    store = JobStore(f"sqlite:///{tmp_path / 'j.db'}")
    job, _ = store.create({"shards": ["/a.tar"], "output": "/o"}, "alice", None, 1)
    with pytest.raises(IllegalTransition):
        store.transition(job.id, ["QUEUED"], state="SUCCEEDED")  # never ran
    with pytest.raises(IllegalTransition):
        store.update(job.id, state="RUNNING")  # states move only through transition
    assert store.transition(job.id, ["QUEUED"], state="CANCELLED")
    with pytest.raises(IllegalTransition):
        store.transition(job.id, ["CANCELLED"], state="QUEUED")  # cancelled is final
    assert (state_for_exit(0), state_for_exit(4), state_for_exit(3), state_for_exit(-9)) == ("SUCCEEDED", "PARTIAL", "FAILED", "FAILED")
    assert CLIENT_TERMINAL == TERMINAL
    # The schemas' state type and the batch CLI's exit codes come from the same module.
    assert typing.get_args(State) == STATES
    assert all(state_for_exit(code) == state for state, code in EXIT_CODES.items())
    assert (cli.EXIT_OK, cli.EXIT_PARTIAL, cli.EXIT_FAILED) == (EXIT_CODES["SUCCEEDED"], EXIT_CODES["PARTIAL"], EXIT_CODES["FAILED"])


# -- 8. hardening round 3 (issue 25) -------------------------------------------------------------

def _png(width: int, height: int) -> bytes:
    """A black RGB PNG of any size, written row by row (a 7999x7999 one is ~190 KB)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    packer, row, body = zlib.compressobj(9), b"\x00" * (1 + 3 * width), bytearray()
    for _ in range(height):
        body += packer.compress(row)
    body += packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", bytes(body)) + chunk(b"IEND", b"")


def _forged_jpeg() -> bytes:
    """A real 16x16 JPEG (about 630 bytes) whose header claims 7990x8000 pixels."""
    import struct

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 130, 140)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 8000, 7990)
    return bytes(data)


def _tar(path: Path, samples: list[dict[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i, sample in enumerate(samples):
            for ext, data in sample.items():
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def _run_job(srv: Live, shards: list[str], output: Path, who: str = "alice") -> str:
    r = srv.post("/v1/jobs", who=who, json={"shards": shards, "output": str(output), "estimator": "pairclean-tiny-test"})
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    deadline = time.time() + 300
    while time.time() < deadline and srv.get(f"/v1/jobs/{job}", who=who).json()["state"] in ("QUEUED", "RUNNING"):
        time.sleep(0.3)
    assert srv.get(f"/v1/jobs/{job}", who=who).json()["state"] in ("SUCCEEDED", "PARTIAL"), srv.get(f"/v1/jobs/{job}/logs", who=who).text
    return job


def _session(srv: Live, who: str = "alice") -> httpx.Client:
    client = httpx.Client(base_url=srv.url, timeout=30)
    key = srv.keys[who]["Authorization"].split()[1]
    assert client.post("/ui/login", data={"api_key": key, "next": "/ui/jobs"}).status_code == 303
    return client


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def test_thumbnail_decode_bombs_are_refused_and_bounded(tmp_path: Path) -> None:
    """Twelve concurrent thumbnails of 7999x7999 PNGs (190 KB files) in the tenant's own
    job once took the API from 0.7 to 5.5 GB. Now the header is checked against a small
    pixel cap before decoding, decodes hold one of a few process-wide slots, and the
    server's peak memory (it runs in this process) barely moves. A 630-byte JPEG whose
    header claims 7990x8000 pixels scores ``decode_error``, not ``ok``."""
    import pyarrow.parquet as pq

    (tmp_path / "out").mkdir()
    bomb, small = _png(7999, 7999), _png(64, 48)
    samples = [{"png": bomb, "txt": f"bomb {i}".encode()} for i in range(12)]
    samples += [{"png": small, "txt": b"a small black picture"}, {"jpg": _forged_jpeg(), "txt": b"a forged header"}]
    shard = _tar(tmp_path / "in" / "bombs-000000.tar", samples)
    with Live(tmp_path, ui_thumbnail_max_pixels=4_000_000) as srv:
        job = _run_job(srv, [str(shard)], tmp_path / "out" / "bombs")
        table = pq.read_table(tmp_path / "out" / "bombs" / "bombs-000000.parquet")
        statuses = dict(zip(table.column("key").to_pylist(), table.column("status").to_pylist()))
        assert statuses["0013"] == "decode_error", statuses  # the forged JPEG
        client = _session(srv)
        before = _peak_rss_bytes()
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda i=i: results.append(client.get(f"/ui/jobs/{job}/thumbs/bombs-000000/{i}")))
                   for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        grown = _peak_rss_bytes() - before
        assert [r.headers["x-pairclean-image"] for r in results] == ["placeholder: image over the thumbnail pixel limit"] * 12
        assert grown < 300 * 2**20, f"peak memory grew by {grown / 2**20:.0f} MiB"
        ok = client.get(f"/ui/jobs/{job}/thumbs/bombs-000000/12")
        assert ok.status_code == 200 and ok.headers["x-pairclean-image"] == "thumbnail"


class _Stalling(http.server.BaseHTTPRequestHandler):
    """Serves the demo shard at /allowed/demo.tar; a Range request, or any GET of
    /allowed/stall.tar, gets its headers (and a first few bytes) and then nothing, until
    the test ends (``stop``) or a minute has passed."""

    stop = threading.Event()
    body = b""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        cls = type(self)
        if self.path not in ("/allowed/demo.tar", "/allowed/stall.tar"):
            self.send_error(404)
            return
        ranged = self.headers.get("Range")
        if self.path == "/allowed/demo.tar" and not ranged:
            self.send_response(200)
            self.send_header("Content-Length", str(len(cls.body)))
            self.end_headers()
            self.wfile.write(cls.body)
            return
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(len(cls.body)))
        self.end_headers()
        try:
            self.wfile.write(cls.body[:1024] if not ranged else b"")
            self.wfile.flush()
            for _ in range(600):  # bounded: a minute at most
                if cls.stop.wait(0.1):
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stalling(loopback_http) -> Iterator[str]:
    from pairclean_workers.cli import sample_shard

    _Stalling.body = Path(sample_shard()).read_bytes()
    _Stalling.stop = threading.Event()
    yield loopback_http(_Stalling)
    _Stalling.stop.set()  # before the server's shutdown: ends the stalled responses


def test_a_stalled_upstream_never_starves_the_api_through_thumbnails(tmp_path: Path, stalling: str) -> None:
    """A job's shard on an allowed HTTP server that stalls on Range requests, then 45
    thumbnail requests: thumbnails run on their own few threads with a whole-request
    deadline (their connections cut then), the rest are refused at once (503), and
    ``/healthz`` and ``/v1/jobs`` answer meanwhile."""
    (tmp_path / "out").mkdir()
    with Live(tmp_path, allowed_inputs=[f"{stalling}/allowed"], ui_thumbnail_timeout_s=3.0, ui_thumbnail_threads=2,
              ui_thumbnail_queue=6) as srv:
        job = _run_job(srv, [f"{stalling}/allowed/demo.tar"], tmp_path / "out" / "remote")
        client = _session(srv)
        results: list[tuple[int, str, float]] = []

        def thumb(row: int) -> None:
            started = time.perf_counter()
            r = client.get(f"/ui/jobs/{job}/thumbs/demo/{row % 10}")
            results.append((r.status_code, r.headers.get("x-pairclean-image", ""), time.perf_counter() - started))

        threads = [threading.Thread(target=thumb, args=(i,)) for i in range(45)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        for _ in range(3):  # while thumbnails hang on the upstream
            for path in ("/healthz", "/v1/jobs"):
                started = time.perf_counter()
                assert srv.get(path).status_code == 200
                assert time.perf_counter() - started < 3, path
            time.sleep(0.5)
        for t in threads:
            t.join(timeout=60)
        assert len(results) == 45
        codes = sorted(code for code, _, _ in results)
        assert codes.count(503) >= 30 and set(codes) <= {200, 503, 504}, codes
        assert all(what == "placeholder: image not read in time" for code, what, _ in results if code == 200)
        assert max(seconds for _, _, seconds in results) < 15  # every one ended by its deadline, none by the upstream's


def test_validation_slots_are_freed_at_the_deadline(tmp_path: Path, stalling: str) -> None:
    """A ``:validate`` whose upstream stalls mid-body answers at the deadline and frees its
    slot then: the next one is served, not 429 until the upstream gives up."""
    (tmp_path / "out").mkdir()
    with Live(tmp_path, max_running_jobs=0, allowed_inputs=[f"{stalling}/allowed"], validate_concurrency=1,
              validate_timeout_s=2.0) as srv:
        body = {"shards": [f"{stalling}/allowed/stall.tar"], "output": str(tmp_path / "out" / "o")}
        for _ in range(2):
            started = time.perf_counter()
            r = srv.post("/v1/jobs:validate", json=body)
            assert r.status_code == 200, r.text
            assert any("read only the first 2 s" in p for p in r.json()["problems"]), r.json()
            assert time.perf_counter() - started < 6


def test_globs_never_go_through_symlinked_folders(live: Live, tmp_path: Path) -> None:
    """``in/l*nk/p*``, where ``in/link`` leads outside: the wildcard never enters the link,
    so the reply names nothing inside its target (prefix by prefix, a caller could list
    a folder outside the allow-list)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "passwd.txt").write_text("root:x:0:0")
    _shard(outside / "private.tar")
    (tmp_path / "in" / "link").symlink_to(outside)
    (tmp_path / "in" / "real").mkdir()
    _shard(tmp_path / "in" / "real" / "part.tar")
    out = str(tmp_path / "out" / "o")
    for pattern in ("l*nk/p*", "*/p*", "l?nk/*", "[l]ink/*.t*"):
        r = live.post("/v1/jobs:validate", json={"shards": [str(tmp_path / "in" / pattern)], "output": out})
        assert "passwd" not in r.text and "private" not in r.text and "elsewhere" not in r.text, (pattern, r.text)
    r = live.post("/v1/jobs:validate", json={"shards": [str(tmp_path / "in" / "*" / "p*")], "output": out})
    assert r.status_code == 200 and r.json()["shards"] == 1 and r.json()["first_shard"].endswith("real/part.tar")
    r = live.post("/v1/jobs", json={"shards": [str(tmp_path / "in" / "l*nk" / "p*")], "output": out})
    assert r.status_code == 422 and "passwd" not in r.text and "elsewhere" not in r.text


def test_an_output_folder_belongs_to_the_tenant_that_made_it(tmp_path: Path) -> None:
    """Tenant B submitting into tenant A's finished folder used to fail only later, while
    B's job pages showed A's shards, captions and images. Now it is refused up front
    (409, never naming A's job); so is a folder holding pairclean output of no job of B's."""
    from pairclean_workers.cli import sample_shard

    (tmp_path / "out").mkdir()
    shard = tmp_path / "in" / "demo.tar"
    shard.parent.mkdir()
    shard.write_bytes(Path(sample_shard()).read_bytes())
    with Live(tmp_path) as srv:
        job = _run_job(srv, [str(shard)], tmp_path / "out" / "a")
        r = srv.post("/v1/jobs", who="bob", json={"shards": [str(shard)], "output": str(tmp_path / "out" / "a")})
        assert r.status_code == 409 and job not in r.text, r.text
        assert srv.get("/v1/jobs", who="bob").json()["total"] == 0  # nothing of alice's reaches bob
        (tmp_path / "out" / "cli" / "_pairclean").mkdir(parents=True)  # a batch CLI run's folder
        r = srv.post("/v1/jobs", who="bob", json={"shards": [str(shard)], "output": str(tmp_path / "out" / "cli")})
        assert r.status_code == 409 and "not yours" in r.json()["detail"]
        (tmp_path / "out" / "cli2.pairclean" / "state").mkdir(parents=True)  # today's layout: state beside the folder
        r = srv.post("/v1/jobs", who="bob", json={"shards": [str(shard)], "output": str(tmp_path / "out" / "cli2")})
        assert r.status_code == 409 and "not yours" in r.json()["detail"]
        # Nor inside alice's folder or its side folder, where bob's files would join her dataset.
        for inner in (tmp_path / "out" / "a" / "nested", tmp_path / "out" / "a.pairclean" / "emb" / "z"):
            r = srv.post("/v1/jobs", who="bob", json={"shards": [str(shard)], "output": str(inner)})
            assert r.status_code == 409 and "lies inside another" in r.json()["detail"] and job not in r.text, r.text
        # The owner may run again into her own folder (a resume).
        r = srv.post("/v1/jobs", json={"shards": [str(shard)], "output": str(tmp_path / "out" / "a"), "estimator": "pairclean-tiny-test"})
        assert r.status_code == 201, r.text


def test_serve_caps_the_connections_it_holds(tmp_path: Path) -> None:
    """Each client sending a body slowly is held up to ``body_timeout_s`` before its key is
    checked: 100 of them took the API from 199 to 352 MB. ``pairclean serve`` now answers
    503 past ``PAIRCLEAN_MAX_CONNECTIONS`` (uvicorn's ``limit_concurrency``), and the clients
    that leave mid-body leave no traceback in its log."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PAIRCLEAN_MAX_CONNECTIONS": "3", "PAIRCLEAN_DATABASE_URL": f"sqlite:///{tmp_path / 'jobs.db'}",
           "PAIRCLEAN_EXECUTOR": "local"}
    serve = subprocess.Popen([sys.executable, "-m", "pairclean_service.cli", "serve", "--port", str(port), "--state-dir",
                              str(tmp_path / "state")], env=env, stdout=subprocess.DEVNULL,
                             stderr=(tmp_path / "serve.log").open("wb"))
    slow: list[socket.socket] = []
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        for _ in range(10):  # bodies promised, half sent, then nothing
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000000\r\n\r\n" + b" " * 500_000)
            slow.append(conn)
        time.sleep(0.5)
        refused = 0
        for conn in slow:
            conn.settimeout(0.5)
            try:
                refused += conn.recv(64).startswith(b"HTTP/1.1 503")
            except TimeoutError:
                pass  # held: its body is still awaited
        assert refused >= 10 - 3, refused  # at most the cap's worth of bodies is held
        for conn in slow:
            conn.close()
        slow.clear()
        for _ in range(50):  # the places come back as the slow clients go
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the service never answered again")
    finally:
        for conn in slow:
            conn.close()
        serve.terminate()
        serve.wait(timeout=30)
    log = (tmp_path / "serve.log").read_text()
    assert "Exceeded concurrency limit" in log
    assert "Traceback" not in log, log[-3000:]  # a client leaving mid-body is no error (it logged two tracebacks)


def test_no_cdn_docs_and_every_reply_carries_a_policy(live: Live) -> None:
    """FastAPI's /docs and /redoc load Swagger UI and ReDoc from a CDN, unpinned, on the
    origin whose /ui cookie they could use; the API's replies had no security headers."""
    for path in ("/docs", "/redoc"):
        assert live.get(path).status_code == 404, path
    for path in ("/openapi.json", "/healthz", "/v1/jobs", "/nope"):
        r = live.get(path)
        assert "default-src 'none'" in r.headers["content-security-policy"], path
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY", path
    assert "script-src 'self'" in live.get("/ui/login").headers["content-security-policy"]


def test_the_access_log_never_keeps_keys_from_query_strings(tmp_path: Path) -> None:
    """uvicorn's access log (its own default configuration, applied after the app is
    built, as ``pairclean serve`` runs it) kept ``?api_key=`` values."""
    import logging

    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    settings = ServiceSettings(database_url=f"sqlite:///{tmp_path / 'jobs.db'}", executor="local", max_running_jobs=0)
    app = create_app(settings, state_dir=tmp_path / "state")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="info", access_log=True))
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    keep = Keep()
    logging.getLogger("uvicorn.access").addHandler(keep)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        assert httpx.get(f"{url}/healthz?api_key=pc_SECRET1&x=1").status_code == 200
        httpx.get(f"{url}/v1/jobs?token=pc_SECRET2")
        httpx.get(f"{url}/ui/login?next=/ui/jobs&API_KEY=pc_SECRET3")
        # names the first filter missed (found by an attack); a real key's shape is caught by any name
        real = new_api_key()
        for name in ("x-api-key", "X_API_KEY", "auth", "authorization", "bearer", "pairclean_session", "api.key", "key%5B%5D",
                     "api%5Fkey", "q"):
            httpx.get(f"{url}/v1/jobs?{name}={real}")
        httpx.get(f"{url}/ui/jobs/{real}")
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        logging.getLogger("uvicorn.access").removeHandler(keep)
    text = "\n".join(lines)
    assert "/healthz?api_key=***&x=1" in text, text
    assert "SECRET" not in text and real not in text and real[3:20] not in text
    assert "/v1/jobs?X_API_KEY=***" in text and "/v1/jobs?q=***" in text
