"""Round 4 of attacking the service (a hostile tenant with a shell on the shared filesystem).

Paths were checked once, when a job was submitted; the job process and the pages used
them again later. A symlink made in between led a job to read shards outside the input
allow-list, to write outside the output allow-list, and a tenant's own job pages to show
another tenant's results. Also: one tenant could log every other out of the pages, fill
the queue ahead of everyone, hand the job a flag as its estimator, and take another job's
output folder as its side folder.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from pairclean.errors import InputError  # noqa: E402
from pairclean.storage import Store  # noqa: E402
from pairclean.uris import LOCAL_READ_ROOTS_ENV, LOCAL_WRITE_ROOTS_ENV, expand_shards, open_shard  # noqa: E402
from pairclean_service.runner import _next_fairly, _tail  # noqa: E402
from pairclean_service.sessions import Sessions  # noqa: E402
from pairclean_service.store import RUNNING  # noqa: E402

from test_threat_model import Live, _run_job, _session, _shard  # noqa: E402


def _wait(srv: Live, job: str, who: str = "alice", timeout: float = 300) -> dict[str, object]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        doc: dict[str, object] = srv.get(f"/v1/jobs/{job}", who=who).json()
        if doc["state"] not in ("QUEUED", "RUNNING"):
            return doc
        time.sleep(0.3)
    raise AssertionError(f"job {job} did not end")


@pytest.fixture
def demo_copy(tmp_path: Path) -> Path:
    from pairclean_workers.cli import sample_shard

    shard = tmp_path / "in" / "demo.tar"
    shard.parent.mkdir(parents=True, exist_ok=True)
    shard.write_bytes(Path(sample_shard()).read_bytes())
    (tmp_path / "out").mkdir(exist_ok=True)
    return shard


def test_a_link_made_after_submit_leads_the_job_nowhere(tmp_path: Path, demo_copy: Path) -> None:
    secret = _shard(tmp_path / "secret" / "secret.tar", n=3)
    evil = tmp_path / "in" / "evil.tar"
    evil.write_bytes(demo_copy.read_bytes())
    (tmp_path / "other" / "b").mkdir(parents=True)
    with Live(tmp_path, max_running_jobs=0) as srv:  # queued until the links are in place
        tiny = {"estimator": "pairclean-tiny-test"}
        read = srv.post("/v1/jobs", json={"shards": [str(evil)], "output": str(tmp_path / "out" / "a"), **tiny})
        write = srv.post("/v1/jobs", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / "b"), **tiny})
        assert read.status_code == write.status_code == 201, (read.text, write.text)
        evil.unlink()
        evil.symlink_to(secret)  # the input, now a link out of the input allow-list
        (tmp_path / "out" / "b").symlink_to(tmp_path / "other" / "b")  # the output, a link out of the output allow-list
        srv.settings.max_running_jobs = 1
        read_doc, write_doc = _wait(srv, read.json()["id"]), _wait(srv, write.json()["id"])
    assert read_doc["state"] == "FAILED" and "outside the locations this job may use" in str(read_doc["error"]), read_doc
    assert str(secret) not in str(read_doc["error"])  # never where the link leads
    assert not list((tmp_path / "out").glob("a/*.parquet"))
    assert write_doc["state"] == "FAILED" and "no longer resolves where it did" in str(write_doc["error"]), write_doc
    assert not any((tmp_path / "other").rglob("*.*"))  # nothing written where the link leads


def test_a_job_folder_repointed_at_another_tenants_output_shows_nothing(tmp_path: Path, demo_copy: Path) -> None:
    with Live(tmp_path) as srv:
        _run_job(srv, [str(demo_copy)], tmp_path / "out" / "a")
        bobs = _run_job(srv, [str(demo_copy)], tmp_path / "out" / "b", who="bob")
        assert srv.get(f"/v1/jobs/{bobs}/shards", who="bob").json()["total"] == 1
        for name in ("b", "b.pairclean"):  # bob re-points his own finished folder at alice's
            os.rename(tmp_path / "out" / name, tmp_path / "out" / f"{name}-old")
            (tmp_path / "out" / name).symlink_to(tmp_path / "out" / name.replace("b", "a", 1))
        r = srv.get(f"/v1/jobs/{bobs}/shards", who="bob")
        assert r.status_code == 409 and "no longer resolves where it did" in r.json()["detail"], r.text
        client = _session(srv, "bob")
        for page in (f"/ui/jobs/{bobs}", f"/ui/jobs/{bobs}/gallery", f"/ui/jobs/{bobs}/shards/demo"):
            r = client.get(page)
            assert r.status_code == 409 and "skimage/" not in r.text, (page, r.status_code)


def test_a_side_folder_that_is_another_jobs_output_is_refused(tmp_path: Path, demo_copy: Path) -> None:
    with Live(tmp_path, max_running_jobs=0) as srv:
        r = srv.post("/v1/jobs", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / "z.pairclean")})
        assert r.status_code == 201, r.text
        r = srv.post("/v1/jobs", who="bob", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / "z")})
        assert r.status_code == 409 and "side folder" in r.json()["detail"], r.text
        # a folder holding another job's state (the batch CLI's) as the side folder: refused alike
        (tmp_path / "out" / "y.pairclean.pairclean" / "state").mkdir(parents=True)
        r = srv.post("/v1/jobs", who="bob", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / "y")})
        assert r.status_code == 409 and "side folder" in r.json()["detail"], r.text


def test_names_are_never_flags(tmp_path: Path, demo_copy: Path) -> None:
    with Live(tmp_path, max_running_jobs=0) as srv:
        for name in ("--", "--help", "-1", ".hidden"):
            r = srv.post("/v1/jobs", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / "n"), "estimator": name})
            assert r.status_code == 422 and name not in r.text, (name, r.text)
    log = tmp_path / "job.log"  # argparse's usage text above the error line is for a terminal
    log.write_text("usage: pairclean score [-h] --out OUT\n                       [--cpus-per-actor N]\n"
                   "pairclean score: error: argument --model: expected one argument\n")
    assert _tail(log) == "pairclean score: error: argument --model: expected one argument"


def test_one_owner_cannot_fill_the_queue_or_go_first_for_ever(tmp_path: Path, demo_copy: Path) -> None:
    with Live(tmp_path, max_running_jobs=0, max_queued_per_owner=2) as srv:
        ids = []
        for n in range(2):
            r = srv.post("/v1/jobs", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / f"q{n}")})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        r = srv.post("/v1/jobs", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / "q2")})
        assert r.status_code == 429 and "queued jobs" in r.json()["detail"]
        r = srv.post("/v1/jobs", who="bob", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / "qb")})
        assert r.status_code == 201, r.text
        queued = srv.app.state.store.in_states(["QUEUED"])
    assert sorted(j.owner for j in queued) == ["alice", "alice", "bob"] and set(ids) <= {j.id for j in queued}
    assert _next_fairly(queued, []).id == queued[0].id  # nobody runs: the oldest (created_at has whole seconds)
    alices = next(j for j in queued if j.owner == "alice")
    assert _next_fairly(queued, [replace(alices, state=RUNNING)]).owner == "bob"  # alice runs one: bob's turn


def test_one_key_logging_in_again_and_again_ends_only_its_own_sessions() -> None:
    sessions = Sessions(ttl_s=60, max_sessions=50, max_per_key=3)
    bob = sessions.create("bob")
    alice = [sessions.create("alice") for _ in range(200)]
    assert sessions.key_hash(bob) == "bob"
    assert [sessions.key_hash(t) for t in alice[-3:]] == ["alice"] * 3 and sessions.key_hash(alice[0]) is None


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name in ("in", "out", "elsewhere"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv(LOCAL_READ_ROOTS_ENV, json.dumps([str(tmp_path / "in")]))
    monkeypatch.setenv(LOCAL_WRITE_ROOTS_ENV, json.dumps([str(tmp_path / "out")]))
    yield tmp_path


def test_a_job_process_checks_every_local_path_when_it_touches_it(roots: Path) -> None:
    inside = _shard(roots / "in" / "a.tar")
    outside = _shard(roots / "elsewhere" / "b.tar")
    with open_shard(str(inside)) as fh:
        assert fh.read(1)
    (roots / "in" / "link.tar").symlink_to(outside)
    for spec in (str(roots / "in" / "link.tar"), str(roots / "in" / "*.tar"), str(outside)):
        with pytest.raises(InputError, match="outside the locations this job may use"):
            for uri in expand_shards([spec]):
                with open_shard(uri) as fh:
                    fh.read(1)
    store = Store(str(roots / "out" / "o"), side=str(roots / "out" / "o.pairclean"))
    store.put("x.parquet", b"x")
    (roots / "out" / "o").rename(roots / "out" / "o-old")
    (roots / "out" / "o").symlink_to(roots / "elsewhere")  # swapped while the job runs
    with pytest.raises(InputError, match="outside the locations this job may use"):
        store.put("y.parquet", b"y")
    with pytest.raises(InputError, match="outside the locations this job may use"):
        store.list()
    assert not (roots / "elsewhere" / "y.parquet").exists()


def test_ray_actors_carry_the_job_processs_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Actors open the shards and write the tables; on a cluster they do not inherit the job
    process's environment, so the service's limits travel in their runtime_env."""
    from pairclean_workers.ray_exec import _with_cpu_env

    monkeypatch.setenv(LOCAL_READ_ROOTS_ENV, '["/data/in"]')
    monkeypatch.setenv(LOCAL_WRITE_ROOTS_ENV, '["/data/out"]')
    env = _with_cpu_env({"env_vars": {"OTHER": "1"}})["env_vars"]
    assert env[LOCAL_READ_ROOTS_ENV] == '["/data/in"]' and env[LOCAL_WRITE_ROOTS_ENV] == '["/data/out"]' and env["OTHER"] == "1"


