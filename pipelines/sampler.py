"""Trainer-facing use of the weights: a WebDataset stage and a distributed weighted sampler.

Light on purpose: numpy and pyarrow only (torch and webdataset are optional and never
imported here). ``import pairclean.sampler`` is safe in any training environment.

- ``WeightStore`` joins weights by ``__key__`` from a job's per-shard Parquet, loading
  one shard's file the first time one of its samples is seen.
- ``WeightStage`` is a WebDataset pipeline stage (an iterator of samples in, an iterator
  of samples out), a plain module-level class so DataLoader workers can pickle it under
  every start method (``fork``, ``forkserver``, ``spawn``): it stores the weight under
  ``WEIGHT_KEY`` (``"__pairclean_weight__"``), which webdataset's decoders pass through
  untouched, so it can sit anywhere before ``rename``/``to_tuple`` (before ``decode`` too).
  Mode ``loss`` only adds the weight, ``sample`` keeps a sample with probability
  ``min(1, w / w_cap)`` (seeded, deterministic per rank), ``keep`` drops pairs flagged
  noisy, ``pseudo`` replaces a noisy pair's caption and weight by its RCSL pseudo-caption
  (``pairclean.pseudo.pairing.PseudoCaptions``, from ``pairclean pseudo-pair``). ``weight_stage``
  is the older factory (weight in ``sample["weight"]`` unless told otherwise).
- ``WeightedSampler`` draws indices of a map-style dataset in proportion to weights, for
  any number of weights (no 2^24 limit), each rank its own slice, reseeded by ``set_epoch``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from numpy.typing import NDArray

from pairclean.errors import InputError, first_line
from pairclean.schema import (FAILED_DIR, IMAGE_EXTS, JOB_FILE, REWRITE_FILE, changed_since, checked_weights, json_object, local_side_path,
                              repeated_keys, utf8_text)
from pairclean.storage import open_regular
from pairclean.uris import local_path, shard_stem

__all__ = [
    "MISSING_POLICIES",
    "MODES",
    "WEIGHT_KEY",
    "PSEUDO_KEY",
    "WeightStore",
    "WeightStage",
    "weight_stage",
    "WeightedSampler",
    "read_table_columns",
]

log = logging.getLogger(__name__)


def read_table_columns(path: Path, columns: list[str], optional: tuple[str, ...] = (), data: bytes | None = None) -> Any:
    """``columns`` (and those of ``optional`` the file has) of the score table at ``path``
    (or of its bytes ``data``, read already); ``InputError`` naming the file where it is not
    such a table (pyarrow's own error is a traceback), and a FIFO under its name is refused
    before any read (it hung the reader)."""
    import io

    import pyarrow as pa

    try:
        with (open_regular(path) if data is None else io.BytesIO(data)) as fh:
            names = pq.read_schema(fh).names if optional else []
            fh.seek(0)
            return pq.read_table(fh, columns=columns + [c for c in optional if c in names])
    except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
        wanted = ", ".join(columns[:-1]) + f" and {columns[-1]}"
        raise InputError(f"{path} is not a readable pairclean table with {wanted} ({first_line(exc)})", uri=str(path)) from None


#: One shard's rows as ``WeightStore`` holds them: (weight, noisy) by key, and the byte sizes
#: of each key's image and caption members as scored (where the table records them).
_Rows = tuple[dict[str, tuple[float, bool]], dict[str, int], dict[str, int]]

MODES = ("loss", "sample", "keep", "pseudo")
MISSING_POLICIES = ("error", "skip", "default")
_CHUNK = 1 << 20  # weights processed per chunk: bounds temporary memory
#: Where ``WeightStage`` puts the weight. Keys starting with ``__`` are passed through
#: unchanged by webdataset's ``decode`` (0.2.x and 1.x), so the stage may run before it.
WEIGHT_KEY = "__pairclean_weight__"
#: True when mode ``pseudo`` substituted the caption of this sample.
PSEUDO_KEY = "__pairclean_pseudo__"
class WeightStore:
    """Weights and noisy flags of one job's output folder, loaded lazily per shard.

    ``get(url, key)`` -> ``(weight, noisy)`` or None when the shard or key has no row.
    Only the tables of the job's committed shards are read, each checked against its
    completion record (the SHA-256 pairclean wrote): a shard with no committed table (not
    scored, scoring failed, not yet recorded by a run still going or killed) counts as
    missing, not as an error; a committed table changed since (edited, re-saved by another
    tool) is an ``InputError``.
    """

    def __init__(self, output_dir: str | os.PathLike[str], max_cached_shards: int = 64) -> None:
        self.root = Path(_output_folder(os.fspath(output_dir)))
        if not self.root.is_dir():
            raise FileNotFoundError(f"pairclean output folder not found: {self.root}")
        if not Path(local_side_path(self.root, JOB_FILE)).is_file():
            # Any folder used to do: with missing="default" a typo (the shards' folder, the
            # side folder, an empty one) trained every sample at the default weight, silently.
            raise InputError(f"{self.root} is not a pairclean output folder (no {local_side_path(self.root, JOB_FILE)}): "
                             "give the --out of `pairclean score`", uri=str(self.root))
        self._refuse_interrupted_rewrite()
        self.max_cached = max_cached_shards
        self._cache: dict[str, _Rows] = {}
        self._committed: dict[str, Any] | None = None
        self._spec_stems: set[str] | None = None  # read where a shard is missing (``why_missing``)
        self._caption_ext = _caption_ext(_job_spec(self.root))
        self._warned: set[str] = set()
        self._warned_keys: set[str] = set()
        self._warned_decoded = False

    def _refuse_interrupted_rewrite(self) -> None:
        """``InputError`` while a rescore, refine or audit rewrites the tables, or after one
        was interrupted (``OutputDir.check_tables_whole``, without the store)."""
        if Path(local_side_path(self.root, REWRITE_FILE)).exists():
            raise InputError(f"{self.root}: a pairclean rescore, refine or audit is rewriting the tables, or was "
                             "interrupted while rewriting the tables (some hold its weights, some the earlier ones): let it "
                             "finish, or run it again, before training", uri=str(self.root))

    def _records(self, again: bool = False) -> dict[str, Any]:
        """The job's committed shards by stem (``OutputDir.committed``), read once per store
        and per DataLoader worker (the stage is copied without them), and ``again`` where
        what they say no longer fits (``served``, ``table_bytes``). Why: a table in OUT is
        not a shard's weights until its run recorded it; a quarantined shard's old table, or
        one a killed run wrote and never recorded, was served as if it were."""
        if self._committed is None or again:
            from pairclean.output.folder import OutputDir

            self._committed = OutputDir(str(self.root)).committed()
        return self._committed

    def served(self, stem: str) -> bool:
        """Whether shard ``stem`` has a committed table here (its samples are joined to it).
        A table the records read earlier do not name sends for them again: a store that lives
        through training (persistent workers) meets shards a live job committed since."""
        if not (self.root / f"{stem}.parquet").exists():
            return False
        return stem in self._records() or stem in self._records(again=True)

    def _load(self, stem: str) -> _Rows:
        if stem in self._cache:
            return self._cache[stem]
        # Again at each shard's first read, not only when the stage was built: DataLoader
        # workers copy the stage every epoch, and a rescore may have begun rewriting since.
        self._refuse_interrupted_rewrite()
        path = self.root / f"{stem}.parquet"
        if self.served(stem):
            rows = self._read(path, stem, self.table_bytes(stem))
        else:
            rows = ({}, {}, {})
            self._say_missing(stem)
        if len(self._cache) >= self.max_cached:
            self._cache.pop(next(iter(self._cache)))  # shards stream in order: drop the oldest
        self._cache[stem] = rows
        return rows

    def why_missing(self, stem: str) -> str:
        """Why shard ``stem`` has no committed table here: its scoring failed (with the error
        recorded), its table is not recorded (a run still going, or stopped before it
        recorded the shard), or the job never scored a shard of that name."""
        failed = Path(local_side_path(self.root, f"{FAILED_DIR}/{stem}.json"))
        if failed.is_file():
            try:
                error = str(json.loads(failed.read_text()).get("error", "")).splitlines()[0]
            except (ValueError, OSError, AttributeError, IndexError):
                error = "see its failure record"
            return f"its scoring failed ({error}); score it again, or leave the shard out of training"
        if (self.root / f"{stem}.parquet").exists():
            return ("its table is not recorded as committed: the job is still running, or a run was stopped before it "
                    "recorded the shard; run the job's `pairclean score` again to finish it")
        if self._spec_stems is None:
            shards = _job_spec(self.root).get("shards")
            self._spec_stems = {shard_stem(str(u)) for u in shards} if isinstance(shards, list) else set()
        if stem in self._spec_stems:
            return ("the job has not scored it yet (it is still running, or a run was stopped before it reached the "
                    "shard); run the job's `pairclean score` again to finish it")
        return "the job scored no shard of that name (another folder's, or renamed since?)"

    def say_unknown_key(self, stem: str, key: str, missing: str) -> None:
        """Warn once per shard that its table, present, has no row for ``key`` (the sample
        then follows ``missing``): the shard gained samples since it was scored, or its table
        lost rows (filtered and saved again). Under ``missing="default"`` such pairs trained
        at the default weight without a word."""
        if stem in self._warned_keys:
            return
        self._warned_keys.add(stem)  # looked at once per shard, warned or not (a table-less shard has its own warning)
        if self.served(stem):
            log.warning("shard %r: key %r (and maybe more) has no row in %s; such samples follow missing=%r: "
                        "the shard changed since it was scored, or its table lost rows (score it again)",
                        stem, key, self.root / f"{stem}.parquet", missing)

    def _say_missing(self, stem: str) -> None:
        """Warn once per shard that has no table (its samples then follow ``missing``)."""
        if stem not in self._warned:
            self._warned.add(stem)
            log.warning("no pairclean table for shard %r in %s: %s", stem, self.root, self.why_missing(stem))

    def table_bytes(self, stem: str) -> bytes:
        """The bytes of committed shard ``stem``'s table (``served``), as its completion record
        names them (SHA-256 and size); ``InputError`` naming the file otherwise: a table edited
        or saved again since was served as the job's weights, while a rerun called it someone
        else's and left it."""
        path = self.root / f"{stem}.parquet"
        where = str(path)
        try:
            with open_regular(path) as fh:  # a FIFO under the table's name is refused, never read (it hung the reader)
                data: bytes = fh.read()
        except OSError as exc:
            raise InputError(f"{where} is not a readable pairclean table ({first_line(exc)})", uri=where) from None
        digest = hashlib.sha256(data).hexdigest()
        record = self._records()[stem]
        if (len(data), digest) != (record.bytes, record.sha256):
            # the records read earlier may predate a rescore, refine or audit that finished since
            # (a store that lives through training): read them again before calling it an edit
            record = self._records(again=True).get(stem, record)
        if (len(data), digest) != (record.bytes, record.sha256):
            raise InputError(f"{changed_since(where, record.bytes, len(data))}; edited "
                             "or saved again by another tool?): these are not the job's weights; put back the table "
                             "pairclean wrote, or move it away and run the job's `pairclean score` again, which scores "
                             "that shard again", uri=where)
        return data

    @staticmethod
    def _read(path: Path, stem: str, data: bytes) -> _Rows:
        """One shard's weights by key from its table's checked bytes ``data``
        (``table_bytes``), checked (``InputError`` naming the file): readable Parquet with
        key, weight and noisy; weights per ``checked_weights``; no key twice (which row would
        win?); and a ``shard`` column, where present, naming this shard (a table copied under
        another shard's name would join the wrong pairs). Also the byte sizes of each key's
        image and caption members as scored, where the table has them."""
        where = str(path)
        table = read_table_columns(path, ["key", "weight", "noisy"], optional=("shard", "status", "image_size", "caption_size"),
                                   data=data)
        weights = checked_weights(table.column("weight"), where)
        keys = table.column("key").to_pylist()
        noisy = table.column("noisy")
        if table.column("key").null_count or noisy.null_count:
            raise InputError(f"{where}: null keys or noisy flags; the table is damaged", uri=where)
        repeated = repeated_keys(keys, table.column("status").to_pylist() if "status" in table.column_names else None)
        if isinstance(repeated, str):
            raise InputError(f"{where}: key {repeated!r} appears more than once; the table is damaged", uri=where)
        if "shard" in table.column_names:
            others = {str(u) for u in table.column("shard").unique().to_pylist() if u is not None and shard_stem(str(u)) != stem}
            if others:
                raise InputError(f"{where}: its rows belong to shard {sorted(others)[0]!r}, not {stem!r}; "
                                 "a table copied under another name joins the wrong pairs", uri=where)
        flags = noisy.to_numpy(zero_copy_only=False)
        rows = {k: (float(w), bool(n)) for k, w, n in zip(keys, weights, flags)}
        # A key the shard holds twice names two samples the trainer cannot tell apart:
        # neither is weighted up (weight 0, noisy).
        rows.update({k: (0.0, True) for k in repeated})
        return rows, _sizes(table, "image_size", keys, repeated), _sizes(table, "caption_size", keys, repeated)

    def get(self, url: str, key: str) -> tuple[float, bool] | None:
        """``(weight, noisy)`` of ``key`` in ``url``'s shard, or None. The key as the table
        holds it (``utf8_text``): webdataset hands a key that is not UTF-8 over with lone
        surrogates, which ``pairclean score`` wrote escaped; it matched no row before."""
        return self._load(shard_stem(url))[0].get(utf8_text(key)[0])

    def image_size(self, url: str, key: str) -> int | None:
        """The byte size of the image member scored for ``key`` of ``url``'s shard (None: not recorded)."""
        return self._load(shard_stem(url))[1].get(utf8_text(key)[0])

    def caption_size(self, url: str, key: str) -> int | None:
        """The byte size of the member the caption of ``key`` of ``url``'s shard was read from (None: not recorded)."""
        return self._load(shard_stem(url))[2].get(utf8_text(key)[0])

    def check_image(self, sample: dict[str, Any], url: str, key: str) -> None:
        """``InputError`` when ``sample``'s undecoded image member (``jpg``, ``png``, ...), or
        the member its caption was read from (``txt``, or the job's ``--caption-field``), has
        another byte size than the one scored for its key: these weights belong to another
        shard of the same name (img2dataset names every folder's shards 00000.tar, ... and
        their keys 000000000, ...), or the shard changed since it was scored (captions
        rewritten in place kept the weights of the old ones). Decoded members (the stage
        placed after ``decode``) are not checked; the first such sample says so once."""
        where = self.root / (shard_stem(url) + ".parquet")
        expected = self.image_size(url, key)
        for ext in IMAGE_EXTS if expected is not None else ():
            value = sample.get(ext)
            if isinstance(value, (bytes, bytearray, memoryview)):
                if len(value) != expected:
                    raise InputError(
                        f"sample {key!r} of {url!r}: its {ext} member has {len(value)} bytes, the image scored for this key "
                        f"in {where} had {expected}: these are the weights of another "
                        "shard of the same name, or the shard changed since it was scored (score it again)", uri=url)
                break
            if value is not None:
                self._say_decoded(ext)
                break
        expected = self.caption_size(url, key)
        value = sample.get(self._caption_ext) if self._caption_ext is not None and expected is not None else None
        if isinstance(value, (bytes, bytearray, memoryview)) and len(value) != expected:
            raise InputError(
                f"sample {key!r} of {url!r}: its {self._caption_ext} member has {len(value)} bytes, the caption scored for "
                f"this key in {where} had {expected}: the shard's captions changed since it was scored (these weights judge "
                "the old ones: score it again), or these are the weights of another shard of the same name", uri=url)

    def _say_decoded(self, ext: str) -> None:
        """Warn once that samples arrive decoded: their members cannot be checked against the
        scored sizes (another folder's shard of the same name would take these weights)."""
        if not self._warned_decoded:
            self._warned_decoded = True
            log.warning("WeightStage sees decoded samples (%s is not bytes): it cannot check that each sample is the one "
                        "scored (another folder's shard of the same name, or a shard changed since, would take these "
                        "weights); place it before decode for that check", ext)

    def __getstate__(self) -> dict[str, Any]:
        # Workers get the configuration, not the parent's cache: pickles stay small under
        # spawn/forkserver and each worker loads only the shards it reads.
        state = self.__dict__.copy()
        state["_cache"], state["_committed"], state["_spec_stems"] = {}, None, None
        return state


def _sizes(table: Any, column: str, keys: list[str], repeated: Iterable[str]) -> dict[str, int]:
    """Each key's member size in ``column`` of ``table`` (keys held twice and nulls left out;
    none where the table has no such column)."""
    if column not in table.column_names:
        return {}
    twice = set(repeated)
    return {k: int(n) for k, n in zip(keys, table.column(column).to_pylist()) if n is not None and k not in twice}


def _job_spec(root: Path) -> dict[str, Any]:
    """The spec in the job record of the output folder ``root`` ({} where it cannot be read)."""
    try:
        doc = json_object(Path(local_side_path(root, JOB_FILE)).read_bytes())  # a damaged record reads as none
    except OSError:
        return {}
    spec = (doc or {}).get("spec")
    return spec if isinstance(spec, dict) else {}


def _caption_ext(spec: dict[str, Any]) -> str | None:
    """The member a job's captions were read from, by the ``caption_field`` of its ``spec``:
    ``txt`` (the default), the member a leading dot names (``.caption``), or ``json`` (a
    field of the json member); None where it cannot be told (no caption check)."""
    from pairclean.schema import caption_member

    field = spec.get("caption_field")
    if not spec or (field is not None and not isinstance(field, str)):
        return None
    try:
        return "txt" if field is None else caption_member(field) or "json"
    except InputError:
        return None


def _output_folder(uri: str) -> str:
    """A local folder from a path or ``file://`` URI; one-line ``InputError`` for a URI of
    another scheme (``file:///x`` was taken as the relative path ``file:/x``: "not found").
    Anything without ``://`` is a path as given (``weights:v2`` is a folder name)."""
    if uri.startswith("file://"):
        return local_path(uri)
    if "://" not in uri:
        return os.path.abspath(uri)  # absolute: pyarrow reads "weights:v2/x.parquet" as a URI
    scheme = uri.split("://", 1)[0]
    raise InputError(f"{uri}: WeightStage reads a local output folder, not {scheme}://; copy the folder here first "
                     "(pairclean.read_scores reads it where it is)", uri=uri)


def _unit_hash(seed: int, rank: int, stem: str, key: str, epoch: int = 0) -> float:
    """A uniform number in [0, 1) fixed by (seed, rank, shard stem, key, epoch): reproducible
    decisions that depend neither on the order, the worker, nor the URL form the shard was
    read by (``s3://b/x.tar`` and ``pipe:aws s3 cp s3://b/x.tar -`` decide alike). Epoch 0
    hashes as releases before epochs did, so their first epoch keeps the same pairs."""
    text = f"{seed}:{rank}:{stem}:{key}" if epoch == 0 else f"{seed}:{rank}:{epoch}:{stem}:{key}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _read_epoch(source: Any) -> int:
    """The epoch a trainer shares: ``source.get_value()`` (open_clip's ``SharedEpoch``) or ``source()``."""
    getter = getattr(source, "get_value", None)
    return int(getter() if getter is not None else source())


class WeightStage:
    """A WebDataset stage joining pairclean weights by ``__key__`` within ``__url__``'s shard.

    Contract: ``stage(samples)`` yields the samples it keeps, each with
    ``sample[weight_key]`` = its Parquet row's ``weight`` (float). Place it anywhere in a
    ``wds.DataPipeline`` (or ``.compose(stage)``) where samples are still dicts with
    ``__key__`` and ``__url__``: before or after ``decode`` (before it, each sample's image
    and caption bytes are checked against the sizes scored for its key; after it they cannot
    be, and the first decoded sample says so), before ``rename(keep=False)`` and
    ``to_tuple``; then name ``WEIGHT_KEY`` in those (``wds.to_tuple("jpg", "txt",
    WEIGHT_KEY)``). The stem of ``__url__`` comes from ``pairclean.uris.shard_stem``, so
    ``pipe:`` commands, query strings and every scheme join to the same Parquet file.

    Modes: ``loss`` keeps every sample; ``sample`` keeps one with probability
    ``min(1, w / w_cap)``, decided by a hash of (seed, rank, shard, key, epoch), so over
    epochs a pair of weight 0.3 is seen in about 30% of them (not in all or none); ``keep`` drops
    pairs flagged noisy; ``pseudo`` is ``loss`` where a noisy pair with a pseudo-pair gets
    the pseudo-caption (its own caption field, e.g. ``txt``) and weight, and
    ``sample[pseudo_key] = True`` (False otherwise). ``pseudo`` is a ``PseudoCaptions``
    (default: one over ``output_dir``). ``missing``: ``error`` raises ``KeyError``,
    ``skip`` drops the sample, ``default`` gives it weight ``default`` (counted clean).

    A plain class of plain attributes: picklable, so DataLoader workers get it under any
    start method (the weight cache is not pickled; each worker loads what it reads).

    Epochs: each pass over the samples in one process is the next epoch (a loop over the
    pipeline, or ``persistent_workers=True``); ``set_epoch(e)`` sets the first one, as
    ``DistributedSampler.set_epoch`` does, for DataLoader workers that get a fresh copy of
    the stage every epoch (the default): call it before each epoch's iteration.
    ``epoch_source``: where a trainer already shares its epoch with the workers (open_clip's
    ``SharedEpoch``: anything with ``get_value()``, or a callable), each sample is drawn
    with the epoch it reads there instead, so a run resumed at epoch k draws what an
    uninterrupted one does, and passes that a loader restarts or cuts short inside an epoch
    (open_clip's ``with_epoch``) keep that epoch's draw. ``pairclean.openclip`` and
    ``pairclean.open_clip_train`` pass open_clip's.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        mode: str = "loss",
        *,
        w_cap: float = 1.0,
        missing: str = "error",
        default: float = 1.0,
        seed: int = 0,
        rank: int = 0,
        pseudo: Any = None,
        weight_key: str = WEIGHT_KEY,
        pseudo_key: str = PSEUDO_KEY,
        epoch_source: Any = None,
        max_cached_shards: int = 64,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if missing not in MISSING_POLICIES:
            raise ValueError(f"missing must be one of {MISSING_POLICIES}, not {missing!r}")
        if not (isinstance(w_cap, (int, float)) and math.isfinite(w_cap) and w_cap > 0):
            raise ValueError(f"w_cap must be a finite positive number, not {w_cap!r}")
        if not (isinstance(default, (int, float)) and math.isfinite(default) and 0 <= default <= 1):
            raise ValueError(f"default must be a weight in [0, 1], not {default!r}")
        if not (isinstance(max_cached_shards, int) and max_cached_shards >= 1):
            raise ValueError(f"max_cached_shards must be a whole number >= 1, not {max_cached_shards!r}")
        self.store = WeightStore(output_dir, max_cached_shards=max_cached_shards)
        if mode == "pseudo" and pseudo is None:
            from pairclean.pseudo.pairing import PseudoCaptions

            pseudo = PseudoCaptions(output_dir)
        self.mode, self.w_cap, self.missing, self.default = mode, w_cap, missing, default
        self.seed, self.rank, self.pseudo = seed, rank, pseudo
        self.weight_key, self.pseudo_key = weight_key, pseudo_key
        self.epoch, self._passes = 0, 0
        self.epoch_source = epoch_source

    def set_epoch(self, epoch: int) -> None:
        """Decide ``sample`` mode's pairs for ``epoch`` (and count later passes from it)."""
        self.epoch, self._passes = int(epoch), 0

    def __call__(self, samples: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        source = self.epoch_source
        epoch = self.epoch + self._passes
        self._passes += 1
        for sample in samples:
            out = self.apply(sample, epoch if source is None else _read_epoch(source))
            if out is not None:
                yield out

    def apply(self, sample: dict[str, Any], epoch: int | None = None) -> dict[str, Any] | None:
        """One sample: itself with its weight, or None when the mode drops it (``epoch``:
        the ``sample`` mode's draw; default the stage's current epoch)."""
        if not isinstance(sample, dict) or "__key__" not in sample:
            raise TypeError(
                "pairclean's WeightStage needs samples with '__key__' (and '__url__'): place it "
                "before rename(keep=False) and to_tuple in the pipeline, not after"
            )
        url, key = str(sample.get("__url__", "")), str(sample["__key__"])
        found = self.store.get(url, key)
        if found is not None:
            self.store.check_image(sample, url, key)
        else:
            if self.missing == "error":
                stem = shard_stem(url)
                why = "the shard's table has no such key" if self.store.served(stem) else self.store.why_missing(stem)
                raise KeyError(f"no pairclean weight for key {key!r} of shard {url!r} (stem {stem!r}) in {self.store.root}: {why}")
            self.store.say_unknown_key(shard_stem(url), key, self.missing)
            if self.missing == "skip":
                return None
            found = (self.default, False)
        weight, noisy = found
        if self.mode == "keep" and noisy:
            return None
        draw = self.epoch if epoch is None else epoch
        if self.mode == "sample" and _unit_hash(self.seed, self.rank, shard_stem(url), key, draw) >= min(1.0, weight / self.w_cap):
            return None
        # Modes keep/sample used to add nothing: with the old "weight" key they still add
        # nothing (a float there would break a later decode); a "__" key is always safe.
        if self.mode in ("loss", "pseudo") or self.weight_key.startswith("__"):
            sample[self.weight_key] = weight
        if self.mode == "pseudo":
            sample[self.pseudo_key] = bool(noisy) and self.pseudo.substitute(sample, url, key, weight_key=self.weight_key)
        return sample


def weight_stage(
    output_dir: str | os.PathLike[str],
    mode: str = "loss",
    *,
    w_cap: float = 1.0,
    missing: str = "error",
    default: float = 1.0,
    seed: int = 0,
    rank: int = 0,
    pseudo: Any = None,
    weight_key: str = "weight",
    pseudo_key: str = "pseudo",
) -> WeightStage:
    """The older spelling of ``WeightStage``: the same stage, but the weight goes to
    ``sample["weight"]`` and the pseudo flag to ``sample["pseudo"]`` by default (as before),
    so place it after ``decode`` (a non-``__`` key holding a float breaks webdataset's
    decoder) or pass ``weight_key=WEIGHT_KEY``."""
    return WeightStage(
        output_dir, mode, w_cap=w_cap, missing=missing, default=default, seed=seed, rank=rank,
        pseudo=pseudo, weight_key=weight_key, pseudo_key=pseudo_key,
    )


def _unit_float32(weights: NDArray[np.floating[Any]] | Iterable[float]) -> NDArray[np.float32]:
    """The weights checked (a non-empty 1-D array, finite, >= 0, one > 0) in their own
    precision, then (unless float32 already) scaled to a largest weight of 1 and stored as
    float32 (4 bytes a weight).

    Scaling first, because the draw depends only on ratios: cast as given, float64 weights
    of 1e-60 all became 0 ("no positive weight") and 1e39 became inf ("not finite"). A weight
    still too small for float32 against the largest keeps the smallest float32 above 0: it
    is drawn last, never dropped."""
    given = np.asarray(weights)
    wide = np.result_type(given.dtype, np.float64) if given.dtype.kind in "fiub" else np.dtype(np.float64)
    raw = given if given.dtype == np.float32 else np.asarray(given, dtype=wide)  # longdouble stays longdouble
    if raw.ndim != 1 or raw.size == 0:
        raise ValueError("weights must be a non-empty 1-D array")
    if not np.all(np.isfinite(raw)) or (raw < 0).any():
        raise ValueError("weights must be finite and non-negative")
    top = raw.max()
    if not top > 0:
        raise ValueError("at least one weight must be positive")
    if raw.dtype == np.float32:
        return raw.astype(np.float32, copy=False)  # storable as they are: no copy of 50 million weights
    w: NDArray[np.float32] = (raw / top).astype(np.float32)
    w[(w == 0) & (raw > 0)] = np.finfo(np.float32).smallest_subnormal
    return w


def _check_seed(value: int, what: str) -> None:
    """``ValueError`` unless ``value`` is a whole number >= 0 (numpy's generators take no other)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{what} must be a whole number >= 0, not {value!r}")


class WeightedSampler:
    """Indices of a map-style dataset drawn in proportion to ``weights``, sliced per rank.

    - any length (50 million and more; no 2^24 limit). With replacement, draws go chunk by
      chunk (a chunk by its total weight, then an index inside it), so temporary memory is
      O(chunk + num_samples); without replacement one float32 key per weight is needed;
    - ``num_samples`` (default: one per weight) is the draw of all ranks together; each rank
      yields ``ceil(num_samples / world_size)`` indices, the same number on every rank (as
      ``torch.utils.data.DistributedSampler`` pads), so no rank waits at the last collective;
    - ``replacement=True``: each rank draws its share as independent indices;
    - ``replacement=False``: one global weighted permutation (Efraimidis-Spirakis keys),
      dealt to ranks round-robin, so ranks never share an index within an epoch (where
      ``num_samples`` does not divide evenly, the first few of the permutation are dealt
      again to fill the last round, as ``DistributedSampler`` does). A weight of 0 is never drawn;
    - ``set_epoch(e)`` reseeds, as ``torch.utils.data.DistributedSampler`` does.

    Works as a ``sampler=`` of a torch ``DataLoader`` (it has ``__iter__`` and ``__len__``).
    """

    def __init__(
        self,
        weights: NDArray[np.floating[Any]] | Iterable[float],
        num_samples: int | None = None,
        *,
        replacement: bool = True,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        w = _unit_float32(weights)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        _check_seed(seed, "seed")
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer))
                                        or num_samples < 0):
            raise ValueError(f"num_samples must be a whole number >= 0, not {num_samples!r}")
        self.weights = w
        self.replacement = replacement
        self.rank, self.world_size, self.seed = rank, world_size, seed
        positive = int((w > 0).sum())
        total = num_samples if num_samples is not None else w.size
        if not replacement and total > positive:
            raise ValueError(f"cannot draw {total} samples without replacement from {positive} positive weights")
        self.total = total
        self.epoch = 0
        # Chunk totals are the only O(N / chunk) state kept between epochs.
        self._chunk_sums = np.array([w[i : i + _CHUNK].sum(dtype=np.float64) for i in range(0, w.size, _CHUNK)])

    def set_epoch(self, epoch: int) -> None:
        """Draw a different, reproducible sequence for ``epoch`` (a whole number >= 0)."""
        _check_seed(epoch, "epoch")
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil(self.total / self.world_size)

    def __iter__(self) -> Iterator[int]:
        indices = self._with_replacement() if self.replacement else self._without_replacement()
        return iter(indices.tolist())

    def _rng(self, *extra: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, *extra])

    def _with_replacement(self) -> NDArray[np.int64]:
        rng = self._rng(self.rank)
        n = len(self)
        # Two-level draw: a chunk by its total weight, then an index inside it.
        probs = self._chunk_sums / self._chunk_sums.sum()
        per_chunk = rng.multinomial(n, probs)
        out = np.empty(n, dtype=np.int64)
        pos = 0
        for c, count in enumerate(per_chunk):
            if count == 0:
                continue
            start = c * _CHUNK
            cdf = np.cumsum(self.weights[start : start + _CHUNK], dtype=np.float64)
            u = rng.random(count) * cdf[-1]
            out[pos : pos + count] = start + np.searchsorted(cdf, u, side="right")
            pos += count
        rng.shuffle(out)  # chunk order must not leak into the sample order
        return out

    def _without_replacement(self) -> NDArray[np.int64]:
        rng = self._rng()  # the same global permutation on every rank
        keys = np.empty(self.weights.size, dtype=np.float32)
        for start in range(0, self.weights.size, _CHUNK):
            w = self.weights[start : start + _CHUNK]
            e = rng.exponential(size=w.size)
            # log(E / w), in float64 before the float32 store: E / w itself overflows float32
            # for tiny weights, and an overflowed key ties with a zero weight's +inf.
            with np.errstate(divide="ignore"):
                keys[start : start + _CHUNK] = np.where(w > 0, np.log(e) - np.log(w.astype(np.float64)), np.inf)
        # Smallest E/w first is a weighted sample without replacement (Efraimidis-Spirakis).
        top = np.argpartition(keys, self.total - 1)[: self.total] if self.total < keys.size else np.arange(keys.size)
        order = top[np.argsort(keys[top], kind="stable")]
        padded = np.resize(order, len(self) * self.world_size)  # wraps around: every rank gets len(self)
        return padded[self.rank :: self.world_size].astype(np.int64)
