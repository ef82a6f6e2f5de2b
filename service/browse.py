"""What the web pages show of a job, read from the job's own output folder.

Everything here starts from a job the caller may see (``dependencies.job_or_404``): its
output folder comes from the stored request, its shards from the folder's completion
records. A URL names a shard only by its *stem*, looked up among those records, so a page
can never be pointed at a file outside the job.

Bounded work: the charts and galleries scan at most ``ui_scan_max_rows`` score rows (in
shard order; the page says when it stopped early), per-shard summaries are cached by the
score table's sha256 (a running job rescans only what it committed since), and
thumbnails read only the image member's bytes (``pairclean.read.members.read_member``), at
most ``ui_thumbnail_max_bytes``, and are cached, downscaled, in memory.

Thumbnails are hostile input decoded inside the API process, so they are bounded three
ways (``ThumbnailPool``): they run on their own few threads (never the pool that serves
``/healthz`` and ``/v1/jobs``), with at most ``ui_thumbnail_queue`` waiting (503 past it);
each has one whole-request deadline (``ui_thumbnail_timeout_s``) that also cuts a
stalled upstream's connection (``pairclean.uris.SocketWatch``); and a decode starts only
when the image's header declares at most ``ui_thumbnail_max_pixels`` pixels at the scale
it will decode at (JPEGs decode at 1/8 scale at most), and holds one of ``THUMB_DECODES``
process-wide decode slots, so decode memory is bounded by slots x pixel cap.
Captions on gallery and shard pages share one deadline per page.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import time
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import pyarrow as pa

from pairclean import schema
from pairclean.calibrate.calibration import Calibration
from pairclean.output.folder import OutputDir, ShardRecord
from pairclean.output.report import warnings_of
from pairclean.uris import shard_stem

from .security import UriRefused, check_uri, checked_output, job_roots, local_roots_of
from .settings import ServiceSettings
from .store import JobRow

__all__ = ["Browser", "JobOverview", "ShardScan", "PairRow", "RowFilter", "ThumbnailPool", "GALLERY_MAX", "PAGE_SIZE",
           "THUMB_DECODES", "placeholder_png"]

log = logging.getLogger(__name__)

#: Pairs one gallery can page through (each of "lowest" and "borderline").
GALLERY_MAX = 240
#: Cards / rows on one page.
PAGE_SIZE = 24
#: Captions are read from their tar member; longer members are not shown.
CAPTION_MAX_BYTES = 64 * 1024
#: The longest edge of a thumbnail, in pixels.
THUMB_EDGE = 192
#: Thumbnail decodes running at once in this process (each holds at most the pixel cap).
THUMB_DECODES = 2
#: Seconds all the captions of one page may take to read (then the rest show as unreadable).
CAPTIONS_TIMEOUT_S = 5.0

# Process-wide, not per app: decode memory is what a process has to bound.
_DECODE_SLOTS = threading.BoundedSemaphore(THUMB_DECODES)

_SIM_BINS = np.linspace(-1.0, 1.0, 201)  # cosine similarities, 0.01 wide
_WEIGHT_BINS = np.linspace(0.0, 1.0, 21)
_VIEW = [schema.COL_KEY, schema.COL_IDX, schema.COL_STATUS, schema.COL_SIMILARITY, schema.COL_WEIGHT, schema.COL_NOISY,
         schema.COL_P_CLEAN]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Lru(Generic[K, V]):
    """A small thread-safe LRU bounded by entries and by a size measure.

    Hand-written (twenty lines) rather than a dependency: ``functools.lru_cache`` cannot
    bound by bytes or drop entries by key, and the service has no cache library otherwise.
    """

    def __init__(self, max_entries: int, max_size: int = 0, size_of: Callable[[V], int] = lambda _: 0) -> None:
        self.max_entries, self.max_size, self.size_of = max_entries, max_size, size_of
        self._items: OrderedDict[K, V] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            if key in self._items:
                self._size -= self.size_of(self._items.pop(key))
            self._items[key] = value
            self._size += self.size_of(value)
            while len(self._items) > self.max_entries or (self.max_size and self._size > self.max_size and len(self._items) > 1):
                _, old = self._items.popitem(last=False)
                self._size -= self.size_of(old)


@dataclass(frozen=True)
class ShardScan:
    """One committed shard, summarised: counts, histograms and gallery candidates.

    ``lowest``/``border``: row positions of the shard's ok pairs with the lowest
    (weight, similarity) and the similarity nearest beta, at most ``GALLERY_MAX`` each,
    with their sort keys.
    """

    stem: str
    shard: str
    rows: int
    statuses: dict[str, int]
    ok: int
    noisy: int
    sim_clean: np.ndarray
    sim_noisy: np.ndarray
    weight_clean: np.ndarray
    weight_noisy: np.ndarray
    lowest: list[tuple[float, float, int]]  # (weight, similarity, row)
    border: list[tuple[float, int]]  # (|similarity - beta|, row)

    @property
    def noise_rate(self) -> float | None:
        return self.noisy / self.ok if self.ok else None


@dataclass
class JobOverview:
    """A job's charts, counts and galleries, over the shards scanned."""

    calibration: Calibration | None
    meta: dict[str, Any]
    spec: dict[str, Any] | None
    shards_total: int
    committed: int
    scanned: list[ShardScan]
    unscanned: list[ShardRecord]
    quarantined: dict[str, dict[str, Any]]
    statuses: dict[str, int] = field(default_factory=dict)
    pairs: int = 0
    ok: int = 0
    noisy: int = 0
    sim_edges: list[float] = field(default_factory=list)
    sim_clean: list[int] = field(default_factory=list)
    sim_noisy: list[int] = field(default_factory=list)
    weight_clean: list[int] = field(default_factory=list)
    weight_noisy: list[int] = field(default_factory=list)
    lowest: list[tuple[str, int]] = field(default_factory=list)  # (stem, row)
    border: list[tuple[str, int]] = field(default_factory=list)

    @property
    def beta(self) -> float | None:
        return self.calibration.beta if self.calibration else None

    @property
    def truncated(self) -> bool:
        return bool(self.unscanned)