def test_a_retry_cannot_take_a_job_to_where_its_folder_points_now(tmp_path: Path, demo_copy: Path) -> None:
    """``:retry`` recorded the output's key afresh: bob re-pointed his failed job's folder at
    alice's output, retried, and his job's routes then read her folder."""
    junk = tmp_path / "in" / "junk.tar"
    junk.write_bytes(b"not a tar" * 100)
    with Live(tmp_path) as srv:
        _run_job(srv, [str(demo_copy)], tmp_path / "out" / "a")
        r = srv.post("/v1/jobs", who="bob", json={"shards": [str(junk)], "output": str(tmp_path / "out" / "b"),
                                                   "estimator": "pairclean-tiny-test"})
        bobs = r.json()["id"]
        assert _wait(srv, bobs, who="bob")["state"] == "FAILED"
        for name in ("b", "b.pairclean"):
            if (tmp_path / "out" / name).exists():
                os.rename(tmp_path / "out" / name, tmp_path / "out" / f"{name}-old")
            (tmp_path / "out" / name).symlink_to(tmp_path / "out" / name.replace("b", "a", 1))
        r = srv.post(f"/v1/jobs/{bobs}:retry", who="bob")
        assert r.status_code == 409 and "no longer resolves where it did" in r.json()["detail"], r.text
        assert srv.get(f"/v1/jobs/{bobs}/shards", who="bob").status_code == 409


