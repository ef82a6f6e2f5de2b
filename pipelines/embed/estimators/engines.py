"""CPU inference engines for a tower, used only where measured faster and agreeing with PyTorch.

Measured with ``benchmarks/engines.py`` (2-core CPU, batch 64, 2 threads, real Flickr8k
batches; speed against PyTorch fp32 in the same rounds, smallest cosine to its embeddings):

- image tower: ONNX Runtime 1.32 1.77-1.90x, OpenVINO 2026.4 1.75-1.85x, PyTorch with
  its BatchNorms folded 1.44-1.49x; every cosine >= 0.999999;
- text tower: ONNX Runtime 0.95-0.98x, OpenVINO 1.09-1.15x.

ONNX Runtime on the image tower pays (it folds the BatchNorms into the convolutions and
fuses the activations, which eager PyTorch runs as separate passes over 100 MiB
activations), and it is ready in about 0.5 s (export and session). OpenVINO is as fast
there but takes 8.5 s to convert; on the text tower neither pays enough to carry. So
pairclean-lite's image tower runs on ONNX Runtime on CPU when ``onnxruntime`` and ``onnx``
are installed (the ``score`` extra) and its embeddings agree with PyTorch fp32 on the load-
time probe (checked by the caller, as for bf16); everything else stays in PyTorch.
"""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["ENGINES", "onnx_image_runner", "onnx_module_runner"]

log = logging.getLogger(__name__)

#: ``auto``: the measured-faster engine where there is one (see the table); ``torch``: PyTorch only.
ENGINES = ("auto", "torch")


def onnx_image_runner(visual: Any, image_size: int, threads: int) -> tuple[Callable[[Any], Any], str] | None:
    """``visual`` (an image tower: (N, 3, S, S) float32 -> (N, D)) on ONNX Runtime.

    Returns (run, engine description) where ``run`` takes a channels-last float32 torch
    tensor and returns the (N, D) float32 torch tensor; None when onnxruntime or onnx is
    not installed or the export fails (the caller keeps PyTorch). Threads: ``threads``,
    not spinning between calls (the text tower and the reader thread need the cores then).
    """
    run = onnx_module_runner(visual, image_size, threads, ["embedding"])
    if run is None:
        return None
    import onnxruntime as ort

    return (lambda pixels: run(pixels)[0]), f"onnxruntime {ort.__version__} (image tower), torch {torch.__version__.split('+')[0]} (text tower)"


def onnx_module_runner(module: Any, image_size: int, threads: int, output_names: list[str]) -> Callable[[Any], tuple[Any, ...]] | None:
    """``module`` ((N, 3, S, S) float32 pixels -> one tensor per name in ``output_names``,
    each batch-first) on ONNX Runtime: ``run(channels-last pixels)`` gives the tuple of
    float32 torch tensors. None when onnxruntime or onnx is missing or the export fails."""
    try:
        import onnx  # noqa: F401 - torch's exporter needs it
        import onnxruntime as ort
    except ImportError:
        return None
    tower = _ChannelsLast(module).eval()
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # exporter deprecation and tracing notes
            # The TorchScript-based exporter: the dynamo one needs onnxscript besides.
            torch.onnx.export(
                tower, (torch.zeros((2, image_size, image_size, 3)),), buffer,  # type: ignore[arg-type]  # a file object is accepted
                input_names=["pixels_nhwc"], output_names=output_names,
                dynamic_axes={"pixels_nhwc": {0: "batch"}, **{name: {0: "batch"} for name in output_names}}, dynamo=False,
            )
    except Exception as exc:  # noqa: BLE001 - any export failure means: stay on PyTorch
        log.warning("ONNX export of the image tower failed, staying on PyTorch: %s", exc)
        return None
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(buffer.getvalue(), options, providers=["CPUExecutionProvider"])

    def run(pixels: Any) -> tuple[Any, ...]:
        # A channels-last NCHW tensor is NHWC in memory: its permuted view needs no copy.
        nhwc = np.ascontiguousarray(pixels.permute(0, 2, 3, 1).float().numpy(), dtype=np.float32)
        return tuple(torch.from_numpy(out) for out in session.run(None, {"pixels_nhwc": nhwc}))

    return run


class _ChannelsLast(torch.nn.Module):
    """An image tower taking (N, S, S, 3) input: the memory order pairclean's batches
    already have, so the engine is handed them without a copy."""

    def __init__(self, visual: torch.nn.Module) -> None:
        super().__init__()
        self.visual = visual

    def forward(self, pixels_nhwc: torch.Tensor) -> Any:
        # one tensor, or a tuple of them (the judge's tower with its regions)
        return self.visual(pixels_nhwc.permute(0, 3, 1, 2))
