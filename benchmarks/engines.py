"""CPU inference engines for pairclean-lite's towers: PyTorch against ONNX Runtime and OpenVINO.

For each tower (image: EfficientNet-Lite0 + head; text: MiniLM + mean pooling + projection)
and each engine, on real Flickr8k batches (``--batch-size``, default 64; captions trimmed
of all-padding columns as pairclean does), with the same thread count:

- ``pairs_per_s``: batches embedded per second x batch size (median of ``--rounds``
  rounds, engines interleaved within each round);
- ``min_cosine``: the smallest cosine between the engine's embedding and PyTorch fp32's
  over every probe row (pairclean's bar for another numeric path: >= 0.999);
- ``speedup``: against PyTorch fp32 in the same rounds.

Engines: ``torch`` (what pairclean runs), ``torch-bnfold`` (PyTorch with each BatchNorm folded
into its convolution: what graph engines do first, as a control), ``onnxruntime`` (ONNX
export, all graph optimisations), ``openvino`` (``ov.convert_model`` of the PyTorch module,
CPU plugin, latency hint). An engine whose package is missing is reported as skipped:

    pip install onnxruntime openvino onnx onnxscript
    python benchmarks/engines.py [--rounds 3] [--batches 4] [--threads 2]

Prints one JSON line per (tower, engine) and a ``verdict`` line.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _measure import flickr_shards, json_line

MIN_COSINE = 0.999


def _inputs(est: Any, shards: list[str], batches: int, batch_size: int) -> tuple[list[Any], list[Any]]:
    """``batches`` image batches (float NCHW) and token batches from real shards."""
    import torch

    from pairclean.read.decode import decode_and_preprocess
    from pairclean.read.shards import iter_pairs

    pixels, texts = [], []
    for uri in shards:
        for pair in iter_pairs(uri):
            pixels.append(decode_and_preprocess(pair.image, 64_000_000, est.preprocess, draft_size=est.image_size))
            texts.append(pair.text)
    n = batches * batch_size
    images = [torch.stack(pixels[i : i + batch_size]).contiguous(memory_format=torch.channels_last) for i in range(0, n, batch_size)]
    tokens = [est.tokenizer(texts[i : i + batch_size]) for i in range(0, n, batch_size)]
    return images, tokens


def _fold_batchnorms(visual: Any) -> Any:
    """A copy of the timm EfficientNet tower with every conv -> BatchNormAct pair folded
    into one conv followed by the activation alone (eval-mode arithmetic, same function)."""
    import torch
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    folded = copy.deepcopy(visual)
    for module in folded.modules():
        names = list(module._modules)
        for conv_name, bn_name in zip(names, names[1:]):
            conv, bn = module._modules[conv_name], module._modules[bn_name]
            if isinstance(conv, torch.nn.Conv2d) and type(bn).__name__ == "BatchNormAct2d":
                module._modules[conv_name] = fuse_conv_bn_eval(conv, bn)
                module._modules[bn_name] = torch.nn.Sequential(bn.drop, bn.act)
    return folded.eval()


class _TextTower:
    """``model.text`` as a plain module of token ids (the attention mask derived inside)."""

    def __new__(cls, text: Any) -> Any:
        import torch

        class TextTower(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.text = text

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return self.text(ids)

        return TextTower().eval()


def _engines(tower: Any, example: Any, dynamic: dict[str, Any], threads: int, workdir: Path) -> dict[str, Callable[[Any], Any]]:
    """engine name -> function(torch input) -> numpy embeddings; engines that cannot load are left out."""
    import numpy as np
    import torch

    out: dict[str, Callable[[Any], Any]] = {}
    setup: dict[str, float] = {}

    def run_torch(module: Any) -> Callable[[Any], Any]:
        def run(x: Any) -> Any:
            with torch.inference_mode():
                return module(x).float().numpy()
        return run

    out["torch"] = run_torch(tower)
    if dynamic.get("bnfold") is not None:
        out["torch-bnfold"] = run_torch(dynamic["bnfold"])
    name = "ids" if example.dtype == torch.long else "pixels"
    try:
        import onnxruntime as ort

        t0 = time.perf_counter()
        path = workdir / f"{name}.onnx"
        torch.onnx.export(tower, (example,), str(path), input_names=[name], output_names=["emb"],
                          dynamic_axes={name: dynamic["axes"], "emb": {0: "batch"}}, dynamo=False)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        out["onnxruntime"] = lambda x: session.run(None, {name: np.ascontiguousarray(x.numpy())})[0]
        setup["onnxruntime"] = time.perf_counter() - t0
    except ImportError as exc:
        json_line({"benchmark": "engines", "engine": "onnxruntime", "skipped": str(exc)})
    try:
        import openvino as ov

        t0 = time.perf_counter()
        core = ov.Core()
        shape = [-1] + list(example.shape[1:]) if name == "pixels" else [-1, -1]
        ov_model = ov.convert_model(tower, example_input=example, input=[(shape, ov.Type.i64 if name == "ids" else ov.Type.f32)])
        compiled = core.compile_model(ov_model, "CPU", {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
                                                        "INFERENCE_PRECISION_HINT": "f32"})
        request = compiled.create_infer_request()
        out["openvino"] = lambda x: np.array(request.infer([np.ascontiguousarray(x.numpy())])[0])
        setup["openvino"] = time.perf_counter() - t0
    except ImportError as exc:
        json_line({"benchmark": "engines", "engine": "openvino", "skipped": str(exc)})
    _SETUP.update({f"{name}:{k}": v for k, v in setup.items()})
    return out


_SETUP: dict[str, float] = {}  # "input:engine" -> seconds to export / convert and compile


def _normalised(a: Any) -> Any:
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    return a / np.linalg.norm(a, axis=1, keepdims=True)


def _measure(tower_name: str, engines: dict[str, Callable[[Any], Any]], batches: list[Any], rounds: int) -> list[dict[str, Any]]:
    import numpy as np

    reference = [_normalised(engines["torch"](x)) for x in batches]  # also the warm-up of torch
    cosine = {}
    for name, run in engines.items():
        got = [_normalised(run(x)) for x in batches]  # warm-up (first calls compile / plan)
        cosine[name] = float(min((a * b).sum(axis=1).min() for a, b in zip(reference, got)))
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, run in engines.items():
            t0 = time.perf_counter()
            for x in batches:
                run(x)
            times[name].append(time.perf_counter() - t0)
    pairs = sum(int(x.shape[0]) for x in batches)
    base = statistics.median(times["torch"])
    return [{
        "benchmark": "engines", "tower": tower_name, "engine": name,
        "pairs_per_s": round(pairs / statistics.median(t), 2), "speedup": round(base / statistics.median(t), 3),
        "setup_s": round(_SETUP.get(f"{'ids' if tower_name == 'text' else 'pixels'}:{name}", 0.0), 2),
        "min_cosine": round(cosine[name], 6), "agrees": bool(np.isfinite(cosine[name]) and cosine[name] >= MIN_COSINE),
    } for name, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=4, help="batches per round and tower")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    from pairclean.embed.cpu_settings import apply_process_env

    apply_process_env()  # as `pairclean score` runs (before torch loads)
    import torch

    from pairclean.embed.estimators import EstimatorSpec, load_estimator

    torch.set_num_threads(args.threads)
    est = load_estimator(EstimatorSpec("pairclean-lite", precision="fp32", device="cpu"))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pairclean-engines-") as tmp:
        shards = flickr_shards(Path(tmp) / "shards", args.batches * args.batch_size, args.batches * args.batch_size)
        images, tokens = _inputs(est, shards, args.batches, args.batch_size)
        visual, text = est.model.visual.eval(), _TextTower(est.model.text)
        for tower_name, tower, batches, axes, fold in (
            ("image", visual, images, {0: "batch"}, _fold_batchnorms(visual)),
            ("text", text, tokens, {0: "batch", 1: "length"}, None),
        ):
            engines = _engines(tower, batches[0], {"axes": axes, "bnfold": fold}, args.threads, Path(tmp))
            for row in _measure(tower_name, engines, batches, args.rounds):
                rows.append(row)
                json_line(row)
    keep = [r for r in rows if r["engine"] not in ("torch", "torch-bnfold") and r["agrees"] and r["speedup"] > 1.05]
    json_line({"benchmark": "engines", "verdict": [f"{r['tower']}:{r['engine']}" for r in keep] or "torch",
               "threads": args.threads, "batch_size": args.batch_size, "python": sys.version.split()[0]})


if __name__ == "__main__":
    main()