def test_an_output_given_as_a_link_works_and_nests_are_refused_both_ways(tmp_path: Path, demo_copy: Path) -> None:
    from pairclean_service.security import checked_output, output_key

    (tmp_path / "out" / "2024-05").mkdir()
    latest = tmp_path / "out" / "latest"
    latest.symlink_to(tmp_path / "out" / "2024-05")  # a link the operator keeps for the newest run
    assert checked_output(str(latest), output_key(str(latest)), [str(tmp_path / "out")]) == str(latest)
    with Live(tmp_path, max_running_jobs=0) as srv:
        assert srv.post("/v1/jobs", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / "z")}).status_code == 201
        for inner in ("z.pairclean", "z/sub", "z.pairclean/emb"):  # inside alice's queued job's folders, nothing on disk yet
            r = srv.post("/v1/jobs", who="bob", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / inner)})
            assert r.status_code == 409 and "lies inside another owner's job output" in r.json()["detail"], (inner, r.text)


def test_a_job_writes_only_its_own_folders_and_long_header_chains_fail_the_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import tarfile

    from pairclean.errors import ShardReadError
    from pairclean.output.exports import _check_sizes_target
    from pairclean.read.shards import iter_pairs
    from pairclean_service.security import job_roots as _write_roots

    for name in ("bob", "alice", "elsewhere"):
        (tmp_path / "out" / name).mkdir(parents=True)
    roots = _write_roots(str(tmp_path / "out" / "bob"))
    assert roots == [str(tmp_path / "out" / "bob"), str(tmp_path / "out" / "bob.pairclean")]
    monkeypatch.setenv(LOCAL_WRITE_ROOTS_ENV, json.dumps(roots))
    store = Store(str(tmp_path / "out" / "bob"), side=str(tmp_path / "out" / "bob.pairclean"))
    store.put("x.parquet", b"x")
    (tmp_path / "out" / "bob").rename(tmp_path / "out" / "bob-old")
    (tmp_path / "out" / "bob").symlink_to(tmp_path / "out" / "alice")  # re-pointed mid-run, inside the allowed area
    with pytest.raises(InputError, match="outside the locations this job may use"):
        store.put("y.parquet", b"y")
    with pytest.raises(InputError, match="outside the locations this job may use"):  # an export's copy elsewhere
        _check_sizes_target(tmp_path / "out" / "elsewhere", {})
    assert not list((tmp_path / "out" / "alice").iterdir()) and not list((tmp_path / "out" / "elsewhere").iterdir())
    for headers, size, match in ((20, 10, "over 8 extended headers"), (3, 600_000, "a pax header of 600016 bytes")):
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo("a.txt")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
        chained = bytearray()
        for _ in range(headers):  # pax headers chained before one member: tarfile recursed once per header
            record = b"%d comment=%s\n" % (len(b"comment=") + size + 1 + 8, b"x" * size)
            head = tarfile.TarInfo("././@PaxHeader")
            head.type, head.size = tarfile.XHDTYPE, len(record)
            chained += head.tobuf(tarfile.USTAR_FORMAT) + record + bytes(-len(record) % 512)
        shard = tmp_path / f"chain-{headers}.tar"
        shard.write_bytes(bytes(chained) + data.getvalue())
        with pytest.raises(ShardReadError, match=match):
            list(iter_pairs(str(shard)))


