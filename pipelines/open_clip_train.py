"""Train with open_clip's own, unedited ``open_clip_train`` on pairclean's weights.

    python -m pairclean.open_clip_train --pairclean-weights OUT [--pairclean-mode weight|keep|sample] \\
        [--pairclean-missing error|skip|default] [--pairclean-model-config FILE.json] <open_clip_train args>

Everything after the ``--pairclean-*`` options goes to ``open_clip_train.main.main`` as is
(``--dataset-type webdataset`` with ``--train-data`` shards that the job in ``OUT`` scored).

Why patch at run time, in-process: training with per-sample weights otherwise takes edits in
three files of open_clip_train (a flag, the data pipeline, the loss in ``train.py``), and a
fork of those files goes stale with every open_clip release. ``main`` looks up ``get_data``
and ``create_loss`` in its own module namespace when it runs, so replacing those two names in
``open_clip_train.main`` (and nothing else) for the length of the call is enough; the
training loop, optimiser, scheduler, checkpoints and logging stay open_clip's:

- ``get_data``: open_clip's ``get_data`` builds its loaders, then ``pairclean.openclip.
  weigh_pipeline`` puts a ``WeightStage`` into the training pipeline before any worker
  starts (mode ``weight`` -> stage mode ``loss``; ``keep`` drops pairs flagged noisy;
  ``sample`` keeps a pair with probability ``min(1, weight)``). The loader is wrapped so
  that open_clip's loop still gets the ``(images, texts)`` batches it unpacks; in mode
  ``weight`` each batch's weights are handed to the loss through a ``WeightHolder``
  (the loop computes a batch's loss before it asks for the next batch).
- ``create_loss`` (mode ``weight`` only): ``WeightedClipLoss``, open_clip's ``ClipLoss``
  with each pair's cross-entropy terms multiplied by its weight. It gathers features
  across processes exactly as ``ClipLoss`` does (``local_loss``, ``gather_with_grad``) and
  gathers the weights the same way, so on N processes it equals one process on the same
  batch (loss and, with ``--gather-with-grad``, gradients). Other losses (SigLIP, CoCa,
  distillation) and ``--accum-freq`` > 1 are refused in mode ``weight``, with a message.

Unless ``--train-num-samples`` is given, it is set from ``OUT`` for the shards named by
``--train-data``: all rows (``weight``), the kept ones (``keep``), or the expected number
kept (``sample``), so open_clip's schedule counts what the loader yields; DataComp's
resharder and open_clip both read ``sizes.json`` beside the shards as *all* samples
(see ``pairclean.output.exports``), so the kept count never goes there.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pairclean import schema

__all__ = ["MODES", "WeightHolder", "WeightedClipLoss", "WeightedLoader", "expected_samples", "main", "shard_samples", "starving_workers"]

log = logging.getLogger("pairclean.open_clip_train")

#: Launcher mode -> ``WeightStage`` mode.
MODES = {"weight": "loss", "keep": "keep", "sample": "sample"}


class WeightHolder:
    """The weights of the batch open_clip's loop is working on (set by the loader, read by the loss)."""

    def __init__(self) -> None:
        self.weights: Any = None
        self.batches = 0
        self.samples = 0
        self.weight_sum = 0.0

    def put(self, weights: Any) -> None:
        import torch

        weights = torch.as_tensor(weights)  # webdataset collates floats to numpy
        self.weights = weights
        self.batches += 1
        self.samples += int(weights.shape[0])
        self.weight_sum += float(weights.double().sum())

    def take(self, n: int, device: Any, dtype: Any) -> Any:
        """The current batch's weights (``n`` of them) on ``device``; raises when they do not fit."""
        if self.weights is None or int(self.weights.shape[0]) != n:
            have = None if self.weights is None else int(self.weights.shape[0])
            raise RuntimeError(f"pairclean: the loss got {n} pairs but the loader's last batch had {have} weights "
                               "(gradient accumulation and custom loops are not supported in mode weight)")
        return self.weights.to(device=device, dtype=dtype, non_blocking=True)


