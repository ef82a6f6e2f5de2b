"""pairclean: noisy-correspondence scoring for image-text WebDataset shards.

The import is light on purpose (numpy and pyarrow only): trainers import the sampler
from here without pulling in torch. Heavy modules load inside the functions that need them.

The folders follow the data flow (``docs/architecture.md``): ``read`` (shards, members,
decode) -> ``embed`` (estimators, one shard's embeddings) -> ``judge`` -> ``calibrate``
(beta, the frozen ``Calibration``) -> ``output`` (tables, the output folder, lock, report,
exports) -> ``job`` (runner, work, rescore, lifecycle); then ``refine``, ``pseudo``,
``audit``. Shared vocabulary at the top: ``errors``, ``schema``, ``spec``, ``uris``,
``storage``, ``osa``. For trainers ``sampler``, ``losses``, ``openclip``, and for notebooks
``api`` (``score_pairs``, ``load_estimator``, ``read_scores``); ``lite`` holds
pairclean-lite's training tools.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

__version__ = "0.1.0"

__all__ = ["__version__", "read_scores", "score_pairs", "load_estimator"]


def score_pairs(images: Sequence[Any], captions: Sequence[str], **kwargs: Any) -> Any:
    """Score in-memory image-caption pairs; see ``pairclean.api.score_pairs`` (needs torch)."""
    from pairclean.api import score_pairs as _score_pairs

    return _score_pairs(images, captions, **kwargs)


def load_estimator(model: str = "pairclean-lite", **kwargs: Any) -> Any:
    """Load an estimator once for ``score_pairs``; see ``pairclean.api.load_estimator``."""
    from pairclean.api import load_estimator as _load

    return _load(model, **kwargs)


def read_scores(
    out: str | os.PathLike[str],
    columns: Sequence[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> pa.Table:
    """Every committed score table of a job's output folder as one pyarrow Table.

    ``out``: a local folder, ``file://``, ``s3://`` or ``gs://`` URI (``storage_options``
    for endpoints and credentials). Rows come shard by shard in the job's order, only from
    committed shards (a half-written table is never read); ``columns`` selects columns
    (``key``, ``shard``, ``weight``, ``noisy``, ``similarity``, ...). ``.to_pandas()`` gives
    a DataFrame. Raises ``InputError`` when the folder holds no committed shard, and when a
    ``rescore``, ``refine`` or ``audit`` was interrupted while rewriting the tables (some
    would hold its weights, some the earlier ones: as ``WeightStage`` and ``export`` refuse).
    """
    from pairclean.output.folder import OutputDir

    folder = OutputDir(os.fspath(out), storage_options)
    folder.check_tables_whole()
    return folder.read_all_scores(list(columns) if columns is not None else None)
