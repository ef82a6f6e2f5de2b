"""Running the judge inside ``score_shard``: one pass of the towers, the judge on the band.

``load_judge(path)`` reads a judge weights file (safetensors; metadata: config, recipe,
Platt map, the estimator it was trained on, dev figures). ``JudgeRunner`` plugs into
``pairclean.scoring.score_shard`` (its ``judge`` argument): for each batch it runs both
towers once (``features``: pooled embeddings for OSA plus regions and tokens), then the
judge on the ok pairs whose similarity lies in its band (plus its word grounding's weighted
score, ``pairclean.judge.words``, where the file has one). A judge failure (an exception or a
non-finite score) on a batch is retried pair by pair; a pair that still fails is reported
with its error, never the shard.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from pairclean.errors import ModelLoadError, first_line
from pairclean.embed.estimators import Estimator
from pairclean.embed.estimators.base import exact_fp32, file_sha256
from pairclean.osa import cosine_rows
from pairclean.judge.features import COLOUR_BINS, colour_grid, estimator_colours, image_parts, image_parts_dim, text_parts, text_parts_dim
from pairclean.judge.model import JudgeConfig, JudgeModel, build_judge
from pairclean.judge.posterior import FULL_BAND, FineMixture, in_band, llr_of
from pairclean.judge.words import WordGrounding, WordConfig, WordModel, WordVocab

__all__ = ["JUDGE_FILE", "JUDGE_MODES", "LoadedJudge", "default_judge_path", "load_judge", "save_judge", "JudgeRunner", "JudgeBatch"]

log = logging.getLogger(__name__)

JUDGE_FILE = "pairclean-judge.safetensors"
#: ``off``: OSA only; ``band``: the judge on the pairs of the band its budget buys; ``all``: on every ok pair.
JUDGE_MODES = ("off", "band", "all")
_MAX_CAPTION_TOKENS = 32  # the judge was trained on at most 32 caption tokens (data.MAX_TOKENS)


def default_judge_path() -> str:
    """The judge shipped with the package (trained for pairclean-lite)."""
    return str(resources.files("pairclean") / "data" / JUDGE_FILE)


@dataclass
class LoadedJudge:
    """A judge model in eval mode with its identity and Platt map."""

    model: JudgeModel
    path: str
    sha256: str
    platt: tuple[float, float]
    estimator: str
    meta: dict[str, Any]
    #: The word grounding added to the judge's logit (``pairclean.judge.words``); None: a judge without one.
    words: WordGrounding | None = None

    def identity(self) -> dict[str, Any]:
        """What the output metadata records about the judge."""
        doc = {"id": os.path.basename(self.path), "sha256": self.sha256, "estimator": self.estimator,
               "platt": list(self.platt), "config": json.loads(self.model.config.to_json())}
        if "platt_fine" in self.meta:  # judges trained to catch near-misses (see posterior.combined_p_clean)
            doc["platt_fine"] = [float(x) for x in self.meta["platt_fine"]]
        if "fine_rates" in self.meta:  # its word check's pass rates on dev (posterior.adjusted_count)
            doc["fine_rates"] = [float(x) for x in self.meta["fine_rates"]]
        if "fine_mixture" in self.meta:  # its ratios' dev distributions (posterior.fit_mixture)
            doc["fine_mixture"] = self.meta["fine_mixture"]
        if self.words is not None:
            doc["words"] = self.words.describe()
        return doc


_WORDS = "words."  # prefix of the word grounding's tensors in a judge file


def save_judge(path: str, model: JudgeModel, platt: tuple[float, float], estimator: str, extra: dict[str, Any],
               words: WordGrounding | None = None) -> str:
    """Write ``model`` (and its word grounding, float16) as a judge weights file (atomically); returns its sha256."""
    from safetensors.torch import save_file

    meta = {"judge_config": model.config.to_json(), "platt": json.dumps(list(platt)), "estimator": estimator}
    meta.update({k: json.dumps(v, sort_keys=True) for k, v in extra.items()})
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if words is not None:
        meta.update({"word_config": words.model.config.to_json(), "word_vocab": json.dumps(words.vocab.words),
                     "word_weight": json.dumps(words.weight)})
        state.update({_WORDS + k: v.detach().half().contiguous() for k, v in words.model.state_dict().items()})
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(state, tmp, metadata=meta)
    os.replace(tmp, path)
    return file_sha256(path)


def load_judge(path: str | None = None) -> LoadedJudge:
    """The judge in ``path`` (default: the shipped one); ``ModelLoadError`` when it is not one."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.path.abspath(path or default_judge_path())
    if not os.path.isfile(path):
        raise ModelLoadError(f"judge weights not found at {path!r}: train them with `pairclean train-judge` or pass --judge-checkpoint")
    from safetensors import SafetensorError

    try:
        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
        config = JudgeConfig.from_json(meta["judge_config"])
        platt = tuple(float(v) for v in json.loads(meta["platt"]))
        model = build_judge(config)
        state = load_file(path)
        model.load_state_dict({k: v for k, v in state.items() if not k.startswith(_WORDS)})
        words = _load_words(meta, {k[len(_WORDS):]: v for k, v in state.items() if k.startswith(_WORDS)})
        extra = {k: json.loads(v) for k, v in meta.items() if k not in ("judge_config", "platt", "estimator", "word_config", "word_vocab")}
        if "fine_mixture" in extra:  # checked here, so a hostile file fails on loading, in one line
            extra["fine_mixture"] = FineMixture.from_doc(extra["fine_mixture"]).to_doc()
    except (KeyError, ValueError, TypeError, AssertionError, RuntimeError, OSError, ArithmeticError, SafetensorError) as exc:
        # AssertionError: torch's layers assert their shapes (heads dividing the width);
        # ArithmeticError: a JSON integer too large for a float (in the Platt map, say)
        raise ModelLoadError(f"{path!r} is not a pairclean judge file: {first_line(exc)}") from exc
    model.eval()
    return LoadedJudge(model, path, file_sha256(path), (platt[0], platt[1]), meta.get("estimator", ""), extra, words)


