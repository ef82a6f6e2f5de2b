"""Service settings, read from the environment (prefix ``PAIRCLEAN_``) at the service edge only."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ServiceSettings"]


class ServiceSettings(BaseSettings):
    """What an operator configures. Nothing is read at import time: build one per app.

    ``allowed_inputs`` / ``allowed_outputs``: URI prefixes jobs may read from / write to
    (``file:///data/``, ``s3://bucket/``, ``/data/``); an empty list allows nothing.
    Local prefixes match after resolving symlinks, remote ones on path-segment boundaries.
    ``max_body_bytes`` / ``body_timeout_s``: request bodies are counted while they stream
    (chunked ones too) and refused past either, before authentication.
    ``max_connections``: connections and requests ``pairclean serve`` handles at once (503
    beyond: uvicorn's ``limit_concurrency``), so clients that send bodies slowly, before any
    key is checked, hold at most this many body buffers (100 held about 150 MB).
    ``max_shards``: shards one job may expand to, enforced while expanding.
    ``validate_*``: ``:validate`` reads at most this many bytes of one shard for at most
    this many seconds, in its own pool of ``validate_concurrency`` threads (429 when full).
    ``submit_concurrency``: submissions expand their shard specs (bounded by
    ``validate_timeout_s`` each) in a pool of this many threads of their own, so a tenant's
    burst of slow specs never takes the threads that serve ``/healthz`` and other tenants; a
    submission waits up to ``validate_timeout_s`` for one, then gets 429 with Retry-After.
    ``ui_*``: the web pages (``routers/pages.py``): how long a login lasts, the largest
    image member a thumbnail may read, the score rows one job page scans for its charts
    and galleries, and how often the pages poll for progress. Thumbnails
    (``browse.ThumbnailPool``): ``ui_thumbnail_threads`` threads of their own, at most
    ``ui_thumbnail_queue`` in flight (503 beyond), each done within
    ``ui_thumbnail_timeout_s`` (its upstream read cut then), decoding only images whose
    header declares at most ``ui_thumbnail_max_pixels`` pixels at the decode scale.
    ``audit_sample`` / ``audit_seed``: the size and seed of each job's labelling queue (the
    audit loop, ``audit.py``; ``pairclean audit OUT --sample N --seed S`` draws the same one).
    ``max_queued_per_owner``: jobs one owner may have QUEUED at once (429 beyond); the
    runner starts the oldest job of the owners with the fewest RUNNING jobs first, so one
    owner's long queue does not hold back another's first job.
    ``shard_timeout_s``: the ``--shard-timeout`` of a job that gives none (its
    ``options.shard_timeout`` may ask for another, up to a day), so no shard of a tenant's
    job runs unbounded in time: one that expands a thousandfold fails after it instead of
    holding a job slot for hours; None (``none`` in the environment): jobs run with no
    limit unless they ask for one.
    ``orphan_grace_s`` / ``orphan_check_s``: a RUNNING job launched by another replica whose
    signs of life (that replica's heartbeat in the store, the heartbeat in the job's run
    lock) have not changed for ``orphan_grace_s`` is queued again (CANCELLED where its
    cancellation was asked), so a replica lost with its host does not leave its jobs RUNNING
    for ever (``JobRunner._adopt_orphans``). Runners look and beat every ``orphan_check_s``
    seconds, at least four times a grace. Keep the grace above the run lock's TTL (60 s).
    ``max_log_bytes``: the most a job's log (``--state-dir``/logs/JOB.log) grows to; past it
    the job's output is left out but for its last 256 KiB, added when the job ends
    (``joblog.py``), so one chatty job cannot fill the disk.
    """

    # "none" in the environment is None (PAIRCLEAN_SHARD_TIMEOUT_S=none: no default limit)
    model_config = SettingsConfigDict(env_prefix="PAIRCLEAN_", extra="ignore", env_parse_none_str="none")

    database_url: str = "sqlite:///pairclean-jobs.db"
    allowed_inputs: list[str] = Field(default_factory=list)
    allowed_outputs: list[str] = Field(default_factory=list)
    allow_pipe: bool = False
    max_body_bytes: int = 1_000_000
    body_timeout_s: float = 30.0
    max_connections: int = Field(256, ge=1)
    max_shards: int = 100_000
    validate_max_bytes: int = 16 * 2**20
    validate_timeout_s: float = 10.0
    validate_max_samples: int = 1000
    validate_concurrency: int = 2
    submit_concurrency: int = Field(4, ge=1, le=64)
    executor: str = "ray"
    ray_address: str | None = None
    max_running_jobs: int = 1
    max_queued_per_owner: int = Field(100, ge=1)
    poll_interval_s: float = 0.5
    require_auth: bool = True
    ui_session_ttl_s: float = 8 * 3600
    ui_thumbnail_max_bytes: int = 16 * 2**20
    ui_thumbnail_max_pixels: int = Field(16_000_000, ge=1)
    ui_thumbnail_threads: int = Field(4, ge=1, le=64)
    ui_thumbnail_queue: int = Field(32, ge=1)
    ui_thumbnail_timeout_s: float = Field(10.0, gt=0)
    ui_scan_max_rows: int = 2_000_000
    ui_poll_ms: int = 2000
    audit_sample: int = Field(400, ge=1, le=5000)
    audit_seed: int = 0
    shard_timeout_s: float | None = Field(3600.0, gt=0, le=86_400)
    orphan_grace_s: float = Field(180.0, gt=0)
    max_log_bytes: int = Field(100 * 2**20, ge=4096)

    @model_validator(mode="after")
    def _grace_outlasts_the_lock(self) -> ServiceSettings:
        """``orphan_grace_s`` above the run lock's TTL (``PAIRCLEAN_LOCK_TTL_S``, 60 s): a job
        queued again sooner found its folder still locked by the lost run and ended FAILED."""
        from pairclean.output.lock import lock_ttl_from_env

        ttl = lock_ttl_from_env()
        if self.orphan_grace_s <= ttl:
            raise ValueError(f"orphan_grace_s ({self.orphan_grace_s:g} s) must be above the run lock's TTL ({ttl:g} s, "
                             "PAIRCLEAN_LOCK_TTL_S): a job taken over sooner finds its folder still locked and fails")
        return self
    orphan_check_s: float = Field(30.0, gt=0)
