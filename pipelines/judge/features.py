"""The judge's inputs: image regions and caption tokens, from the same pass as the embeddings.

The judge looks at parts: the spatial grid of the image tower and the token states of the
text tower. Both come out of the forward pass that also gives the pooled embeddings OSA
uses, so a cascade that judges pairs pays nothing extra for the towers.

- Image regions, timm trunks (pairclean-lite's EfficientNet-Lite0): the output of the last
  block, (N, H*W, C) = (N, 49, 320) at 224 px. The head convolution after it (320 -> 1280,
  1x1, BatchNorm, ReLU6) is a pointwise map of the same grid; the judge's own projection
  replaces it, which makes the judge's input 4x smaller (cache, memory, projection cost).
- Image regions, open_clip ViTs: the patch tokens (``output_tokens``).
- Caption tokens, Hugging Face text towers (MiniLM): the last hidden states, padding masked.
- Caption tokens, open_clip text transformers: the states after ``ln_final``.

Shapes: pixels (N, 3, S, S) float; ids (N, L) int64; outputs torch tensors.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["COLOUR_BINS", "image_parts", "region_colours", "colour_grid", "estimator_colours", "text_parts", "image_parts_dim", "text_parts_dim"]

#: Hue sectors of ``region_colours`` (each split into dark and bright) plus 3 achromatic levels.
_HUES = 8
COLOUR_BINS = 2 * _HUES + 3


def _timm_trunk(model: Any) -> Any | None:
    trunk = getattr(getattr(model, "visual", None), "trunk", None)
    return trunk if trunk is not None and hasattr(trunk, "blocks") and hasattr(trunk, "conv_head") else None


def image_parts(model: Any, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pooled image features before normalisation (N, D), regions (N, R, C)) in one pass.

    ``pooled`` equals ``model.encode_image(pixels)``.
    """
    trunk = _timm_trunk(model)
    if trunk is not None:
        x = trunk.bn1(trunk.conv_stem(pixels))
        last_block = trunk.blocks(x)
        grid = trunk.bn2(trunk.conv_head(last_block))
        pooled = model.visual.head(trunk.forward_head(grid))
        regions = last_block.flatten(2).transpose(1, 2)
        return pooled, regions
    visual = model.visual
    if hasattr(visual, "output_tokens"):
        saved = visual.output_tokens
        visual.output_tokens = True
        try:
            pooled, tokens = visual(pixels)
        finally:
            visual.output_tokens = saved
        return pooled, tokens
    raise NotImplementedError(f"the judge cannot read image regions of {type(visual).__name__}")