@dataclass(frozen=True)
class PairRow:
    """One pair as a page shows it."""

    stem: str
    row: int
    key: str
    idx: int
    status: str
    similarity: float | None
    weight: float
    noisy: bool
    p_clean: float
    caption: str | None
    has_image: bool


@dataclass(frozen=True)
class RowFilter:
    """The shard page's filters (validated by the route)."""

    status: str | None = None
    noisy: bool | None = None
    weight_min: float = 0.0
    weight_max: float = 1.0


@dataclass(frozen=True)
class _Table:
    view: pa.Table
    caption_field: str | None
    has_members: bool


class _Output:
    """An ``OutputDir`` shared by the requests of one job (its manifest cache is reused),
    with a lock: ``OutputDir`` keeps per-instance state."""

    def __init__(self, uri: str, roots: list[str]) -> None:
        self.out = OutputDir(uri, roots=roots)
        self.lock = threading.Lock()

    def committed(self) -> dict[str, ShardRecord]:
        with self.lock:
            return self.out.committed()


def placeholder_png() -> bytes:
    """A grey square shown for a missing, refused or unreadable image."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (THUMB_EDGE, THUMB_EDGE), (225, 225, 225))
    draw = ImageDraw.Draw(img)
    draw.line((0, 0, THUMB_EDGE, THUMB_EDGE), fill=(190, 190, 190), width=3)
    draw.line((0, THUMB_EDGE, THUMB_EDGE, 0), fill=(190, 190, 190), width=3)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class ThumbnailPool:
    """Where thumbnails run: ``threads`` threads of their own, at most ``queue`` requests
    in flight or waiting (503 beyond), each ending by ``timeout_s`` (504), its I/O cut
    at the same deadline. Requests wait in the event loop, holding no thread."""

    def __init__(self, threads: int, queue: int, timeout_s: float) -> None:
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pairclean-thumb")
        self.max_pending, self.timeout_s = max(queue, threads), timeout_s
        self._pending = 0
        self._lock = threading.Lock()

    async def run(self, work: Callable[[float], V]) -> V:
        """``work(deadline)`` on the pool; raises ``HTTPException`` 503 / 504."""
        from fastapi import HTTPException

        with self._lock:
            if self._pending >= self.max_pending:
                raise HTTPException(503, "too many thumbnails in progress; retry later", headers={"Retry-After": "5"})
            self._pending += 1
        deadline = time.monotonic() + self.timeout_s
        try:
            future: Future[V] = self.pool.submit(_before, deadline, work)
        except RuntimeError:  # the pool is shut down: the app is stopping
            self._finished(None)
            raise HTTPException(503, "the service is stopping") from None
        future.add_done_callback(self._finished)  # a cancelled one (never started) too
        try:
            # A margin past the deadline: the work itself stops at the deadline and says why.
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout=self.timeout_s + 1.0)
        except asyncio.TimeoutError:
            raise HTTPException(504, f"the image was not read within {self.timeout_s:g} s", headers={"Retry-After": "5"}) from None

    def _finished(self, _: object) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _before(deadline: float, work: Callable[[float], V]) -> V:
    from fastapi import HTTPException

    if time.monotonic() >= deadline:  # waited in the queue past its deadline
        raise HTTPException(504, "the image was not read in time; retry later", headers={"Retry-After": "5"})
    return work(deadline)


class Browser:
    """Reads what the pages show; one per app (its caches are shared by all requests)."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self._outputs: _Lru[str, _Output] = _Lru(64)
        self._scans: _Lru[tuple[str, str, str], ShardScan] = _Lru(2048)
        self._warnings: _Lru[tuple[str, str, str], tuple[list[str], float | None]] = _Lru(1024)
        self._tables: _Lru[tuple[str, str, str], _Table] = _Lru(32, 256 * 2**20, lambda t: t.view.nbytes)
        # keyed by the json field read too: one shard, two tenants' jobs reading two fields of
        # one json member (alice's "caption", bob's "alt") showed alice whichever came first
        self._captions: _Lru[tuple[str, int, int, str | None], str] = _Lru(4096)
        self._thumbs: _Lru[tuple[str, int, int, str], bytes] = _Lru(2048, 32 * 2**20, len)
        self.placeholder = placeholder_png()
        self.thumbs = ThumbnailPool(settings.ui_thumbnail_threads, settings.ui_thumbnail_queue, settings.ui_thumbnail_timeout_s)

    # -- the job's folder -------------------------------------------------------------------
    def output(self, job: JobRow) -> _Output:
        """The job's output folder, checked on every call (``security.checked_output``: a
        folder re-pointed since the submission raises ``OutputMoved``)."""
        uri = checked_output(str(job.request["output"]), job.output_key, self.settings.allowed_outputs)
        roots = job_roots(uri)  # every file of it read inside its own folders: links planted in them lead nowhere
        got = self._outputs.get(uri)
        if got is None or got.out.store.roots != roots:
            got = _Output(uri, roots)
            self._outputs.put(uri, got)
        return got

    def job_warnings(self, job: JobRow) -> list[str]:
        """What `pairclean inspect` warns of for the job's output (``report.warnings_of``),
        read from the metadata of its first committed table (by stem); none before a shard
        is committed. ``OSError`` where the committed table's footer cannot be read."""
        return list(self._output_facts(job)[0])

    def audited_noise(self, job: JobRow) -> float | None:
        """1 - mean ``p_clean`` of the job's tables after ``pairclean audit --labels`` applied
        a map to them (the summary the CLI keeps beside the map); None where no audit was
        applied (the job's stored estimate, made while it ran, is still the tables')."""
        return self._output_facts(job)[1]

    def _output_facts(self, job: JobRow) -> tuple[list[str], float | None]:
        """(warnings, audited noise) of the job's output, from its first committed table's
        metadata. Cached per table (stem and sha256): a rewrite of the tables (audit,
        rescore) records new checksums. ``OSError`` where the footer cannot be read (never
        cached as "nothing to say": a passing storage error would have stuck)."""
        holder = self.output(job)
        committed = holder.committed()
        if not committed:
            return [], None
        record = committed[min(committed)]
        key = (holder.out.uri, record.stem, record.sha256)
        got = self._warnings.get(key)
        if got is None:
            # not under the job's lock: a slow read of this footer holds up no page of the job
            meta = holder.out.store.parquet_metadata(record.output)
            if meta is None:
                raise OSError(f"{record.output}: the committed table's footer could not be read")
            doc = schema.json_object(meta.get(schema.META_KEY, b"{}"))
            if doc is None:  # a list there was an AttributeError (a 500)
                raise ValueError("the table's pairclean metadata is not a JSON object")
            got = (warnings_of(doc), _audited_noise(holder.out, doc))
            self._warnings.put(key, got)
        return list(got[0]), got[1]

    def record(self, job: JobRow, stem: str) -> ShardRecord | None:
        """The committed record of one of the job's shards, by stem; None when the job has
        no such committed shard (the only way a URL reaches a shard)."""
        return self.output(job).committed().get(stem)

    def _table(self, out: OutputDir, record: ShardRecord) -> _Table:
        key = (out.uri, record.stem, record.sha256)
        got = self._tables.get(key)
        if got is not None:
            return got
        table = out.read_scores(record)
        meta = json.loads((table.schema.metadata or {}).get(schema.META_KEY, b"{}"))
        has_members = set(schema.MEMBER_COLUMNS) <= set(table.column_names)
        view = table.select(_VIEW + (list(schema.MEMBER_COLUMNS) if has_members else []))
        got = _Table(view, (meta.get("recipe") or {}).get("caption_field"), has_members)
        self._tables.put(key, got)
        return got

    # -- the overview -----------------------------------------------------------------------
    def overview(self, job: JobRow) -> JobOverview:
        """Counts, histograms and gallery candidates over the job's committed shards (at most
        ``ui_scan_max_rows`` rows, in shard order)."""
        holder = self.output(job)
        out = holder.out
        committed = holder.committed()
        with holder.lock:
            spec = out.read_spec()
            calibration = out.read_calibration()
            quarantined = out.quarantined()
        order = [shard_stem(u) for u in spec.shards] if spec else sorted(committed)
        records = [committed[s] for s in order if s in committed]
        view = JobOverview(calibration=calibration, meta={}, spec=spec.to_json() if spec else None,
                           shards_total=len(spec.shards) if spec else len(records), committed=len(records), scanned=[],
                           unscanned=[], quarantined=quarantined)
        beta = calibration.beta if calibration else 0.0
        rows = 0
        for record in records:
            if rows >= self.settings.ui_scan_max_rows:
                view.unscanned.append(record)
                continue
            scan = self._scan(out, record, beta)
            view.scanned.append(scan)
            rows += scan.rows
        if records:
            first = records[0]
            meta = out.store.parquet_metadata(first.output) or {}
            view.meta = schema.json_object(meta.get(schema.META_KEY, b"{}")) or {}  # damaged: the page shows what it can
        _merge(view)
        return view

    def _scan(self, out: OutputDir, record: ShardRecord, beta: float) -> ShardScan:
        key = (out.uri, record.stem, record.sha256)
        got = self._scans.get(key)
        if got is not None:
            return got
        table = self._table(out, record).view
        status = np.asarray(table.column(schema.COL_STATUS).to_pylist(), dtype=object)
        ok = schema.ok_mask(status)
        sims = table.column(schema.COL_SIMILARITY).to_numpy(zero_copy_only=False).astype(np.float64)
        weights = table.column(schema.COL_WEIGHT).to_numpy(zero_copy_only=False).astype(np.float64)
        noisy = table.column(schema.COL_NOISY).to_numpy(zero_copy_only=False).astype(bool)
        clean_ok, noisy_ok = ok & ~noisy, ok & noisy
        rows_ok = np.flatnonzero(ok)
        order = rows_ok[np.lexsort((sims[rows_ok], weights[rows_ok]))][:GALLERY_MAX]
        border = rows_ok[np.argsort(np.abs(sims[rows_ok] - beta), kind="stable")][:GALLERY_MAX]
        values, counts = np.unique(status.astype(str), return_counts=True)
        scan = ShardScan(
            stem=record.stem, shard=record.shard, rows=table.num_rows, statuses={str(v): int(c) for v, c in zip(values, counts)},
            ok=int(ok.sum()), noisy=int(noisy_ok.sum()),
            sim_clean=np.histogram(np.clip(sims[clean_ok], -1, 1), _SIM_BINS)[0].astype(np.int64),
            sim_noisy=np.histogram(np.clip(sims[noisy_ok], -1, 1), _SIM_BINS)[0].astype(np.int64),
            weight_clean=np.histogram(weights[clean_ok], _WEIGHT_BINS)[0].astype(np.int64),
            weight_noisy=np.histogram(weights[noisy_ok], _WEIGHT_BINS)[0].astype(np.int64),
            lowest=[(float(weights[r]), float(sims[r]), int(r)) for r in order],
            border=[(float(abs(sims[r] - beta)), int(r)) for r in border],
        )
        self._scans.put(key, scan)
        return scan

    # -- pairs ------------------------------------------------------------------------------
    def pairs(self, job: JobRow, refs: list[tuple[str, int]]) -> list[PairRow]:
        """The pairs at (stem, row) positions, with their captions (read from the tar; all
        of them within ``CAPTIONS_TIMEOUT_S``)."""
        deadline = time.monotonic() + CAPTIONS_TIMEOUT_S
        holder = self.output(job)
        committed = holder.committed()
        result = []
        for stem, row in refs:
            record = committed.get(stem)
            if record is None:
                continue
            table = self._table(holder.out, record)
            result.append(self._pair(record, table, row, deadline))
        return result

    def shard_rows(self, job: JobRow, record: ShardRecord, filters: RowFilter, offset: int, limit: int) -> tuple[list[PairRow], int]:
        """One page of a shard's rows that pass ``filters``, and how many pass."""
        table = self._table(self.output(job).out, record)
        view = table.view
        keep = np.ones(view.num_rows, dtype=bool)
        if filters.status:
            keep &= np.asarray(view.column(schema.COL_STATUS).to_pylist(), dtype=object) == filters.status
        if filters.noisy is not None:
            keep &= view.column(schema.COL_NOISY).to_numpy(zero_copy_only=False).astype(bool) == filters.noisy
        weights = view.column(schema.COL_WEIGHT).to_numpy(zero_copy_only=False)
        keep &= (weights >= filters.weight_min) & (weights <= filters.weight_max)
        rows = np.flatnonzero(keep)
        deadline = time.monotonic() + CAPTIONS_TIMEOUT_S
        return [self._pair(record, table, int(r), deadline) for r in rows[offset : offset + limit]], int(rows.size)

    def _pair(self, record: ShardRecord, table: _Table, row: int, deadline: float) -> PairRow:
        r = table.view.slice(row, 1).to_pylist()[0]
        sim = r[schema.COL_SIMILARITY]
        has_image = table.has_members and r[schema.COL_IMAGE_OFFSET] is not None and r[schema.COL_IMAGE_SIZE] is not None
        caption = None
        if table.has_members and r[schema.COL_CAPTION_OFFSET] is not None and r[schema.COL_CAPTION_SIZE] is not None:
            caption = self._caption(record, int(r[schema.COL_CAPTION_OFFSET]), int(r[schema.COL_CAPTION_SIZE]), table.caption_field,
                                    deadline)
        return PairRow(stem=record.stem, row=row, key=r[schema.COL_KEY], idx=int(r[schema.COL_IDX]), status=r[schema.COL_STATUS],
                       similarity=None if sim is None or np.isnan(sim) else float(sim), weight=float(r[schema.COL_WEIGHT]),
                       noisy=bool(r[schema.COL_NOISY]), p_clean=float(r[schema.COL_P_CLEAN]), caption=caption,
                       has_image=bool(has_image))

    def _caption(self, record: ShardRecord, offset: int, size: int, caption_field: str | None, deadline: float) -> str | None:
        """The caption from its tar member (None when it cannot be read; shown as such)."""
        key = (record.shard, offset, size, caption_field)
        got = self._captions.get(key)
        if got is not None:
            return got
        data = self._member(record.shard, offset, size, CAPTION_MAX_BYTES, deadline)
        if data is None:
            return None
        text = data.decode("utf-8", "replace")
        if caption_field is not None and schema.caption_member(caption_field) is None:  # a json field, not a text member
            try:
                value = json.loads(text).get(caption_field)
            except (ValueError, RecursionError, AttributeError):  # not JSON, nested past the parser, not an object
                return None
            text = "" if value is None else str(value)
        self._captions.put(key, text)
        return text

    # -- thumbnails -------------------------------------------------------------------------
    def thumbnail(self, job: JobRow, record: ShardRecord, row: int, deadline: float) -> tuple[bytes, str, str]:
        """(bytes, content type, what it is: ``thumbnail`` or ``placeholder: <why>``) for one
        row of one of the job's committed shards, by ``deadline`` (``time.monotonic()``).
        Never raises for a bad image."""
        table = self._table(self.output(job).out, record)
        if row < 0 or row >= table.view.num_rows:
            return self.placeholder, "image/png", "placeholder: no such row"
        if not table.has_members:
            return self.placeholder, "image/png", "placeholder: the score table records no image offsets"
        r = table.view.slice(row, 1).select([schema.COL_IMAGE_OFFSET, schema.COL_IMAGE_SIZE]).to_pylist()[0]
        offset, size = r[schema.COL_IMAGE_OFFSET], r[schema.COL_IMAGE_SIZE]
        if offset is None or size is None:
            return self.placeholder, "image/png", "placeholder: no image member recorded"
        if size > self.settings.ui_thumbnail_max_bytes:
            return self.placeholder, "image/png", "placeholder: image member over the size limit"
        key = (record.shard, int(offset), int(size), record.sha256)
        got = self._thumbs.get(key)
        if got is not None:
            return got, "image/jpeg", "thumbnail"
        data = self._member(record.shard, int(offset), int(size), self.settings.ui_thumbnail_max_bytes, deadline)
        if data is None:
            late = time.monotonic() >= deadline
            return self.placeholder, "image/png", "placeholder: image not read in time" if late else "placeholder: image unreadable or not allowed"
        thumb = _downscale(data, self.settings.ui_thumbnail_max_pixels, deadline)
        if isinstance(thumb, str):
            return self.placeholder, "image/png", f"placeholder: {thumb}"
        self._thumbs.put(key, thumb)
        return thumb, "image/jpeg", "thumbnail"

    def _member(self, shard: str, offset: int, size: int, max_bytes: int, deadline: float) -> bytes | None:
        """Bytes of a member of one of a job's shards, re-checked against today's input
        allow-list (the shard came from the job's records, never from the request); None
        when refused, unreadable or not read by ``deadline``."""
        from pairclean.errors import PaircleanError
        from pairclean.read.members import read_member

        if time.monotonic() >= deadline:
            return None
        try:
            check_uri(shard, self.settings.allowed_inputs, allow_pipe=False)
            # checked again on what is opened (a link swapped in after the check leads nowhere),
            # and only at a tar member of the recorded size: the offsets come from the job's own
            # tables, which their owner can edit, so a link to any file inside the inputs (or to
            # another tenant's job files there) showed its bytes as a caption
            return read_member(shard, offset, size, max_bytes, http_allowed=self.settings.allowed_inputs, deadline=deadline,
                               local_roots=local_roots_of(self.settings.allowed_inputs), tar_header=True)
        except UriRefused:
            log.warning("a page asked for a member of a shard outside the allowed inputs; refused")
            return None
        except PaircleanError as exc:
            log.info("member unreadable: %s", exc)
            return None


