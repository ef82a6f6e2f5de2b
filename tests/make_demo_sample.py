"""Build the bundled demo shard from scikit-image's licence-clean photos.

Every image is public domain or CC0 (see each function's docstring in skimage.data).
Two pairs of captions are swapped on purpose so the demo shows them getting low weight.
Run ``python tests/make_demo_sample.py`` to regenerate; a test checks the committed
shard is exactly what this script writes.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "pipelines" / "data" / "sample" / "demo-000000.tar"

# (skimage.data function, caption, licence note)
PHOTOS = [
    ("astronaut", "an astronaut in a white space suit smiling in front of a flag", "public domain (NASA)"),
    ("chelsea", "a ginger tabby cat sitting and looking to the side", "CC0 (Stefan van der Walt)"),
    ("coffee", "a cup of coffee with a spoon on a saucer", "CC0 (Rachel Michetti)"),
    ("rocket", "a rocket standing on the launch pad ready for lift off", "public domain (SpaceX)"),
    ("camera", "a black and white photo of a man looking through a camera on a tripod", "CC0 (Lav Varshney)"),
    ("coins", "a collection of old coins laid out in rows", "no known copyright restrictions"),
    ("hubble_deep_field", "a deep space picture full of distant galaxies and stars", "public domain (NASA)"),
    ("horse", "the black silhouette of a horse on a white background", "CC0 (Andreas Preuss)"),
    ("retina", "a medical photograph of the retina of a human eye", "CC0 (Mikael Haggstrom)"),
    ("immunohistochemistry", "a microscope image of stained tissue", "no known copyright restrictions"),
]
# Caption swaps: each key gets the other's caption.
SWAPS = [("chelsea", "rocket"), ("coffee", "hubble_deep_field")]


def _jpeg(name: str) -> bytes:
    import numpy as np
    import skimage.data
    from PIL import Image

    arr = getattr(skimage.data, name)()
    if arr.dtype == bool:
        arr = (~arr * 255).astype(np.uint8) if name == "horse" else (arr * 255).astype(np.uint8)
    img = Image.fromarray(arr).convert("RGB")
    img.thumbnail((320, 320), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def build(path: Path = SAMPLE) -> Path:
    """Write the demo shard to ``path``."""
    from pairclean.evaldata import write_shard

    captions = {name: caption for name, caption, _ in PHOTOS}
    swapped = {}
    for a, b in SWAPS:
        swapped[a], swapped[b] = captions[b], captions[a]
    samples = []
    for name, caption, licence in PHOTOS:
        samples.append(
            {
                "__key__": f"skimage/{name}",
                "jpg": _jpeg(name),
                "txt": swapped.get(name, caption),
                "json": {"uid": name, "source": f"scikit-image skimage.data.{name}", "licence": licence, "swapped": name in swapped},
            }
        )
    return write_shard(path, samples)


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else SAMPLE))
