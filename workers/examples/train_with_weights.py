"""A runnable example: train a few steps of an open_clip model on weighted WebDataset shards.

    python workers/examples/train_with_weights.py [--shards SHARDS...] [--weights OUT] [--steps 4]

Without arguments it scores the bundled demo shard first (``pairclean demo``'s sample,
local executor) and trains the tiny test architecture, so it runs anywhere in seconds.
With ``--shards`` and ``--weights`` it uses your shards and an existing output folder.
It prints the weighted loss of each step.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import webdataset as wds

from pairclean.losses import weighted_clip_loss
from pairclean.sampler import weight_stage


def _score_demo(out: str) -> list[str]:
    from pairclean_workers.cli import main, sample_shard

    shard = sample_shard()
    if main(["score", shard, "--out", out, "--executor", "local", "--no-progress"]) not in (0,):
        raise SystemExit("scoring the demo shard failed")
    return [shard]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", nargs="*", default=None)
    parser.add_argument("--weights", default=None, help="a pairclean output folder for --shards")
    parser.add_argument("--model", default="pairclean-tiny-test")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()

    tmp = tempfile.mkdtemp()
    weights_dir = args.weights or tmp
    shards = args.shards or _score_demo(weights_dir)

    from pairclean.embed.estimators import EstimatorSpec, load_estimator

    est = load_estimator(EstimatorSpec(args.model, precision="fp32", device="cpu"))  # open_clip model + transforms
    model, preprocess, tokenizer = est.model.train(), est.preprocess, est.tokenizer

    dataset = wds.DataPipeline(
        wds.SimpleShardList(shards),
        wds.tarfile_to_samples(),
        wds.decode("pil"),
        weight_stage(weights_dir, mode="loss"),  # adds sample["weight"], joined by __key__
        wds.to_tuple("jpg", "txt", "weight"),
        wds.map_tuple(preprocess, lambda t: t, float),
        wds.batched(args.batch_size),
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    step = 0
    while step < args.steps:
        for images, texts, weights in dataset:
            image_features = torch.nn.functional.normalize(model.encode_image(images), dim=-1)
            text_features = torch.nn.functional.normalize(model.encode_text(tokenizer(list(texts))), dim=-1)
            loss = weighted_clip_loss(image_features, text_features, torch.as_tensor(weights), model.logit_scale.exp())
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step {step}: weighted loss {loss.item():.4f}, batch weights {[round(float(w), 3) for w in weights]}")
            step += 1
            if step >= args.steps:
                break


if __name__ == "__main__":
    main()