def _downscale(data: bytes, max_pixels: int, deadline: float) -> bytes | str:
    """A JPEG at most ``THUMB_EDGE`` pixels on its longer edge, or why not (a placeholder's
    reason): undecodable, a header declaring more than ``max_pixels`` at the scale it would
    decode at, a header no file this small can fill, or no decode slot free by ``deadline``."""
    from PIL import Image, UnidentifiedImageError

    from pairclean.read.decode import implausible_size, open_image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # our cap decides, below PIL's; no log line per image either
            with open_image(data) as img:
                forged = implausible_size(img, len(data))
                if forged:
                    return "image cannot be decoded"
                full = img.size[0] * img.size[1]
                if full > max_pixels and (img.info.get("progressive") or img.info.get("progression")):
                    # libjpeg keeps every coefficient of a progressive JPEG at full size, whatever
                    # draft's scale: 1 MB of 13000 x 13000 took the API process from 221 to 1200 MiB
                    return "image over the thumbnail pixel limit"
                img.draft("RGB", (THUMB_EDGE, THUMB_EDGE))  # JPEG: decode at a reduced scale (size shrinks)
                width, height = img.size
                if width * height > max_pixels:
                    return "image over the thumbnail pixel limit"
                if not _DECODE_SLOTS.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    return "busy: too many images decoding"
                try:
                    small = img.convert("RGB")
                    small.thumbnail((THUMB_EDGE, THUMB_EDGE))
                    buf = io.BytesIO()
                    small.save(buf, format="JPEG", quality=82)
                    return buf.getvalue()
                finally:
                    _DECODE_SLOTS.release()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        return "image cannot be decoded"


