"""The API's request and response bodies (pydantic models) and its documented errors."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, field_validator

from pairclean import osa, schema
from pairclean.errors import InputError
from pairclean.job.lifecycle import State

from .guards import safe_text

__all__ = [
    "SafeStr", "JobOptions", "JobRequest", "Progress", "StoredRequest", "JobPublic", "JobPage", "ShardPublic", "ShardPage",
    "JobLogs", "Validation", "Problem", "ERRORS",
]

#: Names (estimators, recipes): no leading dash or dot, so never read as a flag or a hidden path.
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
#: Text fields hold no NUL, no control characters and no lone surrogates (422 otherwise).
SafeStr = Annotated[str, AfterValidator(safe_text)]


class JobOptions(BaseModel):
    """Optional scoring options (the `pairclean score` flags of the same names)."""

    model_config = {"extra": "forbid", "allow_inf_nan": False}

    batch_size: int | None = Field(None, ge=1, le=4096)
    max_failed_fraction: float | None = Field(None, ge=0, le=1)
    max_retries: int | None = Field(None, ge=0, le=20)
    shard_timeout: float | None = Field(None, gt=0, le=86_400)
    beta_k: int | None = Field(None, ge=2, le=4096)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    #: the corpus contrast (``pairclean score --contrast``): auto (default) is on for a new folder
    contrast: Literal["auto", "on", "off"] | None = None
    #: the judge (``pairclean score --judge``): auto (default) is on for pairclean-lite
    judge: Literal["auto", "off", "band", "all"] | None = None
    judge_budget: float | None = Field(None, gt=0, le=1)
    #: where the caption is (``pairclean score --caption-field``): a json field, or with a
    #: leading dot a member (``.caption``); letters, digits, ``_ . -`` only, never a flag
    caption_field: str | None = Field(None, pattern=r"^\.?[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")

    @field_validator("caption_field")
    @classmethod
    def _a_member_that_can_hold_a_caption(cls, value: str | None) -> str | None:
        """A leading dot must name a text member (not ``.json`` or an image): refused here,
        not after the job was queued."""
        try:
            schema.caption_member(value)
        except InputError as exc:
            raise ValueError(str(exc)) from None
        return value


class JobRequest(BaseModel):
    """A scoring job: shard URIs (braces, globs allowed), an output folder and the method."""

    model_config = {"extra": "forbid", "allow_inf_nan": False}

    shards: list[Annotated[SafeStr, Field(min_length=1, max_length=2048)]] = Field(min_length=1, max_length=10_000)
    output: SafeStr = Field(min_length=1, max_length=2048)
    estimator: str = Field("pairclean-lite", pattern=_NAME)
    # the library's names, not a copy: a new recipe or weighting reaches the API by itself
    beta_recipe: Literal[("auto", *osa.BETA_RECIPES)] = "auto"  # type: ignore[valid-type]
    weighting: Literal[osa.WEIGHTINGS] = osa.DEFAULT_WEIGHTING  # type: ignore[valid-type]
    options: JobOptions = Field(default_factory=JobOptions)


class Progress(BaseModel):
    shards_total: int
    shards_done: int
    shards_failed: int
    pairs: int
    pairs_per_s: float | None
    eta_s: float | None


class StoredRequest(BaseModel):
    """A job's request as stored (rows written before today's checks still read back)."""

    shards: list[str]
    output: str
    estimator: str
    beta_recipe: str
    weighting: str
    options: dict[str, Any] = Field(default_factory=dict)


class JobPublic(BaseModel):
    id: str
    state: State
    request: StoredRequest
    progress: Progress
    #: 1 - mean p_clean over the ok pairs of the shards committed so far (the wrong captions
    #: p_clean expects, near-misses included); before the first commit, the calibration's
    #: random-mismatch share (a lower bound). None before calibration.
    noise_rate_estimate: float | None = Field(description="1 - mean p_clean over the committed shards' ok pairs "
                                              "(before the first commit: the calibration's random-mismatch share)")
    output: str
    error: str | None
    created_at: str
    started_at: str | None
    finished_at: str | None
    #: What `pairclean inspect` warns of for the output (a junk-heavy corpus whose p_clean may
    #: count placeholder images or boilerplate captions clean), one line each; only
    #: ``GET /v1/jobs/{id}`` of an ended job reads the output for them (null elsewhere: lists,
    #: submit, cancel, retry, a job still running, an output that cannot be read right now).
    warnings: list[str] | None = Field(default=None, description="what `pairclean inspect` warns of for the output, "
                                       "one line each ([]: nothing); only GET /v1/jobs/{id} of an ended job fills "
                                       "it: null in lists, submit, cancel and retry replies, while the job runs, and "
                                       "where the output cannot be read right now")


class JobPage(BaseModel):
    items: list[JobPublic]
    total: int
    limit: int
    offset: int


class ShardPublic(BaseModel):
    shard: str
    state: schema.ShardState
    rows: int | None = None
    error: str | None = None


class ShardPage(BaseModel):
    items: list[ShardPublic]
    total: int
    limit: int
    offset: int


class JobLogs(BaseModel):
    """A piece of a job's log: ``text`` is bytes ``offset`` to ``next_offset`` of ``size``."""

    text: str
    offset: int
    next_offset: int
    size: int


class Validation(BaseModel):
    shards: int
    first_shard: str
    samples: int
    statuses: dict[str, int]
    problems: list[str]


class Problem(BaseModel):
    detail: str


#: Error replies every route may give (in the OpenAPI schema).
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "missing or invalid API key"},
    404: {"model": Problem, "description": "no such job (or not one of the caller's)"},
    409: {"model": Problem, "description": "the job is not in a state that allows this, or another job is writing to the output"},
    413: {"model": Problem, "description": "request too large"},
    422: {"model": Problem, "description": "invalid request (bad URI, refused location, bad field)"},
}