def _load_words(meta: dict[str, str], state: dict[str, torch.Tensor]) -> WordGrounding | None:
    """The word grounding stored in a judge file (None where it has none)."""
    if "word_config" not in meta:
        if state:
            raise ValueError("word grounding tensors without their config")
        return None
    config = WordConfig.from_json(meta["word_config"])
    vocab = WordVocab(list(json.loads(meta["word_vocab"])))
    if len(vocab) != config.vocab:
        raise ValueError(f"word vocabulary of {len(vocab)} words for a model of {config.vocab}")
    # The stored tensors bound what the config may build (the file's size bounds them).
    for name, shape in config.tensor_shapes().items():
        if name not in state or tuple(state[name].shape) != shape:
            raise ValueError(f"word grounding tensor {name} is not {shape}")
    layers = {k.split(".")[1] for k in state if k.startswith("layers.")}
    if len(layers) != config.layers:
        raise ValueError(f"word grounding has {len(layers)} layers stored for a config of {config.layers}")
    model = WordModel(config)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    weight = float(json.loads(meta["word_weight"]))
    if not np.isfinite(weight):
        raise ValueError("word grounding weight is not finite")
    return WordGrounding(model.eval(), vocab, weight)


@dataclass
class JudgeBatch:
    """One batch's outputs: embeddings (N, D) float32 L2-normalised, the judge's log
    likelihood ratios (N,) (NaN where not judged), and per-pair judge errors (None = fine)."""

    image_emb: NDArray[np.float32]
    text_emb: NDArray[np.float32]
    llr: NDArray[np.float32]
    errors: list[str | None]