def text_parts(model: Any, ids: torch.Tensor, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pooled text features before normalisation (N, D), token states (N, L, W), mask (N, L) bool).

    ``pooled`` equals ``model.encode_text(ids)``; ``mask`` is True on real tokens.
    """
    text = getattr(model, "text", None)
    if text is not None and hasattr(text, "transformer") and hasattr(text, "pooler"):
        attn = (ids != text.config.pad_token_id).long()
        out = text.transformer(input_ids=ids, attention_mask=attn)
        pooled = text.proj(text.pooler(out, attn))
        return pooled, out.last_hidden_state, attn.bool()
    if hasattr(model, "token_embedding"):
        from open_clip.transformer import text_global_pool

        cast = model.transformer.get_cast_dtype()
        x = model.token_embedding(ids).to(cast) + model.positional_embedding.to(cast)
        x = model.ln_final(model.transformer(x, attn_mask=model.attn_mask))
        pooled = text_global_pool(x, ids, model.text_pool_type, eos_token_id=getattr(model, "text_eos_id", None))
        proj = model.text_projection
        if proj is not None:
            pooled = proj(pooled) if isinstance(proj, torch.nn.Linear) else pooled @ proj
        return pooled, x, ids != pad_id
    raise NotImplementedError(f"the judge cannot read caption tokens of {type(model).__name__}")


def region_colours(pixels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...], grid: int) -> torch.Tensor:
    """(N, grid*grid, ``COLOUR_BINS``) colour make-up of each region of (N, 3, S, S) normalised ``pixels``.

    Why: the image tower's last block is trained for ImageNet classes, where colour matters
    little; a caption's colour word ("a man in a red shirt") was the judge's weakest kind of
    edit (dev AUC 0.72). So the judge also reads, per region of the same grid, the share of
    pixels of each basic colour: hue in ``_HUES`` soft sectors weighted by chroma (max - min
    of RGB), separately for dark and bright pixels (brown is dark orange), and the
    achromatic rest (1 - chroma) in three soft lightness levels (black, grey, white). A
    pixel's weights sum to 1, so each region's values sum to 1. Pure arithmetic on the
    input pixels (averaged in 8x8 blocks first): no weights, well under 1 ms an image.
    Measured: dev colour edits +0.01 AUC, no gain through `pairclean score`; the shipped
    judge does not read them (``JUDGE_MODEL_CARD.md``).
    """
    on = pixels.device
    m = torch.tensor(mean, dtype=torch.float32, device=on).view(1, 3, 1, 1)
    sd = torch.tensor(std, dtype=torch.float32, device=on).view(1, 3, 1, 1)
    # 8x8 pixel blocks at 224 px (28 x 28 per image), pooled first (the map to RGB is affine):
    # a colour word names areas, not pixels, and the full grid cost about as much as the
    # image tower on a 2-core CPU
    blocks = torch.nn.functional.avg_pool2d(pixels.float(), max(1, pixels.shape[-1] // (4 * grid)))
    rgb = (blocks * sd + m).clamp(0.0, 1.0)
    r, g, b = rgb.unbind(1)
    hi, lo = rgb.amax(1), rgb.amin(1)
    chroma = hi - lo
    # hue in [0, 6) (the standard hexcone), where chroma > 0
    c = chroma.clamp_min(1e-6)
    hue = torch.where(hi == r, ((g - b) / c) % 6, torch.where(hi == g, (b - r) / c + 2, (r - g) / c + 4))
    centres = torch.arange(_HUES, dtype=torch.float32, device=on).view(1, _HUES, 1, 1) * (6.0 / _HUES)
    dist = (hue.unsqueeze(1) - centres).abs()
    dist = torch.minimum(dist, 6.0 - dist) * (_HUES / 6.0)  # in sectors
    sector = (1.0 - dist).clamp_min(0.0)  # triangular: each hue splits between 2 sectors
    bright = hi.unsqueeze(1).clamp(0.25, 0.75).sub(0.25).mul(2.0)  # 0 dark .. 1 bright
    chromatic = chroma.unsqueeze(1) * sector
    levels = torch.tensor([0.0, 0.5, 1.0], device=on).view(1, 3, 1, 1)
    grey = (1.0 - 2.0 * (hi.unsqueeze(1) - levels).abs()).clamp_min(0.0)  # triangular over lightness
    parts = torch.cat([chromatic * (1 - bright), chromatic * bright, (1 - chroma).unsqueeze(1) * grey], dim=1)
    pooled = torch.nn.functional.adaptive_avg_pool2d(parts, grid)
    return pooled.flatten(2).transpose(1, 2)


def colour_grid(regions: int) -> int:
    """The side of the square grid of ``regions`` image regions (EfficientNet's 7 x 7)."""
    grid = int(round(regions**0.5))
    if grid * grid != regions:
        raise NotImplementedError(f"colour shares need a square grid of regions, not {regions}")
    return grid


@torch.inference_mode()
def estimator_colours(estimator: Any, pixels: torch.Tensor, grid: int) -> torch.Tensor:
    """``region_colours`` of (N, 3, S, S) ``pixels`` preprocessed by ``estimator`` (its mean and std)."""
    pp = estimator.info.preprocess
    return region_colours(pixels, tuple(pp["mean"]), tuple(pp["std"]), grid)


@torch.inference_mode()
def image_parts_dim(model: Any, image_size: int) -> tuple[int, int]:
    """(regions R, channels C) of ``image_parts`` for this model (one probe image, on the model's device)."""
    weight = next(model.visual.parameters())
    probe = torch.zeros((1, 3, image_size, image_size), device=weight.device, dtype=weight.dtype)
    _, regions = image_parts(model, probe)
    return int(regions.shape[1]), int(regions.shape[2])


@torch.inference_mode()
def text_parts_dim(model: Any, tokenizer: Any) -> int:
    """Width W of ``text_parts``' token states (``tokenizer``: the estimator's)."""
    device = next(model.parameters()).device
    _, tokens, _ = text_parts(model, tokenizer(["a probe"]).to(device))
    return int(tokens.shape[2])
