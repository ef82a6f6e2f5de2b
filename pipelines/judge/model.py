"""The judge: caption tokens attend to image regions, then one logit per pair.

A small transformer over the caption's token states (frozen text tower) whose layers
each run masked self-attention over the tokens, then cross-attention from the tokens to
the image regions (frozen image tower's grid, with learned region positions), then an MLP
(pre-LayerNorm). The masked mean of the token states goes to a linear readout, to which
the pair's pooled cosine (the estimator's own similarity, OSA's input) is added with a
learned weight: the judge starts from what OSA knows and learns what parts add.

Inputs (torch): tokens (N, L, W) float, mask (N, L) bool (True = real token), regions
(N, R, C + colour_bins) float (the tower's channels, then ``features.region_colours`` where
the config has ``colour_bins``: a separate projection, added, so the colour shares are not
drowned in the tower's LayerNorm), cosine (N,) float. Output: logits (N,) float32 (clean vs not).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["JudgeConfig", "Judge", "JudgeEnsemble", "JudgeModel", "build_judge"]


@dataclass(frozen=True)
class JudgeConfig:
    """Shape of a judge (stored in its weights file's metadata)."""

    text_dim: int = 384
    image_dim: int = 320
    regions: int = 49
    width: int = 160
    layers: int = 2
    heads: int = 4
    dropout: float = 0.1
    #: Colour channels per region after the tower's (``features.region_colours``); 0: none.
    colour_bins: int = 0
    #: Judges of this shape trained from different seeds whose logits are averaged (``JudgeEnsemble``).
    members: int = 1

    def __post_init__(self) -> None:
        # A judge file is input: bound what its config may ask to build (width x dims, layers, members).
        for name, top in (("text_dim", 8192), ("image_dim", 8192), ("regions", 4096), ("width", 4096), ("layers", 12),
                          ("heads", 64), ("members", 8)):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= top:
                raise ValueError(f"judge config {name} must be a whole number in 1-{top}, got {value!r}")
        if type(self.colour_bins) is not int or not 0 <= self.colour_bins <= 64 or self.width % self.heads:
            raise ValueError(f"judge config: colour_bins {self.colour_bins!r}, width {self.width} in {self.heads} heads")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"judge config dropout must be in [0, 1), got {self.dropout!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JudgeConfig:
        return cls(**json.loads(text))


class _Layer(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_self = nn.LayerNorm(width)
        self.self_attn = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.ln_cross = nn.LayerNorm(width)
        self.cross_attn = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.ln_mlp = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, pad: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        h = self.ln_self(x)
        x = x + self.self_attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        x = x + self.cross_attn(self.ln_cross(x), img, img, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.ln_mlp(x))
        return out


class Judge(nn.Module):
    """See the module docstring."""

    def __init__(self, config: JudgeConfig) -> None:
        super().__init__()
        self.config = config
        w = config.width
        self.text_in = nn.Sequential(nn.LayerNorm(config.text_dim), nn.Linear(config.text_dim, w))
        self.image_in = nn.Sequential(nn.LayerNorm(config.image_dim), nn.Linear(config.image_dim, w))
        self.colour_in = nn.Linear(config.colour_bins, w) if config.colour_bins else None
        self.region_pos = nn.Parameter(torch.zeros(1, config.regions, w))
        self.image_ln = nn.LayerNorm(w)
        self.layers = nn.ModuleList(_Layer(w, config.heads, config.dropout) for _ in range(config.layers))
        self.out_ln = nn.LayerNorm(w)
        self.readout = nn.Linear(w, 1)
        # logit = readout(parts) + cos_scale * cosine + cos_bias; starts at a plain cosine test
        self.cos_scale = nn.Parameter(torch.tensor(10.0))
        self.cos_bias = nn.Parameter(torch.tensor(-2.0))

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, regions: torch.Tensor, cosine: torch.Tensor) -> torch.Tensor:
        if regions.shape[1] != self.config.regions:
            raise ValueError(f"judge expects {self.config.regions} image regions, got {regions.shape[1]}")
        x = self.text_in(tokens.float())
        if regions.shape[2] != self.config.image_dim + self.config.colour_bins:
            raise ValueError(f"judge expects {self.config.image_dim} + {self.config.colour_bins} channels per region, got {regions.shape[2]}")
        regions = regions.float()
        img = self.image_in(regions[..., : self.config.image_dim]) + self.region_pos
        if self.colour_in is not None:
            img = img + self.colour_in(regions[..., self.config.image_dim :])
        img = self.image_ln(img)
        pad = ~mask
        for layer in self.layers:
            x = layer(x, pad, img)
        x = self.out_ln(x)
        m = mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * m).sum(1) / m.sum(1).clamp_min(1.0)
        logits: torch.Tensor = self.readout(pooled).squeeze(-1) + self.cos_scale * cosine.float() + self.cos_bias
        return logits

    def describe(self) -> dict[str, Any]:
        """Config and size, for metadata and logs."""
        return {"config": asdict(self.config), "parameters": sum(p.numel() for p in self.parameters())}


class JudgeEnsemble(nn.Module):
    """``config.members`` judges of one shape, trained from different seeds; the logit is the
    mean of theirs (``pairclean train-judge --members N``). One training seed moves a kind's
    dev AUC by about 0.01, and three members beat each of theirs on dev; through `pairclean
    score` the gain was not measurable, so the shipped judge is one (``JUDGE_MODEL_CARD.md``)."""

    def __init__(self, config: JudgeConfig) -> None:
        super().__init__()
        self.config = config
        single = JudgeConfig(**{**asdict(config), "members": 1})
        self.members = nn.ModuleList(Judge(single) for _ in range(config.members))

    @classmethod
    def of(cls, judges: list[Judge]) -> JudgeEnsemble:
        """The ensemble of trained ``judges`` (one config)."""
        configs = {j.config for j in judges}
        if len(configs) != 1:
            raise ValueError("the members of a judge ensemble must share one config")
        out = cls(JudgeConfig(**{**asdict(judges[0].config), "members": len(judges)}))
        for slot, judge in zip(out.members, judges):
            slot.load_state_dict(judge.state_dict())
        return out.eval()

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, regions: torch.Tensor, cosine: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(tokens, mask, regions, cosine) for m in self.members]).mean(0)

    def describe(self) -> dict[str, Any]:
        """Config and size, for metadata and logs."""
        return {"config": asdict(self.config), "parameters": sum(p.numel() for p in self.parameters())}


JudgeModel = Judge | JudgeEnsemble


def build_judge(config: JudgeConfig) -> JudgeModel:
    """An untrained judge of ``config``: one ``Judge``, or a ``JudgeEnsemble`` of ``config.members``."""
    return JudgeEnsemble(config) if config.members > 1 else Judge(config)
