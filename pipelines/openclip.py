"""pairclean weights inside open_clip's own WebDataset loader (``open_clip_train.data``).

``get_wds_dataset(args, preprocess_img, is_train, ..., weights=OUT)`` calls open_clip's
``get_wds_dataset`` unchanged and then edits the pipeline it built, in place, before any
worker starts (``weigh_pipeline``):

- a ``pairclean.sampler.WeightStage`` goes right before ``decode`` (samples dropped by
  modes ``keep``/``sample`` are never decoded; the weight key starts with ``__``, which
  webdataset's decoders pass through);
- ``rename`` also carries the weight (``weight=WEIGHT_KEY``), ``to_tuple`` returns it third:
  batches are ``(images, texts, weights)`` (plus ``keys, urls`` with ``with_keys=True``);
- open_clip's ``map_dict(text=lambda text: tokenizer(text)[0])`` is a lambda, which cannot
  be pickled: it is replaced by ``TokenizeText(tokenizer)``, so the loader works under the
  ``spawn`` and ``forkserver`` start methods too (``multiprocessing_context=``).

The stages are found by the webdataset function they wrap (``_decode``, ``_rename``,
``_map_dict``, ``_to_tuple``), as open_clip 3.x builds them; anything else raises
``RuntimeError`` naming what is missing, and TRAINING.md shows the same three-line edit
by hand. open_clip 3.3's loader needs ``webdataset<=0.2.86`` (its
``tarfile_to_samples_nothrow`` fails under 1.x); pairclean itself does not import
webdataset. Nothing here is imported by ``import pairclean``.
"""

from __future__ import annotations

import os
from typing import Any

from pairclean.sampler import WeightStage

__all__ = ["TokenizeText", "weigh_pipeline", "get_wds_dataset", "follow_training_epoch"]


