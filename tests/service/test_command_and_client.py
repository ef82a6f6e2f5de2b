"""One ``pairclean`` command with every verb, and the Ray-shaped Python client over real HTTP
(issue 10, item 8)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from pairclean.job.lifecycle import STATES  # noqa: E402
from pairclean_service.app import read_log  # noqa: E402
from pairclean_service.client import PaircleanClient, ServiceError  # noqa: E402
from pairclean_service.security import hash_key, new_api_key  # noqa: E402

VERBS = ("score", "rescore", "inspect", "export", "demo", "train-lite", "pseudo-pair", "refine",
         "serve", "apikey", "submit", "status", "wait", "logs", "list", "cancel", "retry")


def _pairclean(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pairclean_service.cli", *args], capture_output=True, text=True, timeout=120,
                          env=env or dict(os.environ))


def test_help_lists_every_verb_and_global_options_come_first(tmp_path: Path) -> None:
    helped = _pairclean("--help")
    assert helped.returncode == 0
    listed = helped.stdout.split("positional arguments:")[1]
    assert [v for v in VERBS if f"\n    {v} " not in listed and f"\n    {v}\n" not in listed] == []
    env = dict(os.environ, PAIRCLEAN_DATABASE_URL=f"sqlite:///{tmp_path / 'k.db'}")
    made = _pairclean("-v", "apikey", "someone", env=env)  # a global option before a service verb
    assert made.returncode == 0 and made.stdout.strip().startswith("pc_"), made.stderr
    assert _pairclean("-v", "serve", "--help").returncode == 0
    assert _pairclean("-v", "score", "--help").returncode == 0


def test_an_unreachable_service_is_one_line_exit_1() -> None:
    r = _pairclean("status", "some-job", "--address", "http://127.0.0.1:9")
    assert r.returncode == 1 and r.stderr.startswith("error: cannot reach") and "Traceback" not in r.stderr


def test_read_log_pages_end_on_whole_characters(tmp_path: Path) -> None:
    log = tmp_path / "j.log"
    log.write_bytes("ab\u00e9cd".encode())  # 'é' is 2 bytes: 2..4
    first = read_log(log, 0, 3)  # the page ends inside 'é': it waits for the next one
    assert (first.text, first.next_offset, first.size) == ("ab", 2, 6)
    rest = read_log(log, first.next_offset, 100)
    assert (rest.text, rest.next_offset) == ("\u00e9cd", 6)
    assert read_log(tmp_path / "missing.log", 0, 10).text == ""


@pytest.mark.slow
def test_ray_named_client_methods_and_logs_over_http(server, make_shards, tmp_path: Path) -> None:
    shards = make_shards(n_shards=1, per_shard=4, folder=tmp_path / "shards")
    client = PaircleanClient(server.url, server.key)
    job = client.submit_job([str(shards[0])], str(tmp_path / "out"), estimator="pairclean-tiny-test")
    assert client.get_job_status(job) in STATES
    chunks = list(client.tail_job_logs(job, poll=0.2))  # ends once the job has ended and all is read
    assert client.get_job_status(job) == "SUCCEEDED"
    logs = client.get_job_logs(job)
    assert "SUCCEEDED: 1 shards scored" in logs and "".join(chunks) == logs
    assert client.get_job_info(job)["progress"]["pairs"] == 4
    assert [j["id"] for j in client.list_jobs()] == [job] and client.list_jobs(state="FAILED") == []
    assert client.stop_job(job) is False  # it had ended: nothing to stop
    # The CLI verbs print the same log and list.
    common = ("--address", server.url, "--api-key", server.key)
    assert _pairclean("logs", job, *common).stdout == logs
    assert job in _pairclean("list", *common).stdout
    # Another owner's key learns nothing about the job, its logs included.
    other = new_api_key()
    server.app.state.store.add_key(hash_key(other), "someone-else")
    with pytest.raises(ServiceError, match="404") as refused:
        PaircleanClient(server.url, other).get_job_logs(job)
    assert refused.value.status_code == 404


def test_the_contrast_option_reaches_the_score_command_and_is_checked() -> None:
    import pydantic

    from pairclean_service.runner import score_command
    from pairclean_service.schemas import JobRequest
    from pairclean_service.settings import ServiceSettings

    request = JobRequest(shards=["/data/a.tar"], output="/data/out", options={"contrast": "off"})
    cmd = score_command(request.model_dump(), ServiceSettings())
    assert cmd[cmd.index("--contrast") + 1] == "off"
    plain = score_command(JobRequest(shards=["/data/a.tar"], output="/data/out").model_dump(), ServiceSettings())
    assert "--contrast" not in plain  # the CLI's default (auto) decides
    with pytest.raises(pydantic.ValidationError):
        JobRequest(shards=["/data/a.tar"], output="/data/out", options={"contrast": "maybe"})


def test_every_job_gets_a_shard_time_limit_its_own_or_the_operators() -> None:
    """A job that set no ``shard_timeout`` ran its shards unbounded in time (a .tar.gz that
    expands a thousandfold held the job slot for hours); now it gets the operator's."""
    from pairclean_service.runner import score_command
    from pairclean_service.schemas import JobRequest
    from pairclean_service.settings import ServiceSettings
    from pairclean_workers.cli import build_parser

    plain = JobRequest(shards=["/data/a.tar"], output="/data/out").model_dump()
    cmd = score_command(plain, ServiceSettings())
    assert cmd[cmd.index("--shard-timeout") + 1] == "3600.0"
    assert build_parser().parse_args(cmd[3:]).shard_timeout == 3600.0  # the CLI takes it as given
    own = JobRequest(shards=["/data/a.tar"], output="/data/out", options={"shard_timeout": 60}).model_dump()
    cmd = score_command(own, ServiceSettings(shard_timeout_s=120))
    assert cmd.count("--shard-timeout") == 1 and cmd[cmd.index("--shard-timeout") + 1] == "60.0"
    assert "--shard-timeout" not in score_command(plain, ServiceSettings(shard_timeout_s=None))
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"PAIRCLEAN_SHARD_TIMEOUT_S": "none"}):
        assert ServiceSettings().shard_timeout_s is None  # an operator can turn the default off


