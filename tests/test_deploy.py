"""deploy/: the KubeRay manifests parse and carry what KubeRay needs; the images install the CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _load(name: str) -> dict:
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay" / name).read_text()))
    assert len(docs) == 1
    return docs[0]


def _check_cluster_spec(spec: dict) -> None:
    assert spec["rayVersion"] == "2.60.0"
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"].startswith("pairclean:")
    groups = spec["workerGroupSpecs"]
    assert groups, "at least one worker group"
    gpu = [g for g in groups if g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")]
    assert gpu, "a GPU worker group"
    for group in groups:
        assert group["groupName"] and group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert "rayStartParams" in group
    for group in gpu:  # GPU nodes are tainted: without the toleration the pods stay Pending
        tolerations = group["template"]["spec"].get("tolerations", [])
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_raycluster_manifest() -> None:
    doc = _load("raycluster.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayCluster")
    assert doc["metadata"]["name"]
    _check_cluster_spec(doc["spec"])
    # a job sizes its actor pool from the GPUs it sees at its start: with CPUs on the head and
    # the GPU group scaled to zero, it scored on CPU actors and never asked for a GPU
    assert doc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert all(g["minReplicas"] >= 1 for g in doc["spec"]["workerGroupSpecs"])


def test_rayjob_manifest_runs_the_score_command() -> None:
    doc = _load("rayjob.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    entry = doc["spec"]["entrypoint"]
    assert entry.startswith("pairclean score ") and "--out" in entry
    # every option in the entrypoint is one the CLI knows
    from pairclean_workers.cli import build_parser

    opts = {t for t in entry.split() if t.startswith("--")}
    known = {o for a in build_parser()._subparsers._group_actions[0].choices["score"]._actions for o in a.option_strings}
    assert opts <= known, opts - known
    _check_cluster_spec(doc["spec"]["rayClusterSpec"])
    # the driver (on the head) serves its metrics where the head pod's annotations say
    port = entry.split("--metrics-port", 1)[1].split()[0]
    head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    assert head["metadata"]["annotations"]["prometheus.io/port"] == port
    assert {"name": "metrics", "containerPort": int(port)} in head["spec"]["containers"][0]["ports"]


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_images_install_the_cli_on_the_matching_ray(name: str) -> None:
    text = (DEPLOY / "docker" / name).read_text()
    assert "FROM rayproject/ray:2.60.0-py311" in text
    for folder in ("pipelines", "workers", "service"):
        assert f"COPY --chown=ray:users {folder}" in text
    assert "pip install" in text and "score" in text and "ray" in text
    assert "HF_HUB_OFFLINE=1" in text
    # compose runs `pairclean serve` from the same image: the service's extra must be in it
    extras = re.search(r"pip install --no-cache-dir '\.\[([a-z,-]+)\]'", text)
    assert extras is not None and {"score", "ray", "service"} <= set(extras.group(1).split(","))
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert any(s.get("command", [None])[:2] == ["pairclean", "serve"] for s in compose["services"].values())
    # the volume's folders exist in the image, owned by its user (a fresh volume takes them over)
    assert "mkdir -p /data/service /data/shards /data/weights && chown -R ray:users /data" in text


def test_grafana_panels_use_only_exported_metrics() -> None:
    import json
    import re

    pytest.importorskip("prometheus_client")
    from pairclean_service.metrics import exported_names
    from pairclean_workers.metrics import BatchMetrics, sample_names

    dash = json.loads((DEPLOY / "grafana" / "pairclean-dashboard.json").read_text())
    exported = exported_names() | sample_names(BatchMetrics().registry)  # the service's and a batch job's
    used = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bpairclean_[a-z_]+\b", target["expr"]))
            assert names, f"panel {panel['title']!r} uses no pairclean metric"
            used |= names
    assert used <= exported, f"unknown metrics: {used - exported}"
    for panel in dash["panels"]:
        for target in panel["targets"]:
            # every replica exports the shared store's job counts: summed, N replicas count N times
            assert "sum by (state) (pairclean_jobs)" not in target["expr"]
            if panel["type"] == "heatmap":  # cumulative buckets drawn as they are stack every lower one
                assert target.get("format") == "heatmap" and "_bucket" in target["expr"], panel["title"]
            elif "_total" in target["expr"] and "rate(" in target["expr"]:
                assert target["expr"].startswith(("sum", "max")), f"{panel['title']}: one line per replica"
    # every family is on the dashboard
    families = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in exported}
    assert families <= {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in used}


def test_prometheus_and_compose_point_at_the_api() -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = prom["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["api:8000"]
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {"api", "ray-head", "prometheus", "grafana"} <= set(compose["services"])
    assert compose["services"]["api"]["command"][:2] == ["pairclean", "serve"]
    # the api container runs no raylet: a bare host:port failed every job after a minute
    assert compose["services"]["api"]["environment"]["PAIRCLEAN_RAY_ADDRESS"] == "ray://ray-head:10001"
    assert "--ray-client-server-port=10001" in compose["services"]["ray-head"]["command"]


def test_alert_rules_read_exported_metrics_and_label_values() -> None:
    """Every alert reads metrics the API exports, with label values the code writes, and is wired in."""
    pytest.importorskip("prometheus_client")
    from pairclean import schema
    from pairclean.job.lifecycle import STATES
    from pairclean_service.metrics import exported_names
    from pairclean_workers.metrics import BatchMetrics, sample_names

    rules = [r for g in yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    assert len({r["alert"] for r in rules}) == len(rules) >= 6
    known = {
        "state": set(STATES) | {schema.SHARD_COMMITTED, schema.SHARD_QUARANTINED, "total"},  # "total": pairclean_batch_shards
        "status": set(schema.STATUSES),
        "code": {f"{c}xx" for c in range(1, 6)},
        "job": {"pairclean-api"},
    }
    exported = exported_names() | sample_names(BatchMetrics().registry) | {"up"}
    for rule in rules:
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")"), rule["alert"]
        names = set(re.findall(r"\b(pairclean_[a-z_]+|up)\b(?=[{\[)\s])", expr))
        assert names and names <= exported, f"{rule['alert']}: {names - exported}"
        for label, value in re.findall(r'(\w+)\s*!?=\s*"([^"]*)"', expr):
            assert value in known[label], f"{rule['alert']}: {label}={value!r}"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]
        if "_total" in expr:  # counters: rates summed over replicas, never one series per replica
            assert re.search(r"sum\((rate|increase)\(pairclean_\w+_total", expr), rule["alert"]
        # every replica exports the shared store's job counts: taken with max, never summed
        assert expr.count("pairclean_jobs{") == expr.count("max(pairclean_jobs{"), rule["alert"]
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert prom["scrape_configs"][0]["job_name"] == "pairclean-api"
    mounts = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["prometheus"]["volumes"]
    assert "./alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts
