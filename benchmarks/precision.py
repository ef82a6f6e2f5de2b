"""fp32 against bf16 weights on this machine: speed of each tower and embedding agreement.

For each model, embeds the same real Flickr8k photos and captions with fp32 and bf16
weights (same threads, same batch) and prints one JSON line with images/s, captions/s,
the bf16/fp32 speed-ups, and the smallest cosine between the two paths' embeddings.
``precision="auto"`` trusts bf16 only where it is faster and agrees to >= 0.999.

    python benchmarks/precision.py [--models pairclean-lite ViT-B-32] [--n 64]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from _common import flickr_root


def _inputs(estimator, n: int):
    import torch

    from pairclean.lite.evaldata import load_flickr8k

    root = flickr_root()
    from PIL import Image

    images = load_flickr8k(root, "dev")[:n]
    pixels = torch.stack([estimator.preprocess(Image.open(i.path).convert("RGB")) for i in images])
    return pixels, [i.captions[0] for i in images]


def _rate(fn, items, n: int, batch: int) -> tuple[float, object]:
    import numpy as np

    fn(items[:batch])  # warm-up
    t0 = time.perf_counter()
    out = [fn(items[i : i + batch]) for i in range(0, n, batch)]
    return n / (time.perf_counter() - t0), np.concatenate(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["pairclean-lite", "ViT-B-32"])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    import torch

    from pairclean.embed.estimators import EstimatorSpec, _to_bf16, load_estimator

    torch.set_num_threads(args.threads)
    for model in args.models:
        if model == "pairclean-lite":
            fp32 = load_estimator(EstimatorSpec(model, precision="fp32", device="cpu"))
        else:
            # Random weights: the speed is the architecture's; agreement is indicative only.
            import open_clip
            from pairclean.embed.estimators import Estimator, ModelInfo

            m, _, pre = open_clip.create_model_and_transforms(model, pretrained=None)
            info = ModelInfo(model, model, None, None, "fp32", "cpu", int(m.text_projection.shape[-1]), {"size": 224}, "argmax")
            fp32 = Estimator(m, open_clip.get_tokenizer(model), pre, info, 77)
        bf16 = _to_bf16(fp32)
        pixels, texts = _inputs(fp32, args.n)
        row = {"benchmark": "precision", "model": model, "threads": args.threads, "n": args.n}
        for name, est in (("fp32", fp32), ("bf16", bf16)):
            row[f"{name}_images_per_s"], img = _rate(est.encode_images, pixels, args.n, args.batch_size)
            row[f"{name}_captions_per_s"], txt = _rate(est.encode_texts, texts, args.n, args.batch_size)
            row[f"_{name}"] = (img, txt)
        (i32, t32), (i16, t16) = row.pop("_fp32"), row.pop("_bf16")
        row["image_speedup"] = row["bf16_images_per_s"] / row["fp32_images_per_s"]
        row["text_speedup"] = row["bf16_captions_per_s"] / row["fp32_captions_per_s"]
        row["min_cosine_image"] = float((i32 * i16).sum(1).min())
        row["min_cosine_text"] = float((t32 * t16).sum(1).min())
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
