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
    ("astronaut", "A smiling woman in a white suit stands in front of a flag .", "public domain (NASA)"),
    ("chelsea", "An orange cat sits on the floor and looks to the side .", "CC0 (Stefan van der Walt)"),
    ("coffee", "A cup of coffee on a saucer with a spoon .", "CC0 (Rachel Michetti)"),
    ("rocket", "A tall white rocket stands on a launch pad under a blue sky .", "public domain (SpaceX)"),
    ("camera", "A man in a black coat looks through a camera on a tripod .", "CC0 (Lav Varshney)"),
    ("coins", "Many old coins laid out in rows on a table .", "no known copyright restrictions"),
    ("hubble_deep_field", "Bright stars and galaxies in the dark night sky .", "public domain (NASA)"),
    ("horse", "The black silhouette of a horse .", "CC0 (Andreas Preuss)"),
    ("retina", "A close up of a red human eye .", "CC0 (Mikael Haggstrom)"),
    ("clock", "A clock on a wall .", "public domain (Stefan van der Walt)"),
]
# Caption swaps: each key gets the other's caption. Captions are written in the style of
# the human captions pairclean-lite was trained on (Flickr8k).
SWAPS = [("astronaut", "chelsea"), ("camera", "horse")]


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
    from pairclean.lite.evaldata import write_shard

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
