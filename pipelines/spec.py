"""The job spec: everything that determines a job's outputs, and its digest.

Two runs with equal specs write equal files; the digest is written into every data file
as its owner (``pairclean.output.folder``) and a resumed job must match it.
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pairclean.errors import InputError
from pairclean.schema import caption_member, utf8_text
from pairclean.uris import LOCAL_SCHEMES, local_path, scheme_of, shard_stem

__all__ = ["JobSpec", "spec_digest", "spec_diff"]


@dataclass(frozen=True)
class JobSpec:
    """Everything that determines a job's outputs. Two runs with equal specs write equal files.

    Device and thread counts are deliberately absent: a job may resume elsewhere.
    """

    shards: tuple[str, ...]
    model: str
    checkpoint: str | None
    pretrained: str | None
    precision: str
    beta_recipe: str
    beta_k: int
    weighting: str
    seed: int
    batch_size: int
    max_pixels: int
    caption_field: str | None
    embeddings: bool
    calibration_pairs: int
    #: "cpu" (PIL) or "cuda" (batched nvJPEG): pixels differ slightly, so it is part of the spec.
    decode_device: str = "cpu"
    #: The judge (issue 21): "off", "band" (the pairs of the band ``judge_budget`` buys) or
    #: "all"; its weights file and their sha256 (a different judge is a different job).
    judge: str = "off"
    judge_budget: float | None = None
    judge_checkpoint: str | None = None
    judge_sha256: str | None = None
    #: Corpus contrast (``pairclean.calibrate.contrast``): weights from the adjusted
    #: similarity. False for specs written before it (their calibrations have none).
    contrast: bool = False

    def __post_init__(self) -> None:
        """``InputError`` (one line) for counts that cannot run: a job of them did nothing and
        reported success (``--calibration-pairs 0``), or refused every image (``--max-pixels -5``);
        and for a ``caption_field`` naming a member that cannot hold a caption (``.jpg``)."""
        for name in ("batch_size", "max_pixels", "calibration_pairs", "beta_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"--{name.replace('_', '-')} must be a whole number of at least 1, got {value!r}")
        caption_member(self.caption_field)  # a member name that cannot hold the caption: one line

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (``shards`` as a list). The judge's fields only when it
        is on: a job without one keeps the spec (and digest) it had before judges existed."""
        data = asdict(self)
        data["shards"] = list(self.shards)
        if self.judge == "off":
            for name in ("judge", "judge_budget", "judge_checkpoint", "judge_sha256"):
                del data[name]
        if not self.contrast:
            del data["contrast"]  # a job without it keeps the digest it had before contrast existed
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobSpec:
        """Inverse of ``to_json``; unknown keys are an error (a newer pairclean wrote it)."""
        fields = dict(data)
        fields["shards"] = tuple(fields["shards"])
        return cls(**fields)

    def stems(self) -> dict[str, str]:
        """Shard URI -> output stem; raises ``InputError`` when two shards would collide."""
        seen: dict[str, str] = {}
        seen_folded: dict[str, str] = {}
        for uri in self.shards:
            _check_utf8_name(uri)
            stem = shard_stem(uri)
            if not stem or stem[0] in "._":
                # pyarrow.dataset, pandas and Spark skip files named so as hidden or private:
                # the table would be written and then silently missing from the dataset.
                raise InputError(f"shard {uri!r}: its table would be named {stem + '.parquet'!r}, which pyarrow, pandas "
                                 "and Spark skip as a hidden file; rename the shard (or link it under a name not "
                                 "beginning with '.' or '_')", uri=uri)
            if stem in seen:
                if _same_local_file(seen[stem], uri):
                    raise InputError(f"shards {seen[stem]!r} and {uri!r} are the same file, listed twice; list it once", uri=uri)
                raise InputError(
                    f"shards {seen[stem]!r} and {uri!r} share the name {stem!r}: their outputs "
                    "would collide in one folder; score them into separate output folders",
                    uri=uri,
                )
            folded = _folded(stem)
            if folded in seen_folded:
                # macOS and Windows file systems (and some object stores' gateways) take names
                # that differ only in case or Unicode normalisation for one file: the second
                # table would overwrite the first there
                raise InputError(
                    f"shards {seen_folded[folded]!r} and {uri!r} have names that differ only in case or Unicode "
                    f"normalisation: their outputs would collide on a case-insensitive file system; rename one, or score "
                    "them into separate output folders", uri=uri)
            seen[stem] = seen_folded[folded] = uri
        return {uri: stem for stem, uri in seen.items()}


def _folded(stem: str) -> str:
    """The stem as a case- and normalisation-insensitive file system compares it (simple case
    mapping, as APFS and NTFS: "straße" and "STRASSE" are two files there)."""
    return unicodedata.normalize("NFC", stem).lower()


def _check_utf8_name(uri: str) -> None:
    """``InputError`` for a shard whose name is not UTF-8 (a local file name decoded with
    ``surrogateescape``, found by a glob): its table, records and rows are named after it, in
    UTF-8, so it failed the job at its first write, with a traceback."""
    shown, utf8 = utf8_text(uri)
    if not utf8:
        raise InputError(f"shard '{shown}': its name is not UTF-8 (bytes shown escaped); rename it", uri=shown)


def _same_local_file(a: str, b: str) -> bool:
    """Whether two local shard URIs name one file (``k/x.tar`` and ``./k/x.tar``)."""
    if scheme_of(a) not in LOCAL_SCHEMES or scheme_of(b) not in LOCAL_SCHEMES:
        return False
    try:
        return os.path.samefile(local_path(a), local_path(b))
    except OSError:
        return False


def spec_digest(spec: JobSpec) -> str:
    """sha256 of the spec (deterministic): written into every data file as its owner."""
    return hashlib.sha256(json.dumps(spec.to_json(), sort_keys=True).encode()).hexdigest()


def _shards_diff(before: list[str], now: list[str]) -> str:
    """What differs between two shard lists, naming the first shard that does ("3 before, 3
    now" named no difference when a relative path was typed from another folder)."""
    where = f"{len(before)} before, {len(now)} now"
    for i, (x, y) in enumerate(zip(before, now)):
        if x != y:
            hint = " (a relative path? give them as the first run did)" if os.path.basename(x) == os.path.basename(y) else ""
            return f"shards: {where}; shard {i + 1} was {x!r}, now {y!r}{hint}"
    return f"shards: {where}"


def spec_diff(old: JobSpec, new: JobSpec) -> str:
    a, b = asdict(old), asdict(new)  # every field (to_json leaves out an unused judge's)
    changed = [k for k in a if a[k] != b[k]]
    parts = []
    for key in changed[:4]:
        if key == "shards":
            parts.append(_shards_diff(a[key], b[key]))
        else:
            parts.append(f"{key}: {a[key]!r} before, {b[key]!r} now")
    return "; ".join(parts)
