"""Image decoding with a pixel limit checked from the header, before any full decode.

Three ways to turn image bytes into model input:

- ``decode_and_preprocess``: PIL decode (``decode_image``) then the estimator's own
  preprocess, on the CPU. Thread-safe, so callers may run it on a thread pool.
- ``decode_pixels`` + ``SplitPreprocess.finish``: the same result cut in two, so that
  decode threads run PIL only (uint8 pixels) and the model's thread scales and normalises
  whole batches: no torch op, hence no second OpenMP team, off the model's thread.
- ``decode_jpeg_batch``: one batched ``torchvision.io.decode_jpeg`` call (nvJPEG on
  CUDA) for the JPEGs of a batch, resize / crop / normalise as tensor ops on ``device``;
  every image it cannot take goes through ``decode_image`` so statuses stay the same.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image, UnidentifiedImageError

from pairclean import schema

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "DecodeFailure",
    "decode_image",
    "decode_and_preprocess",
    "SplitPreprocess",
    "split_preprocess_of",
    "decode_pixels",
    "TensorPreprocess",
    "tensor_preprocess_of",
    "is_jpeg",
    "decode_jpeg_batch",
    "implausible_size",
    "extreme_aspect",
    "MAX_ASPECT",
    "JPEG_MAX_PIXELS_PER_BYTE",
    "IMAGE_FORMATS",
    "MAX_JPEG_SCANS",
    "MAX_JPEG_SEGMENTS",
    "MAX_METADATA_BLOCKS",
    "jpeg_structure_problem",
    "metadata_problem",
    "open_image",
    "RefusedImage",
]

#: 64 megapixels: larger images in web corpora are almost always junk or bombs.
DEFAULT_MAX_PIXELS = 64_000_000
#: A Huffman-coded JPEG spends at least one bit per 8x8 luma block in its first DC scan,
#: so one byte of file holds at most 512 pixels; twice that is refused as a forged or
#: cut header (a 633-byte file claiming 7990x8000 would decode as a grey picture).
JPEG_MAX_PIXELS_PER_BYTE = 1024


#: The formats an image member may hold, whatever its extension says. Pillow opens some 40;
#: ICO and ICNS decode their largest picture inside ``Image.open``, before any pixel cap is
#: read (a 657 kB ICO held a 13000 x 13000 PNG: 590 MB), and none of the rest is what a web
#: corpus's image member holds. PPM is what ``api.score_pairs`` encodes decoded arrays as
#: (Ray Data's images): raw pixels, no decoder to attack.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "AVIF", "PPM")
#: Scans a JPEG may hold. Standard progressive JPEGs use up to about 10; each scan is a pass
#: over every coefficient (21 ms at 64 MP), and empty refinement scans cost 72 bytes each:
#: 2,000 of them in 319 kB took 42 s to decode, past any shard time limit (libjpeg-turbo's
#: ``djpeg -maxscans`` is the same defence).
MAX_JPEG_SCANS = 100
#: Marker segments before a JPEG's first scan (APPn, DQT, DHT...): a camera file has a dozen.
#: PIL keeps an object per marker and joins Exif segments quadratically: 16 million empty
#: APP5 markers in 64 MiB took 2.2 GB, 1,000 Exif segments 15 s.
MAX_JPEG_SEGMENTS = 256


def jpeg_structure_problem(data: bytes) -> str | None:
    """Why the JPEG ``data`` would cost far more to open or decode than its size says (see
    ``MAX_JPEG_SCANS``, ``MAX_JPEG_SEGMENTS``), or None (also for non-JPEG or malformed
    bytes: the decoder judges those). Reads marker headers only, never pixel data."""
    if not data.startswith(b"\xff\xd8"):
        return None
    pos, steps, end = 2, 0, len(data)
    while pos + 4 <= end:
        steps += 1
        if steps > MAX_JPEG_SEGMENTS:  # fill bytes and standalone markers count too: no unbounded walk
            return f"a JPEG with more than {MAX_JPEG_SEGMENTS} marker segments before its image data"
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF or marker == 0x01 or 0xD0 <= marker <= 0xD8:  # fill byte, TEM, RSTn, SOI: no length
            pos += 1 if marker == 0xFF else 2
            continue
        if marker == 0xD9:
            return None
        if marker == 0xDA:
            # Entropy-coded data never holds FF DA (an FF there is followed by 00 or RSTn), so
            # every later FF DA starts a scan (a table segment between scans might hold one
            # by chance: a few more counted at worst).
            scans = data.count(b"\xff\xda", pos)
            if scans > MAX_JPEG_SCANS:
                return f"a JPEG of {scans} scans, over the limit of {MAX_JPEG_SCANS} (its decode would take minutes)"
            return None
        pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    return None


#: PNG chunks before the first IDAT, and GIF extension sub-blocks before the first frame,
#: that an image may carry. PIL keeps an object per chunk or sub-block while it opens the
#: file: a GIF comment of 33 million one-byte sub-blocks (64 MiB) took 2.85 GB, a PNG of a
#: million text chunks 10x its size. Real files carry a few (XMP in a GIF: a few thousand).
MAX_METADATA_BLOCKS = 65536


def _png_problem(data: bytes) -> str | None:
    pos, chunks = 8, 0
    while pos + 8 <= len(data):
        if data[pos + 4:pos + 8] == b"IDAT":
            return None
        chunks += 1
        if chunks > MAX_METADATA_BLOCKS:
            return f"a PNG of more than {MAX_METADATA_BLOCKS} chunks before its image data"
        pos += 12 + int.from_bytes(data[pos:pos + 4], "big")  # length, type, data, CRC
    return None


def _gif_problem(data: bytes) -> str | None:
    if len(data) < 13:
        return None
    flags, pos, blocks = data[10], 13, 0
    if flags & 0x80:
        pos += 3 * (2 << (flags & 7))  # the global colour table
    while pos < len(data) and data[pos] == 0x21:  # extensions before the first frame
        pos += 2
        while pos < len(data) and data[pos] != 0:
            blocks += 1
            if blocks > MAX_METADATA_BLOCKS:
                return f"a GIF of more than {MAX_METADATA_BLOCKS} extension blocks before its first frame"
            pos += 1 + data[pos]
        pos += 1
    return None


def metadata_problem(data: bytes) -> str | None:
    """Why opening the image ``data`` would cost far more than its size says: a JPEG's scans
    or marker segments (``jpeg_structure_problem``), a PNG's chunks or a GIF's extension
    blocks before the pixels (``MAX_METADATA_BLOCKS``); None otherwise (malformed bytes too:
    the decoder judges those). Walks block headers only, at most a bounded number."""
    if data.startswith(b"\xff\xd8"):
        return jpeg_structure_problem(data)
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return _png_problem(data)
    if data.startswith((b"GIF87a", b"GIF89a")):
        return _gif_problem(data)
    return None


class RefusedImage(ValueError):
    """Image bytes refused before PIL opens them (``metadata_problem``, ``IMAGE_FORMATS``)."""


def open_image(data: bytes) -> Image.Image:
    """``Image.open`` of untrusted bytes: ``IMAGE_FORMATS`` only, the block structure checked
    first (``metadata_problem``; ``ValueError`` naming it). Header only: no pixel is
    decoded. Call it with warnings silenced (see ``decode_image``)."""
    problem = metadata_problem(data)
    if problem is not None:
        raise RefusedImage(problem)
    try:
        return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError as exc:
        raise RefusedImage(f"cannot identify image file: not {', '.join(IMAGE_FORMATS[:-1])} or {IMAGE_FORMATS[-1]} "
                           "(damaged, or another format)") from exc


#: Longest side over shortest side. Preprocessing resizes the short side to the model's
#: input (224 px), so a 40000x1 PNG of 200 bytes would become a 224 x 9 million image
#: (gigabytes) before the centre crop; no photo is that thin, and 64:1 still admits
#: panoramas and banners.
MAX_ASPECT = 64


def extreme_aspect(width: int, height: int) -> str | None:
    """Why a ``width`` x ``height`` image is refused for its shape (see ``MAX_ASPECT``), or None."""
    if max(width, height) > MAX_ASPECT * max(1, min(width, height)):
        return (f"{width}x{height} is thinner than {MAX_ASPECT}:1 (resizing its short side to the model's input "
                "would make it a strip of millions of pixels)")
    return None


def implausible_size(img: Image.Image, nbytes: int) -> str | None:
    """Why the header of ``img`` (opened, not decoded) cannot be true of a file of
    ``nbytes`` bytes, or None. Only JPEG is judged: see ``JPEG_MAX_PIXELS_PER_BYTE``."""
    width, height = img.size
    if img.format == "JPEG" and width * height > JPEG_MAX_PIXELS_PER_BYTE * max(1, nbytes):
        return (f"a JPEG of {nbytes} bytes cannot hold the {width}x{height} pixels its header declares "
                "(cut short or forged)")
    return None


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
            # Every warning silenced, not only DecompressionBombWarning (our own limit decides):
            # catch_warnings resets the "once" registry on each call, so a JPEG whose Exif
            # holds 65,535 bad tags printed 131,070 lines for every image, into the job's log.
            warnings.simplefilter("ignore")
            img = open_image(data)
            width, height = img.size
            if width * height > max_pixels:
                return DecodeFailure(
                    schema.STATUS_TOO_LARGE,
                    f"{width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}",
                )
            thin = extreme_aspect(width, height)
            if thin:
                return DecodeFailure(schema.STATUS_TOO_LARGE, thin)
            forged = implausible_size(img, len(data))
            if forged:
                return DecodeFailure(schema.STATUS_DECODE_ERROR, forged)
            if draft_size is not None and img.format == "JPEG":
                img.draft("RGB", _draft_target(width, height, draft_size))
            rgb = _to_rgb(img)
            rgb.load()
            return rgb
    except Image.DecompressionBombError as exc:
        return DecodeFailure(schema.STATUS_TOO_LARGE, str(exc))
    except RefusedImage as exc:
        return DecodeFailure(schema.STATUS_DECODE_ERROR, str(exc))
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a per-sample status
        return DecodeFailure(schema.STATUS_DECODE_ERROR, f"{type(exc).__name__}: {_without_addresses(str(exc))}")


#: Rows rescaled at a time in ``_to_rgb``: the float temporaries stay a few MB for any width
#: the pixel cap admits, where the whole 64-megapixel picture in float64 took 1.5 GB.
_RESCALE_ROWS = 256


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB with the full tonal range kept.

    PIL's ``convert("RGB")`` clips 16-bit and 32-bit integer and float greyscale images
    (``I;16``, ``I``, ``F``: 16-bit PNGs, some TIFFs) at 255, turning most of the picture
    white; those are rescaled to 8 bits instead, a band of rows at a time, so memory is
    the picture's own array plus its 8-bit result (about 3 bytes a pixel for 16 bits).
    """
    if img.mode not in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        return img.convert("RGB")
    import numpy as np

    values = np.asarray(img)  # the native dtype (uint16, int32, float32): no float64 copy
    peak = float(values.max()) if values.size else 0.0
    if img.mode.startswith("I;16") or peak > 255:
        top = 65535.0
    elif img.mode == "F" and peak <= 1.0:
        top = 1.0
    else:
        top = 255.0
    scaled = np.empty(values.shape, dtype=np.uint8)
    for start in range(0, values.shape[0], _RESCALE_ROWS):
        band = values[start:start + _RESCALE_ROWS].astype(np.float64) * (255.0 / top) + 0.5
        scaled[start:start + _RESCALE_ROWS] = np.clip(band, 0, 255)
    del values
    return Image.fromarray(scaled, "L").convert("RGB")