class JudgeRunner:
    """The judge bound to an estimator: ``encode_batch`` replaces the towers' plain pass.

    ``band``: the similarity window judged (``FULL_BAND``: every ok pair). The cascade
    judges everything during the calibration phase (the band is chosen from those pairs)
    and the band afterwards: ``with_band``.
    """

    def __init__(self, judge: LoadedJudge, estimator: Estimator, band: tuple[float, float] = FULL_BAND) -> None:
        self.judge = judge
        self.estimator = estimator
        self.band = band
        model = estimator.model
        regions, channels = image_parts_dim(model, estimator.image_size)
        width = text_parts_dim(model, estimator.tokenizer)
        cfg = judge.model.config
        if (regions, channels, width) != (cfg.regions, cfg.image_dim, cfg.text_dim):
            raise ModelLoadError(
                f"judge {judge.path!r} was trained for {judge.estimator or 'another estimator'} "
                f"({cfg.regions} regions x {cfg.image_dim}, tokens {cfg.text_dim}); "
                f"{estimator.info.model_id} gives {regions} x {channels}, tokens {width}"
            )
        if cfg.colour_bins and cfg.colour_bins != COLOUR_BINS:
            raise ModelLoadError(f"judge {judge.path!r} reads {cfg.colour_bins} colour channels; this release computes {COLOUR_BINS}")
        self._colour_grid = colour_grid(regions) if cfg.colour_bins else None
        self._parts = _onnx_parts(estimator)
        # The judge runs where the towers do (their regions and token states stay there);
        # a copy, so a LoadedJudge shared with a CPU caller keeps its weights on the CPU.
        device = estimator._device
        self._model = judge.model if device.type == "cpu" else copy.deepcopy(judge.model).to(device)
        self._words = judge.words
        if judge.words is not None:
            wc = judge.words.model.config
            if (wc.regions, wc.image_dim) != (regions, channels):
                raise ModelLoadError(f"judge {judge.path!r}: its word grounding reads {wc.regions} x {wc.image_dim} regions; "
                                     f"{estimator.info.model_id} gives {regions} x {channels}")
            if device.type != "cpu":
                self._words = WordGrounding(copy.deepcopy(judge.words.model).to(device), judge.words.vocab, judge.words.weight)

    def with_band(self, band: tuple[float, float]) -> JudgeRunner:
        """The same runner judging ``band`` (shares the loaded models)."""
        other = object.__new__(JudgeRunner)
        other.__dict__.update(self.__dict__)
        other.band = band
        return other

    @torch.inference_mode()
    def encode_batch(self, pixels: torch.Tensor, texts: list[str]) -> JudgeBatch:
        """Both towers once on (N, 3, S, S) ``pixels`` and N ``texts``, then the judge on the band."""
        with exact_fp32(self.estimator._device, self.estimator._dtype):
            return self._encode_batch(pixels, texts)

    def _encode_batch(self, pixels: torch.Tensor, texts: list[str]) -> JudgeBatch:
        est = self.estimator
        x = pixels.to(est._device, est._dtype).contiguous(memory_format=torch.channels_last)
        if self._parts is not None:
            pooled, regions = self._parts(x)
        else:
            pooled, regions = image_parts(est.model, x)
        tower_regions = regions  # what the word grounding reads (the judge may add colour channels)
        if self._colour_grid is not None:
            regions = torch.cat([regions.float(), estimator_colours(est, pixels, self._colour_grid).to(regions.device)], dim=2)
        ids = est.tokenizer(list(texts)).to(est._device)
        tpooled, tokens, mask = text_parts(est.model, ids)
        img = _normalised(pooled)
        txt = _normalised(tpooled)
        sim = cosine_rows(img, txt)  # exactly the similarity score_shard reports
        llr = np.full(len(texts), np.nan, np.float32)
        errors: list[str | None] = [None] * len(texts)
        chosen = np.nonzero(in_band(sim, self.band))[0]
        if chosen.size:
            tokens, mask = tokens[:, :_MAX_CAPTION_TOKENS], mask[:, :_MAX_CAPTION_TOKENS]
            cos = torch.from_numpy(sim).to(regions.device)
            sel = torch.from_numpy(chosen).to(regions.device)
            logits, errs = self._judge(tokens[sel].float(), mask[sel], regions[sel].float(), cos[sel],
                                       tower_regions[sel].float(), [texts[int(i)] for i in chosen])
            llr[chosen] = llr_of(logits, self.judge.platt)
            for pos, err in zip(chosen, errs):
                errors[int(pos)] = err
                if err is not None:
                    llr[pos] = np.nan
        return JudgeBatch(img, txt, llr, errors)

    def _logits(self, tokens: torch.Tensor, mask: torch.Tensor, regions: torch.Tensor, cos: torch.Tensor,
                tower_regions: torch.Tensor, texts: list[str]) -> NDArray[np.float32]:
        """The judge's logits, plus the word grounding's weighted score where the judge has one."""
        out: NDArray[np.float32] = self._model(tokens, mask, regions, cos).float().cpu().numpy()
        return out if self._words is None else self._words.add_to(out, tower_regions, texts)

    def _judge(self, tokens: torch.Tensor, mask: torch.Tensor, regions: torch.Tensor, cos: torch.Tensor,
               tower_regions: torch.Tensor, texts: list[str]) -> tuple[NDArray[np.float32], list[str | None]]:
        """Raw logits (n,) and per-pair errors: the batch at once, pair by pair where it fails."""
        try:
            out = self._logits(tokens, mask, regions, cos, tower_regions, texts)
            if np.isfinite(out).all():
                return out, [None] * len(out)
        except Exception as exc:  # noqa: BLE001 - retried pair by pair below, which names the failure
            log.warning("judge failed on a batch of %d pairs (%s); judging them one by one", len(cos), exc)
        out = np.full(len(cos), np.nan, np.float32)
        errors: list[str | None] = []
        for i in range(len(cos)):
            try:
                one = slice(i, i + 1)
                value = float(self._logits(tokens[one], mask[one], regions[one], cos[one], tower_regions[one], texts[one])[0])
            except Exception as exc:  # noqa: BLE001 - one pair's failure is that pair's status
                errors.append(f"judge failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            if not np.isfinite(value):
                errors.append("judge failed: non-finite score")
                continue
            out[i] = value
            errors.append(None)
        return out, errors


def _normalised(x: torch.Tensor) -> NDArray[np.float32]:
    x = x.float()
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return np.ascontiguousarray(x.cpu().numpy(), dtype=np.float32)


def _onnx_parts(estimator: Estimator) -> Any:
    """The image tower with regions on ONNX Runtime where the estimator runs its image tower
    there (same speed-up, one pass); None keeps PyTorch. Checked against PyTorch on a probe."""
    if estimator.image_runner is None:
        return None
    from pairclean.embed.estimators.engines import onnx_module_runner

    module = _ImageParts(estimator.model).eval()
    threads = torch.get_num_threads()
    runner = onnx_module_runner(module, estimator.image_size, threads, ["embedding", "regions"])
    if runner is None:
        return None
    probe = torch.rand((2, 3, estimator.image_size, estimator.image_size), generator=torch.Generator().manual_seed(0))
    probe = probe.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        ref_pooled, ref_regions = image_parts(estimator.model, probe)
        pooled, regions = runner(probe)
    cos = torch.nn.functional.cosine_similarity(pooled.float(), ref_pooled.float(), dim=-1).min().item()
    err = (regions.float() - ref_regions.float()).abs().max().item() / max(1e-6, ref_regions.abs().max().item())
    if cos < 0.9999 or err > 1e-3:
        log.warning("ONNX image parts disagree with PyTorch (cos %.6f, rel. err %.2g): judge stays on PyTorch", cos, err)
        return None
    return runner


class _ImageParts(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return image_parts(self.model, pixels)
