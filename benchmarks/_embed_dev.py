"""Embed Flickr8k dev (every image, all its captions) with an estimator; cached as .npz.

Used by ``benchmarks/estimators.py``: embedding is the slow part (a few minutes with
pairclean-lite on a 2-core CPU), the estimators are fitted on the cached arrays.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from _common import flickr_root


def embed_dev(cache: Path, model: str = "pairclean-lite", batch: int = 32) -> dict[str, np.ndarray]:
    """{"img": (N, D), "txt": (N, C, D)} float32 for the N dev images and C captions each."""
    if cache.exists():
        with np.load(cache) as data:
            return {k: data[k] for k in data.files}
    import torch

    from pairclean.read.decode import DEFAULT_MAX_PIXELS, decode_and_preprocess
    from pairclean.embed.estimators import EstimatorSpec, load_estimator
    from pairclean.lite.evaldata import load_flickr8k

    torch.set_num_threads(os.cpu_count() or 1)
    est = load_estimator(EstimatorSpec(model, None, None, "auto", "cpu"))
    images = load_flickr8k(flickr_root(), "dev")
    ncap = min(len(img.captions) for img in images)
    t0 = time.perf_counter()
    img_parts, txt_parts = [], []
    for start in range(0, len(images), batch):
        chunk = images[start : start + batch]
        pixels = torch.stack([decode_and_preprocess(i.path.read_bytes(), DEFAULT_MAX_PIXELS, est.preprocess, draft_size=est.image_size) for i in chunk])
        img_parts.append(est.encode_images(pixels))
        caps = [c for i in chunk for c in i.captions[:ncap]]
        txt_parts.append(est.encode_texts(caps).reshape(len(chunk), ncap, -1))
    out = {"img": np.concatenate(img_parts), "txt": np.concatenate(txt_parts), "seconds": np.array(time.perf_counter() - t0)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **out)
    return out


if __name__ == "__main__":
    import sys

    data = embed_dev(Path(sys.argv[1]))
    print({k: v.shape for k, v in data.items()}, float(data["seconds"]))
