"""schemathesis against the service's own OpenAPI schema, over real HTTP: no 5xx, ever."""

from __future__ import annotations

from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def live(tmp_path: Path, live_server_cls):
    with live_server_cls(tmp_path) as srv:
        yield srv


def test_no_server_errors(live) -> None:
    # schemathesis' own pytest plugin does not run under pytest 9: drive hypothesis directly.
    from hypothesis import given

    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    headers = {"Authorization": f"Bearer {live.key}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case) -> None:  # type: ignore[no-untyped-def]
            case.call_and_validate(base_url=live.url, headers=headers, checks=[not_a_server_error])

        check()
    # The service counted what it answered: many requests, and none of them a 5xx.
    import re

    import httpx

    text = httpx.get(f"{live.url}/metrics").text
    counts = {code: float(n) for code, n in re.findall(r'pairclean_http_requests_total\{code="(\dxx)",route="[^"]*"\} ([0-9.e+]+)', text)}
    answered = sum(float(n) for n in re.findall(r'pairclean_http_requests_total\{[^}]*\} ([0-9.e+]+)', text))
    assert answered >= 50
    assert not any(code == "5xx" for code in counts), counts