class TokenizeText:
    """``tokenizer(text)[0]`` as a picklable callable (open_clip's own is a lambda)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> Any:
        return self.tokenizer(text)[0]


def _fname(stage: Any) -> str | None:
    return getattr(getattr(stage, "f", None), "__name__", None)


def _data_pipeline(loader: Any) -> Any:
    """The ``wds.DataPipeline`` under a ``DataInfo``, ``WebLoader``, ``DataLoader`` or itself."""
    obj = getattr(loader, "dataloader", loader)  # open_clip's DataInfo
    for _ in range(3):
        if hasattr(obj, "pipeline") and any(_fname(s) for s in obj.pipeline):
            return obj
        if hasattr(obj, "dataset"):
            obj = obj.dataset
        elif getattr(obj, "pipeline", None):
            obj = obj.pipeline[0]  # a WebLoader is a DataPipeline around one DataLoader
    raise RuntimeError(f"cannot find a webdataset DataPipeline inside {type(loader).__name__}")


def weigh_pipeline(loader: Any, stage: WeightStage, *, tokenizer: Any = None, with_keys: bool = False,
                   weight_name: str = "weight") -> Any:
    """Edit open_clip's WebDataset pipeline in place to carry pairclean weights; returns ``loader``.

    Call before the first iteration (workers copy the pipeline when they start). Batches
    become ``(images, texts, weights[, keys, urls])``. ``tokenizer``: replaces open_clip's
    text lambda by a picklable ``TokenizeText`` (default: the tokenizer the lambda holds).
    """
    pipeline = _data_pipeline(loader)
    stages = pipeline.pipeline
    names = [_fname(s) for s in stages]
    missing = [n for n in ("_decode", "_rename", "_to_tuple") if n not in names]
    if missing:
        raise RuntimeError(f"open_clip's pipeline has no {', '.join(missing)} stage: add pairclean's stage by hand (TRAINING.md)")
    if any(isinstance(s, WeightStage) for s in stages):
        raise RuntimeError("this pipeline already has a pairclean WeightStage")
    for i, s in enumerate(stages):
        name = _fname(s)
        if name == "_rename":
            stages[i] = type(s)(s.f, *s.args, **{**s.kw, weight_name: stage.weight_key})
        elif name == "_map_dict" and callable(s.kw.get("text")) and "<lambda>" in getattr(s.kw["text"], "__qualname__", ""):
            tok = tokenizer if tokenizer is not None else _closure_value(s.kw["text"], "tokenizer")
            if tok is not None:
                stages[i] = type(s)(s.f, *s.args, **{**s.kw, "text": TokenizeText(tok)})
        elif name == "_to_tuple":
            extra = (weight_name, "__key__", "__url__") if with_keys else (weight_name,)
            stages[i] = type(s)(s.f, *s.args, *extra, **s.kw)
    stages.insert(names.index("_decode"), stage)
    if with_keys:
        # rename(keep=False) would drop __key__/__url__: keep them by name.
        for i, s in enumerate(stages):
            if _fname(s) == "_rename" and s.kw.get("keep") is False:
                stages[i] = type(s)(s.f, *s.args, **{**s.kw, "__key__": "__key__", "__url__": "__url__"})
    return loader


def _closure_value(fn: Any, name: str) -> Any:
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(names, (c.cell_contents for c in cells))).get(name)


def get_wds_dataset(
    args: Any,
    preprocess_img: Any,
    is_train: bool,
    epoch: int = 0,
    floor: bool = False,
    tokenizer: Any = None,
    *,
    weights: str | os.PathLike[str],
    mode: str = "loss",
    with_keys: bool = False,
    multiprocessing_context: Any = None,
    **stage_options: Any,
) -> Any:
    """open_clip's ``get_wds_dataset`` with pairclean weights; returns its ``DataInfo``.

    Same first six arguments as ``open_clip_train.data.get_wds_dataset``. ``weights``: a
    pairclean output folder; ``mode`` and ``stage_options`` (``missing``, ``default``,
    ``w_cap``, ``seed``, ``rank``, ``pseudo``) go to ``WeightStage`` (``rank`` defaults
    to ``args.rank``, so ``sample`` decisions differ per rank). ``multiprocessing_context``:
    the DataLoader's start method (``"spawn"``, ``"forkserver"``, ``"fork"``; default: the
    interpreter's).
    """
    from open_clip_train.data import get_wds_dataset as open_clip_get_wds_dataset

    stage_options.setdefault("rank", int(getattr(args, "rank", 0) or 0))
    stage = WeightStage(weights, mode, **stage_options)
    info = open_clip_get_wds_dataset(args, preprocess_img, is_train, epoch=epoch, floor=floor, tokenizer=tokenizer)
    follow_training_epoch(stage, info, epoch)
    weigh_pipeline(info, stage, tokenizer=tokenizer, with_keys=with_keys)
    if multiprocessing_context is not None:
        _use_start_method(info, multiprocessing_context, epoch)
    return info


def follow_training_epoch(stage: WeightStage, info: Any, epoch: int) -> None:
    """Make ``stage``'s ``sample`` draws follow open_clip's training epoch: its
    ``SharedEpoch`` (which ``DataInfo.set_epoch`` updates and every worker reads) where the
    ``DataInfo`` has one, else ``epoch`` (the one open_clip_train resumes at)."""
    stage.set_epoch(epoch)
    shared = getattr(info, "shared_epoch", None)
    if shared is not None and hasattr(shared, "get_value"):
        stage.epoch_source = shared


def _use_start_method(info: Any, method: Any, epoch: int) -> None:
    """Run the DataLoader's workers with ``method`` (a name or a multiprocessing context).

    open_clip's ``SharedEpoch`` holds a ``multiprocessing.Value`` made in the interpreter's
    default context; a worker of another context cannot receive its lock ("A SemLock
    created in a fork context is being shared with a process in a spawn context"). The
    Value is remade in the loader's context, in the one ``SharedEpoch`` object that the
    shard stages and the ``DataInfo`` share, so ``set_epoch`` still reaches the workers.
    """
    import multiprocessing

    ctx = multiprocessing.get_context(method) if isinstance(method, str) else method
    torch_loader = info.dataloader.pipeline[0] if hasattr(info.dataloader, "pipeline") else info.dataloader
    if getattr(torch_loader, "num_workers", 0) == 0:
        return
    torch_loader.multiprocessing_context = ctx
    shared = getattr(info, "shared_epoch", None)
    if shared is not None and hasattr(shared, "shared_epoch"):
        shared.shared_epoch = ctx.Value("i", shared.get_value() if hasattr(shared, "get_value") else epoch)
