"""Embedding one shard: pairs in, similarities and embeddings out (tables: ``pairclean.output.tables``).

``score_shard`` reads in a background thread (bounded queue) that decodes on a thread
pool (``decode_workers``) or a GPU (``decode_device``) while the calling thread runs the
model, so decoding overlaps the forward pass. It never fails for a bad sample (that
becomes a status row), only for a bad shard.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray
from pairclean import osa, schema
from pairclean.embed.estimators import Estimator
from pairclean.errors import InputError
from pairclean.read.decode import (
    DEFAULT_MAX_PIXELS,
    DecodeFailure,
    SplitPreprocess,
    TensorPreprocess,
    decode_and_preprocess,
    decode_jpeg_batch,
    decode_pixels,
    split_preprocess_of,
    tensor_preprocess_of,
)
from pairclean.read.shards import Deadline, PairSample, ReadOptions, ReadStats, iter_pairs
from pairclean.read.words import content_word_count

__all__ = [
    "ScoreOptions",
    "ShardResult",
    "score_shard",
]

log = logging.getLogger(__name__)

#: Accepted ``ScoreOptions.decode_device`` values.
_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class ScoreOptions:
    """How pairs are read, decoded and batched.

    ``prefetch``: decoded batches buffered ahead of the model. ``decode_workers``:
    threads that decode and preprocess the images of a batch in parallel (size it to the
    CPUs the process is given, e.g. a Ray actor's ``num_cpus``); any value gives the same
    results, bit for bit. ``decode_device``: ``cpu``, or ``cuda[:i]`` to decode JPEGs in
    one nvJPEG call per batch and preprocess on that GPU (other images are decoded on the
    CPU, with the same statuses); an estimator whose preprocess is not a plain
    resize / centre-crop / normalise stays on the CPU path.
    ``time_limit_s``: seconds one shard may take, reading, decoding and embedding together
    (``ShardTimeoutError`` past it; None: no limit). The reader checks it at every read of
    the shard's bytes, the scorer after every batch.
    """

    batch_size: int = 64
    max_pixels: int = DEFAULT_MAX_PIXELS
    read: ReadOptions = ReadOptions()
    prefetch: int = 2
    decode_workers: int = 1
    decode_device: str = "cpu"
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        if self.time_limit_s is not None and not 0 < self.time_limit_s < float("inf"):
            raise InputError(f"a shard's time limit must be a positive number of seconds, got {self.time_limit_s}")
        if self.decode_workers < 1:
            raise InputError(f"decode_workers must be >= 1, got {self.decode_workers}")
        if not _DEVICE_RE.fullmatch(self.decode_device):
            raise InputError(f"decode_device must be cpu, cuda or cuda:N, got {self.decode_device!r}")


@dataclass
class ShardResult:
    """Everything scored from one shard, rows in tar order.

    ``similarity`` is NaN for rows whose status is not ``ok``; their embedding rows are
    zero and ``ok_mask`` is False. ``members``: the ``schema.MEMBER_COLUMNS`` by name (rows
    read from a tar; None for pairs scored from memory).
    """

    uri: str
    keys: list[str]
    idx: NDArray[np.int64]
    status: list[str]
    error: list[str | None]
    similarity: NDArray[np.float32]
    image_emb: NDArray[np.float32]
    text_emb: NDArray[np.float32]
    uid: list[str | None] | None
    url: list[str | None] | None
    timings: dict[str, float] = field(default_factory=dict)
    members: dict[str, list[int | None]] | None = None
    #: The judge's log likelihood ratios clean : noisy (N,), NaN where not judged; None
    #: when the shard was scored without a judge.
    judge_llr: NDArray[np.float32] | None = None
    #: The size of the shard as opened and read (``ReadStats``); None for pairs scored from
    #: memory, or a stream that does not say.
    read_bytes: int | None = None
    #: The local shard's modification time as opened (``ReadStats.mtime_ns``), else None.
    read_mtime_ns: int | None = None
    #: How many content words each pair's caption has (N,) int16
    #: (``pairclean.read.words.content_word_count``), -1 where the row is not ok; the corpus
    #: contrast's shared-caption rule reads it. None: not known (a sidecar written before it).
    caption_words: NDArray[np.int16] | None = None

    @property
    def ok_mask(self) -> NDArray[np.bool_]:
        return schema.ok_mask(self.status)

    def status_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(self.status).items()))

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class _Batch:
    seconds: float  # the reader thread's time on this batch (reading, decoding; not queue waits)
    rows: list[PairSample]
    statuses: list[str]
    errors: list[str | None]
    pixels: Any  # torch.Tensor of the ok rows, or their uint8 pixels when ``finish`` is set
    texts: list[str]
    ok_positions: list[int]
    finish: SplitPreprocess | None = None  # turns ``pixels`` into the model input, in the model's thread

    def model_input(self) -> Any:
        """The (N, 3, S, S) float tensor of the ok rows."""
        return self.finish.finish(self.pixels) if self.finish is not None else self.pixels


class BatchEncoder(Protocol):
    """Runs both towers on a batch in place of the plain pass and adds per-pair scores
    (``pairclean.judge.runner.JudgeRunner``): returns an object with ``image_emb`` and
    ``text_emb`` (N, D) float32 L2-normalised, ``llr`` (N,) float32 (NaN where not judged)
    and ``errors`` (N,) (None, or why that pair's judgement failed)."""

    def encode_batch(self, pixels: Any, texts: list[str]) -> Any: ...


_DONE = object()
#: Outcome of decoding one ok row: its preprocessed tensor, or why it failed.
_Outcome = Any


class _Decoder:
    """Decodes and preprocesses the ok images of batches: on a thread pool, on a GPU, or
    serially in the calling thread. One per ``score_shard`` call; ``close`` it.

    In two steps so the reader can hand batch k+1 to the pool before it waits on batch
    k (``lookahead``): the pool never idles at a batch boundary.
    """

    def __init__(self, estimator: Estimator, options: ScoreOptions) -> None:
        self.estimator = estimator
        self.max_pixels = options.max_pixels
        self.device = options.decode_device
        self.gpu = _gpu_preprocess(estimator, options.decode_device)
        # CPU decode threads stop at uint8 pixels when the preprocess allows (no torch op
        # off the model's thread: see decode.SplitPreprocess).
        self.split = split_preprocess_of(estimator.preprocess) if self.gpu is None else None
        self.pool = (
            ThreadPoolExecutor(options.decode_workers, thread_name_prefix="pairclean-decode")
            if options.decode_workers > 1
            else None
        )

    @property
    def lookahead(self) -> int:
        """Batches to start before collecting the oldest (only the CPU pool runs ahead)."""
        return 1 if self.pool is not None and self.gpu is None else 0

    def start(self, rows: list[PairSample]) -> list[Future[_Outcome]] | None:
        """Submit the CPU decodes of ``rows``' ok images to the pool; None when there is
        nothing to run ahead (no pool, or the GPU path, which decodes a batch at once)."""
        if self.lookahead == 0:
            return None
        assert self.pool is not None
        return [self.pool.submit(self._decode_cpu, data) for data in _ok_images(rows)]

    def outcomes(self, rows: list[PairSample], started: list[Future[_Outcome]] | None) -> list[_Outcome]:
        """One outcome per ok row of ``rows``, in order (waiting for ``start``'s futures)."""
        if started is not None:
            return [future.result() for future in started]
        images = _ok_images(rows)
        if self.gpu is not None:
            gpu = self.gpu
            return decode_jpeg_batch(
                images, self.max_pixels, gpu.image_size, gpu.mean, gpu.std, self.device, gpu.interpolation, self.pool
            )
        return [self._decode_cpu(data) for data in images]

    def close(self) -> None:
        """Stop the pool: queued decodes are cancelled, running ones finish (no thread outlives it)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _decode_cpu(self, data: bytes) -> _Outcome:
        est = self.estimator
        if self.split is not None:
            return decode_pixels(data, self.max_pixels, self.split, draft_size=est.image_size)
        return decode_and_preprocess(data, self.max_pixels, est.preprocess, draft_size=est.image_size)


def _gpu_preprocess(estimator: Estimator, device: str) -> TensorPreprocess | None:
    """The tensor preprocessing for ``device``'s batched JPEG path; None means the CPU path."""
    if device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        raise InputError(f"decode_device {device!r} requested but no CUDA device is visible")
    gpu = tensor_preprocess_of(estimator.preprocess)
    if gpu is None:
        log.info("preprocess of %s is not a plain resize/crop/normalise: decoding on the CPU", estimator.info.model_id)
    return gpu


def _ok_images(rows: list[PairSample]) -> list[bytes]:
    images = []
    for row in rows:
        if row.status == schema.STATUS_OK:
            assert row.image is not None and row.text is not None
            images.append(row.image)
    return images


def _prepare_batch(rows: list[PairSample], outcomes: list[_Outcome], image_size: int, started: float,
                   split: SplitPreprocess | None = None) -> _Batch:
    """Assemble a batch from ``rows`` and the decode outcomes of their ok rows (in order);
    with ``split``, outcomes are uint8 pixel arrays that the batch ``finish``es later."""
    import torch

    statuses, errors, tensors, texts, ok_positions = [], [], [], [], []
    decoded = iter(outcomes)
    for pos, row in enumerate(rows):
        status, error = row.status, row.error
        if status == schema.STATUS_OK:
            outcome = next(decoded)
            if isinstance(outcome, DecodeFailure):
                status, error = outcome.status, outcome.error
            else:
                tensors.append(outcome)
                assert row.text is not None  # an ok row has its caption
                texts.append(row.text)
                ok_positions.append(pos)
        statuses.append(status)
        errors.append(error)
    if split is not None and tensors:
        return _Batch(time.perf_counter() - started, rows, statuses, errors, np.stack(tensors), texts, ok_positions, split)
    pixels = torch.stack(tensors) if tensors else torch.zeros((0, 3, image_size, image_size))
    return _Batch(time.perf_counter() - started, rows, statuses, errors, pixels, texts, ok_positions)


#: A batch's image bytes at which it is cut early (``_batches``).
BATCH_IMAGE_BYTES = 256 * 2**20


def _batches(uri: str, options: ScoreOptions, samples: Iterable[PairSample] | None = None,
             stats: ReadStats | None = None, deadline: Deadline | None = None) -> Iterator[list[PairSample]]:
    """Pairs in batches of ``options.batch_size``, cut early once a batch's image bytes reach
    ``BATCH_IMAGE_BYTES``: members of up to 64 MiB are read whole, and a small ``.tar.gz``
    of zeros expanded to 32 of them a batch (8.8 GB held with the batches in flight)."""
    rows: list[PairSample] = []
    held = 0
    for pair in iter_pairs(uri, options.read, stats, deadline) if samples is None else samples:
        rows.append(pair)
        held += len(pair.image or b"")
        if len(rows) == options.batch_size or held >= BATCH_IMAGE_BYTES:
            yield rows
            rows, held = [], 0
    if rows:
        yield rows


def _put(out: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put ``item`` unless the consumer has stopped (then False): never blocks forever."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _producer(uri: str, decoder: _Decoder, options: ScoreOptions, out: queue.Queue[Any], stop: threading.Event,
              samples: Iterable[PairSample] | None = None, stats: ReadStats | None = None,
              deadline: Deadline | None = None) -> None:
    """Reader thread: read the tar (here, in order), decode via ``decoder``, queue batches.

    Ends with ``_DONE`` or the exception that stopped it, or silently once ``stop`` is set.
    """
    size = decoder.estimator.image_size
    try:
        started = time.perf_counter()
        pending: deque[tuple[list[PairSample], list[Future[_Outcome]] | None]] = deque()
        for rows in _batches(uri, options, samples, stats, deadline):
            pending.append((rows, decoder.start(rows)))
            if len(pending) <= decoder.lookahead:
                continue
            rows, futures = pending.popleft()
            if not _put(out, _prepare_batch(rows, decoder.outcomes(rows, futures), size, started, decoder.split), stop):
                return
            started = time.perf_counter()
        while pending:
            rows, futures = pending.popleft()
            if not _put(out, _prepare_batch(rows, decoder.outcomes(rows, futures), size, started, decoder.split), stop):
                return
            started = time.perf_counter()
        _put(out, _DONE, stop)
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises
        _put(out, exc, stop)


def _prepared_batches(uri: str, estimator: Estimator, options: ScoreOptions, samples: Iterable[PairSample] | None = None,
                      stats: ReadStats | None = None, deadline: Deadline | None = None) -> Iterator[_Batch]:
    """Batches of ``uri`` in tar order, read and decoded ahead in a background thread.

    At most ``prefetch`` prepared batches wait in the queue (plus the one or two the
    reader is working on), so memory stays bounded. When the consumer stops early or
    raises, closing this generator stops the reader and shuts the decode pool down.
    """
    decoder = _Decoder(estimator, options)
    q: queue.Queue[Any] = queue.Queue(maxsize=max(1, options.prefetch))
    stop = threading.Event()
    thread = threading.Thread(
        target=_producer, args=(uri, decoder, options, q, stop, samples, stats, deadline), name="pairclean-reader", daemon=True
    )
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        # The reader notices ``stop`` at its next queue put; a decode it waits on is short.
        thread.join(timeout=5)
        decoder.close()


def score_shard(uri: str, estimator: Estimator, options: ScoreOptions | None = None,
                samples: Iterable[PairSample] | None = None, judge: BatchEncoder | None = None) -> ShardResult:
    """Read, decode and embed every pair of the shard at ``uri``.

    ``samples``: pairs already in memory to score instead of reading ``uri`` (which then
    only names the result; the notebook API uses this). ``judge``: embeds each batch in
    the same pass and judges its pairs (``ShardResult.judge_llr``); a pair whose judgement
    fails gets the status ``judge_error`` and the reason. Raises ``ShardNotFoundError`` /
    ``ShardReadError`` (naming ``uri``) for a shard that cannot be read; per-sample
    failures are rows. ``ShardTimeoutError`` once the shard has taken longer than
    ``options.time_limit_s``; the reader thread stops at its next read.
    """
    opts = options or ScoreOptions()
    deadline = Deadline.after(opts.time_limit_s) if opts.time_limit_s is not None else None
    dim = estimator.info.embed_dim
    keys: list[str] = []
    idx: list[int] = []
    status: list[str] = []
    error: list[str | None] = []
    uid: list[str | None] = []
    url: list[str | None] = []
    spans: list[tuple[int, int] | None] = []  # image, caption, image, caption...
    sims: list[NDArray[np.float32]] = []
    img_parts: list[NDArray[np.float32]] = []
    txt_parts: list[NDArray[np.float32]] = []
    llr_parts: list[NDArray[np.float32]] = []
    word_parts: list[NDArray[np.int16]] = []
    read_decode = embed = 0.0
    stats = ReadStats()
    for batch in _prepared_batches(uri, estimator, opts, samples, stats, deadline):
        if deadline is not None:
            deadline.check(uri)
        read_decode += batch.seconds
        t0 = time.perf_counter()
        n = len(batch.rows)
        img = np.zeros((n, dim), dtype=np.float32)
        txt = np.zeros((n, dim), dtype=np.float32)
        llr = np.full(n, np.nan, dtype=np.float32)
        if batch.ok_positions and judge is not None:
            out = judge.encode_batch(batch.model_input(), batch.texts)
            img[batch.ok_positions], txt[batch.ok_positions] = out.image_emb, out.text_emb
            llr[batch.ok_positions] = out.llr
            for pos, err in zip(batch.ok_positions, out.errors):
                if err is not None:
                    batch.statuses[pos], batch.errors[pos] = schema.STATUS_JUDGE_ERROR, err
        elif batch.ok_positions:
            img[batch.ok_positions] = estimator.encode_images(batch.model_input())
            txt[batch.ok_positions] = estimator.encode_texts(batch.texts)
        llr_parts.append(llr)
        sim = np.full(n, np.nan, dtype=np.float32)
        sim[batch.ok_positions] = osa.cosine_rows(img[batch.ok_positions], txt[batch.ok_positions])
        # a pair the judge failed on is not ok: no similarity, no embeddings (as other statuses)
        failed = [pos for pos in batch.ok_positions if batch.statuses[pos] != schema.STATUS_OK]
        sim[failed], img[failed], txt[failed] = np.nan, 0.0, 0.0
        words = np.full(n, -1, dtype=np.int16)
        words[batch.ok_positions] = [min(content_word_count(t), np.iinfo(np.int16).max) for t in batch.texts]
        words[failed] = -1
        word_parts.append(words)
        embed += time.perf_counter() - t0
        sims.append(sim)
        img_parts.append(img)
        txt_parts.append(txt)
        for row in batch.rows:
            keys.append(row.key)
            idx.append(row.idx)
            uid.append(row.uid)
            url.append(row.url)
            spans += (row.image_span, row.caption_span)
        status.extend(batch.statuses)
        error.extend(batch.errors)
    return ShardResult(
        uri=uri,
        keys=keys,
        idx=np.asarray(idx, dtype=np.int64),
        status=status,
        error=error,
        similarity=np.concatenate(sims) if sims else np.zeros(0, np.float32),
        image_emb=np.concatenate(img_parts) if img_parts else np.zeros((0, dim), np.float32),
        text_emb=np.concatenate(txt_parts) if txt_parts else np.zeros((0, dim), np.float32),
        uid=uid if any(u is not None for u in uid) else None,
        url=url if any(u is not None for u in url) else None,
        # read_decode runs in the reader thread, overlapping embed: they do not add up.
        timings={"read_decode": round(read_decode, 4), "embed": round(embed, 4)},
        members=_member_columns(spans) if samples is None else None,
        judge_llr=(np.concatenate(llr_parts) if llr_parts else np.zeros(0, np.float32)) if judge is not None else None,
        read_bytes=stats.bytes,
        read_mtime_ns=stats.mtime_ns,
        caption_words=np.concatenate(word_parts) if word_parts else np.zeros(0, np.int16),
    )


def _member_columns(spans: list[tuple[int, int] | None]) -> dict[str, list[int | None]]:
    """The ``schema.MEMBER_COLUMNS`` from alternating (image, caption) spans."""
    images, captions = spans[0::2], spans[1::2]
    return {
        schema.COL_IMAGE_OFFSET: [s[0] if s else None for s in images],
        schema.COL_IMAGE_SIZE: [s[1] if s else None for s in images],
        schema.COL_CAPTION_OFFSET: [s[0] if s else None for s in captions],
        schema.COL_CAPTION_SIZE: [s[1] if s else None for s in captions],
    }