class WeightedLoader:
    """open_clip's training loader, yielding ``(images, texts)`` as its loop expects; the
    weights (third item) go to ``holder`` (the loss reads them there in mode ``weight``).
    Every other attribute (``num_batches``, ``num_samples``) is the wrapped loader's."""

    def __init__(self, loader: Any, holder: WeightHolder) -> None:
        self._loader = loader
        self._holder = holder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        for images, texts, weights, *_ in self._loader:
            self._holder.put(weights)
            yield images, texts


def _weighted_clip_loss_class() -> type:
    """``WeightedClipLoss`` is built on open_clip's ``ClipLoss`` (imported only when used)."""
    import torch
    import torch.nn.functional as F
    from open_clip.loss import ClipLoss

    class _WeightedClipLoss(ClipLoss):  # type: ignore[misc]
        """open_clip's ``ClipLoss`` with each pair's two cross-entropy terms times its weight:
        ``sum_i w_i (CE_i2t(i) + CE_t2i(i)) / (2 rows)`` over the rows of the logits (all
        gathered pairs, or this process's with ``local_loss``), the mean over the batch
        as ``pairclean.losses.weighted_clip_loss``. Weights are gathered like the features."""

        def __init__(self, holder: WeightHolder, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.holder = holder

        def _row_weights(self, local: Any) -> Any:
            if self.world_size <= 1 or self.local_loss:
                return local
            import torch.distributed as dist

            parts = [torch.zeros_like(local) for _ in range(self.world_size)]
            dist.all_gather(parts, local.contiguous())  # no gradient: weights are data
            return torch.cat(parts, dim=0)

        def forward(self, image_features: Any, text_features: Any, logit_scale: Any, output_dict: bool = False, **_: Any) -> Any:
            device = image_features.device
            weights = self.holder.take(image_features.shape[0], device, torch.float32)
            logits_per_image, logits_per_text = self.get_logits(image_features, text_features, logit_scale)
            labels = self.get_ground_truth(device, logits_per_image.shape[0])
            rows = self._row_weights(weights)
            per_pair = (F.cross_entropy(logits_per_image.float(), labels, reduction="none")
                        + F.cross_entropy(logits_per_text.float(), labels, reduction="none"))
            total = (rows * per_pair).sum() / (2 * per_pair.shape[0])
            return {"contrastive_loss": total} if output_dict else total

    return _WeightedClipLoss


def WeightedClipLoss(holder: WeightHolder, **kwargs: Any) -> Any:  # noqa: N802 - a class factory
    """A weighted ``open_clip.loss.ClipLoss`` reading each batch's weights from ``holder``;
    ``kwargs`` are ``ClipLoss``'s (``local_loss``, ``gather_with_grad``, ``rank``, ``world_size``...)."""
    return _weighted_clip_loss_class()(holder, **kwargs)


def expected_samples(out: str | Path, train_data: str, mode: str) -> int:
    """How many samples the loader yields per pass over ``train_data`` (open_clip's
    ``--train-data``, ``::`` and brace lists allowed) in ``mode``, from the job in ``out``:
    the samples with an image and a caption (open_clip drops the others, and those it cannot
    decode; an empty caption or a repeated key passes), the kept ones (status ok, not noisy,
    a key the shard holds once), or ``sum(min(1, weight))`` over such keys: the counts
    ``WeightStage`` yields and ``export`` prints.
    Raises ``FileNotFoundError`` naming a shard the job did not score."""
    return int(round(sum(shard_samples(out, train_data, mode).values())))


def shard_samples(out: str | Path, train_data: str, mode: str) -> dict[str, float]:
    """Per shard stem of ``train_data``, in order: the samples one pass yields in ``mode``
    (see ``expected_samples``)."""

    from pairclean.sampler import WeightStore, read_table_columns
    from pairclean.uris import shard_stems

    store = WeightStore(out)  # the tables WeightStage serves: committed ones, as pairclean wrote them
    counts: dict[str, float] = {}
    for stem in shard_stems(train_data):
        path = Path(out) / f"{stem}.parquet"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the pairclean job in {out} did not score shard {stem!r} of --train-data")
        if not store.served(stem):
            raise FileNotFoundError(f"{path}: no committed table for shard {stem!r} of --train-data: {store.why_missing(stem)}")
        table = read_table_columns(path, ["key", "status", "weight", "noisy"], data=store.table_bytes(stem))
        status = np.asarray(table.column("status").to_pylist(), dtype=object)
        keys = table.column("key").to_pylist()
        repeated = schema.repeated_keys(keys, status.tolist())
        # every copy of a key the shard holds twice: WeightStage gives them weight 0, export keeps neither
        twice = np.fromiter((k in repeated for k in keys), dtype=bool, count=len(keys)) if not isinstance(repeated, str) else \
            np.zeros(len(keys), bool)
        if mode == "weight":  # what open_clip's own filter and decoder keep: an image and a caption member
            counts[stem] = int(np.isin(status, _WITH_IMAGE_AND_CAPTION).sum())
        elif mode == "keep":
            noisy = table.column("noisy").to_numpy(zero_copy_only=False).astype(bool)
            counts[stem] = int(((status == schema.STATUS_OK) & ~twice & ~noisy).sum())
        else:
            counts[stem] = float(np.minimum(1.0, table.column("weight").to_numpy())[~twice].sum())
    return counts


#: Statuses of samples that hold a decodable image and a caption member, which open_clip's
#: loader yields (its filter asks for both members; an empty caption and a repeated key pass).
_WITH_IMAGE_AND_CAPTION = (schema.STATUS_OK, schema.STATUS_EMPTY_TEXT, schema.STATUS_DUPLICATE_KEY, schema.STATUS_TOO_LARGE,
                           schema.STATUS_JUDGE_ERROR)


def starving_workers(counts: dict[str, float], loaders: int, batch_size: int) -> str | None:
    """Why some data-loader worker could yield no full batch in a pass, or None.

    open_clip deals the shards (shuffled each epoch) to ``loaders`` = ranks x ``--workers``
    workers, and each worker repeats its own shards until it has made its share of batches
    (``with_epoch``): a worker whose shards hold fewer samples than one batch never does,
    and the epoch never ends. The worst deal gives a worker the ``len // loaders`` smallest
    shards; empty, json-only or all-noisy shards make that likely.
    """
    if not counts:
        return None
    per_worker = max(1, len(counts) // loaders)
    smallest = sorted(counts.items(), key=lambda kv: kv[1])[:per_worker]
    if sum(v for _, v in smallest) >= batch_size:
        return None
    names = ", ".join(f"{stem} ({v:.0f})" for stem, v in smallest[:3]) + (" ..." if len(smallest) > 3 else "")
    return (f"with {loaders} data-loader worker(s) one may get only the shards {names}: fewer samples than one batch "
            f"of {batch_size}, and open_clip's loader would then never end the epoch; leave near-empty shards out of "
            "--train-data, or pass fewer --workers or a smaller --batch-size")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pairclean.open_clip_train", add_help=False,
                                description="open_clip_train's main with pairclean's weights; other arguments go to open_clip_train")
    p.add_argument("--pairclean-weights", required=True, metavar="OUT", help="the output folder of a pairclean job over the training shards")
    p.add_argument("--pairclean-mode", choices=tuple(MODES), default="weight",
                   help="weight: weighted contrastive loss (default); keep: drop pairs flagged noisy; sample: keep a pair with probability min(1, weight)")
    p.add_argument("--pairclean-missing", choices=("error", "skip", "default"), default="error",
                   help="a sample without a weight: fail (default), drop it, or weight 1")
    p.add_argument("--pairclean-model-config", action="append", default=[], metavar="FILE",
                   help="register an open_clip model config JSON (open_clip.add_model_config) before training")
    return p


def _check(options: argparse.Namespace, args: argparse.Namespace) -> None:
    """Refuse, before any training starts, what the patches cannot do; one-line reasons."""
    if not args.train_data:
        raise SystemExit("error: --train-data is needed: pairclean weights the training data")
    if args.dataset_type not in ("webdataset", "auto") or (args.dataset_type == "auto" and ".tar" not in args.train_data):
        raise SystemExit("error: pairclean's weights join WebDataset shards: pass --dataset-type webdataset with .tar --train-data")
    if options.pairclean_mode == "weight":
        if args.accum_freq > 1:
            raise SystemExit("error: --pairclean-mode weight does not support --accum-freq > 1; use --pairclean-mode keep or sample")
        if getattr(args, "distill_model", None) or getattr(args, "siglip", False) or "coca" in args.model.lower():
            raise SystemExit("error: --pairclean-mode weight weights open_clip's ClipLoss only (no SigLIP, CoCa or --distill); "
                             "use --pairclean-mode keep or sample")


@contextlib.contextmanager
def patched(oc_main: Any, weights: str, mode: str, missing: str, holder: WeightHolder) -> Iterator[WeightHolder]:
    """``open_clip_train.main``'s ``get_data`` and ``create_loss`` replaced for the block
    (see the module docstring), restored after it."""
    from pairclean.openclip import follow_training_epoch, weigh_pipeline
    from pairclean.sampler import WeightStage

    original_get_data, original_create_loss = oc_main.get_data, oc_main.create_loss

    def get_data(args: Any, preprocess_fns: Any, epoch: int = 0, tokenizer: Any = None) -> Any:
        data = original_get_data(args, preprocess_fns, epoch=epoch, tokenizer=tokenizer)
        info = data.get("train")
        if info is not None:
            stage = WeightStage(weights, MODES[mode], missing=missing, rank=int(getattr(args, "rank", 0) or 0))
            follow_training_epoch(stage, info, epoch)
            weigh_pipeline(info, stage, tokenizer=tokenizer)
            info.dataloader = WeightedLoader(info.dataloader, holder)
        return data

    def create_loss(args: Any) -> Any:
        from open_clip.loss import ClipLoss

        loss = original_create_loss(args)
        if mode != "weight":
            return loss
        if type(loss) is not ClipLoss:
            raise SystemExit(f"error: --pairclean-mode weight weights open_clip's ClipLoss, not {type(loss).__name__}")
        return WeightedClipLoss(
            holder, local_loss=args.local_loss, gather_with_grad=args.gather_with_grad, cache_labels=True,
            rank=args.rank, world_size=args.world_size, use_horovod=args.horovod,
        )

    oc_main.get_data, oc_main.create_loss = get_data, create_loss
    try:
        yield holder
    finally:
        oc_main.get_data, oc_main.create_loss = original_get_data, original_create_loss


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the ``--pairclean-*`` options, then run ``open_clip_train.main.main`` on the rest."""
    options, rest = _parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if not Path(options.pairclean_weights).is_dir():
        raise SystemExit(f"error: --pairclean-weights {options.pairclean_weights}: not a folder (the --out of `pairclean score`)")
    import open_clip
    import open_clip_train.main as oc_main
    from open_clip_train.params import parse_args

    for config in options.pairclean_model_config:
        open_clip.add_model_config(config)
    args = parse_args(list(rest))
    _check(options, args)
    from pairclean.errors import InputError

    try:
        counts = shard_samples(options.pairclean_weights, args.train_data, options.pairclean_mode)
    except (FileNotFoundError, InputError) as exc:
        raise SystemExit(f"error: {exc}") from None
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    starving = starving_workers(counts, max(1, args.workers) * world, args.batch_size)
    if starving:
        raise SystemExit(f"error: {starving}")
    if args.train_num_samples is None:
        n = int(round(sum(counts.values())))
        rest = [*rest, "--train-num-samples", str(n)]
        print(f"pairclean: --train-num-samples {n} ({options.pairclean_mode} mode, from {options.pairclean_weights})", file=sys.stderr)
    holder = WeightHolder()
    with patched(oc_main, options.pairclean_weights, options.pairclean_mode, options.pairclean_missing, holder):
        oc_main.main(list(rest))
    mean = holder.weight_sum / holder.samples if holder.samples else float("nan")
    print(f"pairclean: {holder.batches} batches, {holder.samples} pairs, mean weight {mean:.6f} ({options.pairclean_mode} mode)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