def test_the_judge_options_reach_the_score_command_and_are_checked() -> None:
    import pydantic

    from pairclean_service.runner import score_command
    from pairclean_service.schemas import JobRequest
    from pairclean_service.settings import ServiceSettings

    request = JobRequest(shards=["/data/a.tar"], output="/data/out", options={"judge": "band", "judge_budget": 0.2})
    cmd = score_command(request.model_dump(), ServiceSettings())
    assert cmd[cmd.index("--judge") + 1] == "band" and cmd[cmd.index("--judge-budget") + 1] == "0.2"
    plain = score_command(JobRequest(shards=["/data/a.tar"], output="/data/out").model_dump(), ServiceSettings())
    assert "--judge" not in plain  # the CLI's default (auto) decides
    for bad in ({"judge": "sometimes"}, {"judge_budget": 0}, {"judge_budget": 1.5}):
        with pytest.raises(pydantic.ValidationError):
            JobRequest(shards=["/data/a.tar"], output="/data/out", options=bad)


def test_the_caption_field_reaches_the_score_command_and_is_checked() -> None:
    import pydantic

    from pairclean_service.runner import score_command
    from pairclean_service.schemas import JobRequest
    from pairclean_service.settings import ServiceSettings

    for field in ("alt_text", ".caption", ".en.txt"):
        request = JobRequest(shards=["/data/a.tar"], output="/data/out", options={"caption_field": field})
        cmd = score_command(request.model_dump(), ServiceSettings())
        assert cmd[cmd.index("--caption-field") + 1] == field
    assert "--caption-field" not in score_command(JobRequest(shards=["/data/a.tar"], output="/data/out").model_dump(), ServiceSettings())
    for bad in ("--overwrite", "-x", ".", "", "a b", "a/b", "x" * 70, ".json", ".jpg", ".PNG"):
        with pytest.raises(pydantic.ValidationError):
            JobRequest(shards=["/data/a.tar"], output="/data/out", options={"caption_field": bad})


def test_failed_tries_of_a_shard_that_was_committed_in_the_end_are_counted() -> None:
    """``pairclean_shard_attempts_failed_total`` counted only quarantined shards' tries: a
    shard committed on its third try (workers lost twice) left no trace. Its record now says
    how many tries it took."""
    from pairclean_service.metrics import Metrics

    def no_table(columns: list[str]) -> None:
        raise FileNotFoundError

    metrics = Metrics()
    metrics.shard_committed({"attempts": 3, "statuses": {"ok": 4}}, no_table)
    metrics.shard_committed({"statuses": {"ok": 4}}, no_table)  # a record of an earlier release: one try
    metrics.shard_quarantined(2)
    text = metrics.render().decode()
    assert "pairclean_shard_attempts_failed_total 4.0" in text and 'pairclean_pairs_scored_total{status="ok"} 8.0' in text


def test_a_job_store_in_a_missing_folder_is_made_and_one_that_cannot_open_is_one_line(tmp_path: Path) -> None:
    """compose's ``sqlite:////data/service/jobs.db`` on a fresh volume: SQLite makes the file,
    not its folder, and ``serve``/``apikey`` died with a traceback at the first start."""
    env = dict(os.environ, PAIRCLEAN_DATABASE_URL=f"sqlite:///{tmp_path / 'fresh' / 'service' / 'jobs.db'}")
    made = _pairclean("apikey", "someone", env=env)
    assert made.returncode == 0 and (tmp_path / "fresh" / "service" / "jobs.db").is_file(), made.stderr
    for verb in (["apikey", "someone"], ["serve", "--port", "9"]):
        bad = _pairclean(*verb, env=dict(os.environ, PAIRCLEAN_DATABASE_URL=f"sqlite:///{tmp_path}"))  # a folder
        assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr, bad.stderr
        assert "cannot be opened: unable to open database file (PAIRCLEAN_DATABASE_URL)" in bad.stderr
