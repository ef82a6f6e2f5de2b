"""pairclean: noisy-correspondence scoring for image-text WebDataset shards.

The import is light on purpose (numpy and pyarrow only): trainers import the sampler
from here without pulling in torch. Heavy modules load inside the functions that need them.

Modules: ``uris`` and ``shards`` (reading), ``decode``, ``estimators`` (the frozen model),
``osa`` (the method, pure functions), ``calibration`` (beta and weighting parameters of a
job), ``scoring`` (a shard in, arrays out), ``job`` (output folder, manifest, atomic
commits), ``runner`` (the job loop over any shard source), ``rescore`` and ``report``
(working on finished outputs), ``lite_train`` and ``evaldata`` (pairclean-lite's heads,
Flickr8k), and for trainers ``sampler``, ``losses`` and ``exports``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
