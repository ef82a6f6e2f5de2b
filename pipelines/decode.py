"""Image decoding with a pixel limit checked from the header, before any full decode."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image

from . import schema

__all__ = ["DEFAULT_MAX_PIXELS", "DecodeFailure", "decode_image"]

#: 64 megapixels: larger images in web corpora are almost always junk or bombs.
DEFAULT_MAX_PIXELS = 64_000_000


@dataclass(frozen=True)
class DecodeFailure:
    """Why an image could not be used: a row status and a human-readable message."""

    status: str
    error: str


def decode_image(
    data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, draft_size: int | None = None
) -> Image.Image | DecodeFailure:
    """Decode ``data`` into an RGB image, or say why not.

    The size is read from the header and refused (``too_large``) above ``max_pixels``
    before pixels are decoded. ``draft_size`` lets JPEG decode at a reduced scale that is
    still at least that many pixels on the short side (far faster for big photos).
    """
    try:
        with warnings.catch_warnings():
            # PIL warns (DecompressionBombWarning) before it errors; our own limit decides.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            width, height = img.size
            if width * height > max_pixels:
                return DecodeFailure(
                    schema.STATUS_TOO_LARGE,
                    f"{width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}",
                )
            if draft_size is not None and img.format == "JPEG":
                img.draft("RGB", _draft_target(width, height, draft_size))
            img = img.convert("RGB")
            img.load()
            return img
    except Image.DecompressionBombError as exc:
        return DecodeFailure(schema.STATUS_TOO_LARGE, str(exc))
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a per-sample status
        return DecodeFailure(schema.STATUS_DECODE_ERROR, f"{type(exc).__name__}: {exc}")


def _draft_target(width: int, height: int, short_side: int) -> tuple[int, int]:
    # draft() picks the smallest JPEG scale >= the requested size; keep the aspect ratio
    # so the short side stays >= short_side after scaling.
    scale = short_side / max(1, min(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))