# PIL names the stream in some messages ("cannot identify image file <_io.BytesIO object
# at 0x7f...>"): the address differs per call, which would make equal inputs give
# different error columns (and one thread differ from a pool).
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+(?=>)")


def _without_addresses(message: str) -> str:
    return _ADDRESS_RE.sub("", message)


def _draft_target(width: int, height: int, short_side: int) -> tuple[int, int]:
    # draft() picks the smallest JPEG scale >= the requested size; keep the aspect ratio
    # so the short side stays >= short_side after scaling.
    scale = short_side / max(1, min(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def decode_and_preprocess(
    data: bytes, max_pixels: int, preprocess: Callable[[Image.Image], Any], draft_size: int | None = None
) -> Any | DecodeFailure:
    """``decode_image`` then ``preprocess`` (an estimator's transform) on the result.

    Returns the preprocessed tensor, or the ``DecodeFailure``. Deterministic and safe to
    call from several threads at once (PIL and torch release the GIL for most of it).
    """
    img = decode_image(data, max_pixels, draft_size=draft_size)
    if isinstance(img, DecodeFailure):
        return img
    return _guarded(preprocess, img)


def _guarded(step: Callable[[Image.Image], Any], img: Image.Image) -> Any | DecodeFailure:
    """``step(img)``, or a ``decode_error`` failure when it raises: one image that PIL
    decodes but the transform cannot take is a row with a status, never a failed shard."""
    try:
        return step(img)
    except Exception as exc:  # noqa: BLE001 - any transform failure is a per-sample status
        return DecodeFailure(schema.STATUS_DECODE_ERROR, f"preprocess failed: {type(exc).__name__}: {_without_addresses(str(exc))}")


@dataclass(frozen=True)
class SplitPreprocess:
    """An open_clip eval preprocess cut where its PIL work ends, for decode threads that
    must not run torch ops.

    A torch op on a 150,000-element image tensor (``ToTensor``, ``Normalize``) runs on an
    OpenMP team of its own when called from a decode thread: a second team of spinning
    threads beside the model's, on the same cores. So decode threads run only ``pixels``
    (the preprocess's own ``Resize`` and ``CenterCrop`` on the PIL image, then its bytes as
    an (S, S, 3) uint8 array), and the model's thread runs ``finish`` on the stacked batch:
    scale to [0, 1] and normalise, the same float32 operations in the same order as
    ``ToTensor`` then ``Normalize``, so ``finish(stack([pixels(im), ...]))`` equals
    ``stack([preprocess(im), ...])`` bit for bit (tested).
    """

    steps: tuple[Callable[[Image.Image], Image.Image], ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def pixels(self, img: Image.Image) -> Any:
        """The PIL part on an RGB image: (S, S, 3) uint8 numpy array. Thread-safe."""
        import numpy as np

        for step in self.steps:
            img = step(img)
        return np.asarray(img.convert("RGB") if img.mode != "RGB" else img)

    def finish(self, batch: Any) -> torch.Tensor:
        """(N, S, S, 3) uint8 numpy array -> (N, 3, S, S) float32 (channels-last memory)."""
        import torch

        x = torch.from_numpy(batch).permute(0, 3, 1, 2).to(torch.float32).div(255)
        mean = torch.as_tensor(self.mean, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.as_tensor(self.std, dtype=torch.float32).view(1, -1, 1, 1)
        return x.sub_(mean).div_(std)


def split_preprocess_of(preprocess: Any) -> SplitPreprocess | None:
    """The ``SplitPreprocess`` of an open_clip eval ``preprocess``, or None when it is not
    exactly ``Compose([Resize(S), CenterCrop(S), <to RGB / to tensor>..., Normalize])``
    (then decode threads must run ``preprocess`` whole)."""
    if tensor_preprocess_of(preprocess) is None:
        return None
    resize, crop, *_, normalize = preprocess.transforms
    if any(std == 0 for std in normalize.std):
        return None  # Normalize raises for these: leave that to it
    return SplitPreprocess((resize, crop), tuple(normalize.mean), tuple(normalize.std))


def decode_pixels(data: bytes, max_pixels: int, split: SplitPreprocess, draft_size: int | None = None) -> Any | DecodeFailure:
    """``decode_image`` then ``split.pixels``: a uint8 (S, S, 3) array, or the
    ``DecodeFailure``. Runs no torch op (see ``SplitPreprocess``); thread-safe."""
    img = decode_image(data, max_pixels, draft_size=draft_size)
    if isinstance(img, DecodeFailure):
        return img
    return _guarded(split.pixels, img)


#: Every JPEG starts with SOI (FF D8) followed by the first marker's FF.
JPEG_MAGIC = b"\xff\xd8\xff"
#: ... and a complete one ends with EOI.
_JPEG_EOI = b"\xff\xd9"
# PIL modes whose JPEG decode to RGB matches torchvision's (CMYK/YCCK conversions differ).
_GPU_JPEG_MODES = ("RGB", "L")


def is_jpeg(data: bytes) -> bool:
    """True when ``data`` starts with the JPEG magic bytes (FF D8 FF)."""
    return data[:3] == JPEG_MAGIC


@dataclass(frozen=True)
class TensorPreprocess:
    """The eval transform of an open_clip estimator, as tensor ops that can run on a GPU:
    resize the short side to ``image_size`` (antialiased), centre-crop a square of
    ``image_size``, scale to [0, 1], normalise with ``mean`` / ``std``."""

    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str = "bicubic"

    def __call__(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """(3, H, W) uint8 images, all on one device -> (N, 3, S, S) float32 on that device."""
        import torch
        from torchvision.transforms.v2 import functional as F

        size = self.image_size
        mode = F.InterpolationMode(self.interpolation)
        # Resize per image (sizes differ); the result stays uint8, rounded as PIL rounds,
        # so the float values match the CPU path's ToTensor of a resized PIL image.
        crops = [F.center_crop(F.resize(img, [size], interpolation=mode, antialias=True), [size, size]) for img in images]
        batch = torch.stack(crops).float().div_(255.0)
        normalised: torch.Tensor = F.normalize(batch, list(self.mean), list(self.std))
        return normalised


def tensor_preprocess_of(preprocess: Any) -> TensorPreprocess | None:
    """The ``TensorPreprocess`` equivalent to an open_clip eval ``preprocess``, or None.

    Recognises exactly ``Compose([Resize(S), CenterCrop(S), <to RGB / to tensor>...,
    Normalize(mean, std)])`` (open_clip's ``resize_mode="shortest"``). Anything else
    returns None: the caller must keep the CPU path, which uses ``preprocess`` itself.
    """
    steps = list(getattr(preprocess, "transforms", None) or [])
    if len(steps) < 3:
        return None
    resize, crop, *middle, normalize = steps
    size = _square_resize_size(resize)
    if size is None or _crop_size(crop) != (size, size) or not all(_is_conversion(t) for t in middle):
        return None
    if type(normalize).__name__ != "Normalize":
        return None
    mean, std = tuple(float(v) for v in normalize.mean), tuple(float(v) for v in normalize.std)
    if len(mean) != 3 or len(std) != 3:
        return None
    interpolation = getattr(getattr(resize, "interpolation", None), "value", None)
    if interpolation not in ("bicubic", "bilinear"):
        return None
    return TensorPreprocess(size, mean, std, interpolation)


def _square_resize_size(step: Any) -> int | None:
    # Resize(int) scales the short side; Resize((h, w)) would squash: not ours.
    if type(step).__name__ != "Resize" or getattr(step, "max_size", None) is not None:
        return None
    if getattr(step, "antialias", True) is not True:
        return None
    size = step.size
    if isinstance(size, (list, tuple)):
        size = size[0] if len(size) == 1 else None
    return size if isinstance(size, int) else None


def _crop_size(step: Any) -> tuple[int, int] | None:
    if type(step).__name__ != "CenterCrop":
        return None
    size = step.size
    return (size, size) if isinstance(size, int) else tuple(size)


def _is_conversion(step: Any) -> bool:
    # Steps that only turn an RGB PIL image into a [0, 1] float tensor, which
    # TensorPreprocess does itself: open_clip's MaybeConvertMode / MaybeToTensor and
    # older _convert_to_rgb function, torchvision's ToTensor.
    name = getattr(step, "__name__", None) or type(step).__name__
    if name == "MaybeConvertMode":
        return getattr(step, "mode", "RGB") == "RGB"
    return name in ("MaybeToTensor", "ToTensor", "_convert_to_rgb")


def decode_jpeg_batch(
    datas: Sequence[bytes],
    max_pixels: int,
    image_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    device: str | torch.device,
    interpolation: str = "bicubic",
    executor: Executor | None = None,
) -> list[torch.Tensor | DecodeFailure]:
    """Decode and preprocess ``datas`` on ``device``, JPEGs in one batched decode call.

    Returns one entry per input, in order: a (3, S, S) float32 tensor on ``device``
    (S = ``image_size``, resized/cropped/normalised as ``TensorPreprocess``), or the
    ``DecodeFailure`` that ``decode_image`` gives for those bytes.

    JPEGs (magic FF D8 FF, complete, RGB or grey, within ``max_pixels`` by their header,
    read without decoding) go to ``torchvision.io.decode_jpeg`` in one call; if that call
    raises, each is retried alone. Every other input (PNG, WebP, too large, corrupt, a
    JPEG the batched decoder refused) is decoded by ``decode_image``, on ``executor``
    when given, so statuses and error messages are exactly those of the CPU path.
    """
    transform = TensorPreprocess(image_size, tuple(mean), tuple(std), interpolation)  # type: ignore[arg-type]
    takes = [i for i, data in enumerate(datas) if _batch_decodable(data, max_pixels)]
    images: dict[int, torch.Tensor] = _decode_jpegs({i: datas[i] for i in takes}, device)
    rest = [i for i in range(len(datas)) if i not in images]
    results: list[torch.Tensor | DecodeFailure | None] = [None] * len(datas)
    for i, img in zip(rest, _map(executor, lambda i: _pil_uint8(datas[i], max_pixels, image_size), rest)):
        if isinstance(img, DecodeFailure):
            results[i] = img
        else:
            images[i] = img.to(device)
    order = sorted(images)
    if order:
        for i, tensor in zip(order, transform([images[i] for i in order]).unbind(0)):
            results[i] = tensor
    return results  # type: ignore[return-value]


def _batch_decodable(data: bytes, max_pixels: int) -> bool:
    """Whether the batched JPEG decoder may take ``data`` with the CPU path's outcome.

    Only a complete JPEG (ends with EOI: a truncated one is a decode_error for PIL, while
    nvJPEG may return it half grey) in RGB or grey, whose header-declared size is within
    ``max_pixels``. The header is parsed lazily by PIL: no pixel is decoded here.
    """
    if not is_jpeg(data) or not data.endswith(_JPEG_EOI):
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with open_image(data) as img:
                width, height = img.size
                return (img.format == "JPEG" and img.mode in _GPU_JPEG_MODES and width * height <= max_pixels
                        and extreme_aspect(width, height) is None and implausible_size(img, len(data)) is None)
    except Exception:  # noqa: BLE001 - unreadable header: the CPU path names the error
        return False


def _decode_jpegs(datas: dict[int, bytes], device: str | torch.device) -> dict[int, torch.Tensor]:
    """Batched ``decode_jpeg`` of ``datas`` (index -> bytes) to RGB uint8 on ``device``.

    One call for all; when it raises (one bad image fails the whole batch), each image
    is tried alone and the ones that still fail are left out of the result.
    """
    if not datas:
        return {}
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    keys = list(datas)
    # frombuffer over a bytearray: a writable uint8 view, no extra copy of the bytes.
    tensors = [torch.frombuffer(bytearray(datas[k]), dtype=torch.uint8) for k in keys]
    try:
        return dict(zip(keys, decode_jpeg(tensors, device=device, mode=ImageReadMode.RGB)))
    except (RuntimeError, ValueError):
        pass
    decoded: dict[int, torch.Tensor] = {}
    for key, tensor in zip(keys, tensors):
        try:
            decoded[key] = decode_jpeg(tensor, device=device, mode=ImageReadMode.RGB)
        except (RuntimeError, ValueError):
            continue  # left to decode_image, which gives it the CPU path's status
    return decoded


def _pil_uint8(data: bytes, max_pixels: int, draft_size: int) -> torch.Tensor | DecodeFailure:
    """``decode_image`` as a (3, H, W) uint8 CPU tensor, or its ``DecodeFailure``."""
    from torchvision.transforms.v2.functional import pil_to_tensor

    img = decode_image(data, max_pixels, draft_size=draft_size)
    return img if isinstance(img, DecodeFailure) else pil_to_tensor(img)


def _map(executor: Executor | None, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``fn`` over ``items`` in order, on ``executor`` when there is one."""
    if executor is None or len(items) <= 1:
        return [fn(item) for item in items]
    return list(executor.map(fn, items))