def _merge(view: JobOverview) -> None:
    """Fill the job-level fields of ``view`` from its shard scans."""
    if not view.scanned:
        return
    statuses: dict[str, int] = {}
    for scan in view.scanned:
        for status, count in scan.statuses.items():
            statuses[status] = statuses.get(status, 0) + count
    view.statuses = dict(sorted(statuses.items()))
    view.pairs = sum(s.rows for s in view.scanned)
    view.ok = sum(s.ok for s in view.scanned)
    view.noisy = sum(s.noisy for s in view.scanned)
    sim_clean = np.sum([s.sim_clean for s in view.scanned], axis=0)
    sim_noisy = np.sum([s.sim_noisy for s in view.scanned], axis=0)
    view.sim_edges, view.sim_clean, view.sim_noisy = _trim(sim_clean, sim_noisy, view.beta)
    view.weight_clean = [int(c) for c in np.sum([s.weight_clean for s in view.scanned], axis=0)]
    view.weight_noisy = [int(c) for c in np.sum([s.weight_noisy for s in view.scanned], axis=0)]
    lowest = sorted((w, s, scan.stem, r) for scan in view.scanned for w, s, r in scan.lowest)[:GALLERY_MAX]
    view.lowest = [(stem, r) for _, _, stem, r in lowest]
    border = sorted((d, scan.stem, r) for scan in view.scanned for d, r in scan.border)[:GALLERY_MAX]
    view.border = [(stem, r) for _, stem, r in border]


