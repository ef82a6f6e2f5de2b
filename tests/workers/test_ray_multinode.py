"""Exactly once survives a lost node: a real multi-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``: a head and two worker nodes, each its own raylet and
object store), with a whole worker node killed in the middle of a job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from pairclean.embed.estimators import EstimatorSpec
from pairclean.spec import JobSpec
from pairclean.output.folder import OutputDir
from pairclean.job.runner import run_job, score_options

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def cluster() -> Any:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # Fast failure detection, so a dead node is noticed in seconds rather than half a minute.
    system = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 * 2**20, "_system_config": system})
    for _ in range(2):
        # "scoring" keeps actors off the head node; 2 of them per node so that the surviving
        # node can take the replacements of a lost one.
        c.add_node(num_cpus=2, resources={"scoring": 2}, object_store_memory=80 * 2**20)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


class _KillNodeAtFirstCommit:
    """Progress sink that removes (kills) the worker node of one scoring actor at the first commit."""

    def __init__(self, cluster: Any, node_id: str) -> None:
        self.cluster, self.node_id, self.done, self.killed = cluster, node_id, 0, False

    def start(self, total_shards: int, already_done: int) -> None:
        pass

    def shard_done(self, record: Any) -> None:
        self.done += 1
        if self.done == 1:
            node = next(n for n in self.cluster.worker_nodes if n.node_id == self.node_id)
            self.cluster.remove_node(node, allow_graceful=False)
            self.killed = True

    def shard_failed(self, uri: str, error: str, attempts: int = 1) -> None:
        pass


def test_a_killed_node_loses_no_shard_and_commits_none_twice(cluster: Any, make_shards, tmp_path: Path) -> None:
    from pairclean_workers.ray_exec import RayOptions, RaySource

    shards = [str(s) for s in make_shards(n_shards=8, per_shard=16)]
    spec = JobSpec(shards=tuple(shards), model="pairclean-tiny-test", checkpoint=None, pretrained=None, precision="fp32",
                   beta_recipe="gmm", beta_k=16, weighting="paper", seed=0, batch_size=4, max_pixels=64_000_000,
                   caption_field=None, embeddings=True, calibration_pairs=16)
    out = OutputDir(str(tmp_path / "out"))
    opts = RayOptions(num_actors=2, threads_per_actor=1, backoff_s=0.1, actor_resources={"scoring": 1})
    source = RaySource(EstimatorSpec("pairclean-tiny-test", precision="fp32", device="cpu"), spec, out, score_options(spec), opts)
    nodes = [source.ray.get(a.node_id.remote()) for a in source.actors]
    assert cluster.head_node.node_id not in nodes  # actors run on the worker nodes only
    progress = _KillNodeAtFirstCommit(cluster, nodes[-1])
    report = run_job(spec, out, lambda: source, progress=progress)
    assert progress.killed and report.state == "SUCCEEDED" and report.committed == 8
    assert source.retries >= 1  # the lost node's shards were retried
    alive = {n.node_id for n in cluster.worker_nodes}
    assert all(source.ray.get(a.node_id.remote()) in alive for a in source.actors)
    records = list(OutputDir(str(tmp_path / "out")).iter_committed())
    assert [r.stem for r in records] == [f"part-{i:05d}" for i in range(8)]
    dataset = ds.dataset(tmp_path / "out")
    assert dataset.count_rows() == 8 * 16 == sum(r.rows for r in records)
    assert not list((tmp_path / "out").rglob(".*"))  # no temporary left behind