def test_round_5_links_inside_a_folder_lists_of_others_and_racing_submissions(tmp_path: Path, demo_copy: Path) -> None:
    """Round 5: links planted *inside* one's own job folder, a list file re-pointed at the
    service's folder of every tenant's shard lists, forty submissions at once against a
    share of three, and a folder submitted around another owner's queued job."""
    import threading as _threading

    import httpx

    from pairclean.output.exports import _atomic_write

    with Live(tmp_path) as srv:
        _run_job(srv, [str(demo_copy)], tmp_path / "out" / "a")
        bobs = _run_job(srv, [str(demo_copy)], tmp_path / "out" / "b", who="bob")
        table = tmp_path / "out" / "b" / "demo.parquet"
        table.unlink()
        table.symlink_to(tmp_path / "out" / "a" / "demo.parquet")  # the folders stay real; an entry leads to alice's
        state = tmp_path / "out" / "b.pairclean" / "state"
        state.rename(state.with_name("state-old"))
        state.symlink_to(tmp_path / "out" / "a.pairclean" / "state")
        assert srv.get(f"/v1/jobs/{bobs}/shards", who="bob").status_code == 409
        r = _session(srv, "bob").get(f"/ui/jobs/{bobs}/shards/demo")
        assert r.status_code == 409 and "skimage/" not in r.text
    listing = tmp_path / "in" / "mine.list"
    listing.write_text(f"{demo_copy}\n")
    with Live(tmp_path, max_running_jobs=0) as srv:
        r = srv.post("/v1/jobs", json={"shards": [f"@{listing}"], "output": str(tmp_path / "out" / "l"), "estimator": "pairclean-tiny-test"})
        assert r.status_code == 201, r.text
        listing.write_text(f"{tmp_path / 'state' / 'shard-lists'}/*.txt\n")  # every tenant's list, after the submission
        srv.settings.max_running_jobs = 1
        doc = _wait(srv, r.json()["id"])
        assert doc["state"] == "FAILED" and "outside the locations this job may use" in str(doc["error"]), doc
    with Live(tmp_path, max_running_jobs=0, max_queued_per_owner=3) as srv:
        codes: list[int] = []

        def submit(n: int) -> None:
            codes.append(httpx.post(f"{srv.url}/v1/jobs", headers=srv.keys["bob"], timeout=60,
                                    json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / f"race{n}")}).status_code)

        threads = [_threading.Thread(target=submit, args=(n,)) for n in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes.count(201) == 3 and codes.count(429) == 17, codes
        assert srv.post("/v1/jobs", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / "team" / "a3")}).status_code == 201
        r = srv.post("/v1/jobs", who="admin", json={"shards": [str(demo_copy)], "output": str(tmp_path / "out" / "team")})
        assert r.status_code == 409 and "holds another owner's job output" in r.json()["detail"], r.text
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "copies").mkdir()
    (tmp_path / "copies" / ".sizes.json.pairclean-tmp").symlink_to(victim)  # the fixed temporary name it used
    _atomic_write(tmp_path / "copies" / "sizes.json", b"{}")
    assert victim.read_text() == "keep" and (tmp_path / "copies" / "sizes.json").read_bytes() == b"{}"


def test_what_is_opened_is_checked_again_after_the_path_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link swapped in between the path's check and its open (a tenant flipping it in a
    loop won 9,000 of 60,000 reads in 4 s): every read, listing, write and delete checks the
    descriptor it opened. Here the path check is skipped outright, as if the race were won."""
    mine, victim = tmp_path / "out" / "mine", tmp_path / "victim"
    mine.mkdir(parents=True)
    victim.mkdir()
    (victim / "t.parquet").write_bytes(b"SECRET")
    store = Store(str(mine), roots=[str(mine)])
    (mine / "t.parquet").symlink_to(victim / "t.parquet")
    (mine / "sub").symlink_to(victim)
    monkeypatch.setattr("pairclean.storage.check_local_root", _only_descriptors)
    for attempt in (lambda: store.get("t.parquet"), lambda: store.open_read("t.parquet"), lambda: store.list("sub"),
                    lambda: store.size("t.parquet"), lambda: store.put("sub/x.parquet", b"x"), lambda: store.rm("sub/t.parquet")):
        with pytest.raises(InputError, match="outside the locations"):
            attempt()
    assert (victim / "t.parquet").read_bytes() == b"SECRET" and not (victim / "x.parquet").exists()
    assert store.get("absent.parquet") is None and store.put("own.parquet", b"ok").bytes == 2
    # Folders a write makes are made below the folder opened, never through a link: makedirs
    # walked the path by name and made victim/new/deeper before the descriptor check refused.
    with pytest.raises(InputError, match="outside the locations"):
        store.put("sub/new/deeper/x.parquet", b"x")
    assert sorted(p.name for p in victim.iterdir()) == ["t.parquet"]
    fresh = Store(str(tmp_path / "out" / "fresh"), roots=[str(tmp_path / "out" / "fresh")])
    assert fresh.put("state/records/a.json", b"{}").bytes == 2  # its own folder, made from its parent
    assert (tmp_path / "out" / "fresh" / "state" / "records" / "a.json").read_bytes() == b"{}"
    # Without /proc (macOS, some containers) the folder opened is located by its path, if
    # that is still the folder opened: writes that make folders work there too.
    import os as _os

    real_readlink = _os.readlink

    def no_proc(path: str, *args: object, **kwargs: object) -> str:
        if str(path).startswith("/proc/self/fd/"):
            raise FileNotFoundError(path)
        return real_readlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("os.readlink", no_proc)
    assert fresh.put("emb/new/b.json", b"{}").bytes == 2
    with pytest.raises(InputError, match="outside the locations"):
        store.put("sub/other/x.parquet", b"x")
    assert sorted(p.name for p in victim.iterdir()) == ["t.parquet"]


def _only_descriptors(path: str, env: str, what: str, fh: object = None, roots: object = None) -> None:
    """``check_local_root`` as though each check of a path alone were won by a racing link."""
    from pairclean.uris import check_local_root

    if fh is not None:
        check_local_root(path, env, what, fh=fh, roots=roots)  # type: ignore[arg-type]