def _trim(clean: np.ndarray, noisy: np.ndarray, beta: float | None, bars: int = 50) -> tuple[list[float], list[int], list[int]]:
    """The occupied part of the fixed similarity bins (beta included), regrouped into at most
    ``bars`` bars."""
    total = clean + noisy
    used = np.flatnonzero(total)
    if used.size == 0:
        return [], [], []
    lo, hi = int(used[0]), int(used[-1]) + 1
    if beta is not None and -1 <= beta <= 1:
        at = int(np.clip(np.searchsorted(_SIM_BINS, beta) - 1, 0, len(total) - 1))
        lo, hi = min(lo, at), max(hi, at + 1)
    lo, hi = max(lo - 1, 0), min(hi + 1, len(total))
    group = max(1, -(-(hi - lo) // bars))
    hi = min(lo + group * -(-(hi - lo) // group), len(total))
    edges = [float(_SIM_BINS[i]) for i in range(lo, hi, group)] + [float(_SIM_BINS[hi])]
    starts = list(range(lo, hi, group))
    return edges, [int(clean[i : i + group].sum()) for i in starts], [int(noisy[i : i + group].sum()) for i in starts]


def _audited_noise(out: OutputDir, doc: dict[str, Any]) -> float | None:
    """The ``expected_noise`` of the summary ``pairclean audit`` kept for the map a table's
    metadata ``doc`` records; None without an applied map (or its summary: an earlier release)."""
    from pairclean.audit.run import applied_summary_name
    from pairclean.output.report import audit_map

    applied = audit_map(doc)
    if applied is None or not isinstance(applied.get("map_sha256"), str):
        return None
    summary = schema.json_object(out.store.get(applied_summary_name(applied["map_sha256"])))
    value = (summary or {}).get("expected_noise")
    return float(value) if isinstance(value, (int, float)) and 0.0 <= value <= 1.0 else None
