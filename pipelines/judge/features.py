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

__all__ = ["image_parts", "text_parts", "image_parts_dim", "text_parts_dim"]


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


@torch.inference_mode()
def image_parts_dim(model: Any, image_size: int) -> tuple[int, int]:
    """(regions R, channels C) of ``image_parts`` for this model (one probe image)."""
    _, regions = image_parts(model, torch.zeros((1, 3, image_size, image_size)))
    return int(regions.shape[1]), int(regions.shape[2])


@torch.inference_mode()
def text_parts_dim(model: Any, tokenizer: Any) -> int:
    """Width W of ``text_parts``' token states (``tokenizer``: the estimator's)."""
    _, tokens, _ = text_parts(model, tokenizer(["a probe"]))
    return int(tokens.shape[2])
