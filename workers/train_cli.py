"""``pairclean train-lite``: train the pairclean-lite projection heads (see pairclean.lite_train)."""

from __future__ import annotations

import argparse
from typing import Any

from pairclean.errors import NotImplementedFeatureError

__all__ = ["add_train_parser", "cmd_train_lite"]


def add_train_parser(sub: Any) -> None:
    """Register the ``train-lite`` sub-command."""
    p = sub.add_parser("train-lite", help="train pairclean-lite's projection heads on Flickr8k")
    p.add_argument("--data", default="../shared/data/flickr8k")


def cmd_train_lite(args: argparse.Namespace) -> int:
    raise NotImplementedFeatureError("train-lite is not implemented yet")
