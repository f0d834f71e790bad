"""The models: one folder per family (``raytrn/models/<family>/``: its model, parallelization, Hugging Face adapter
and estimate terms; :mod:`raytrn.models.registry`), the decoder they share (:mod:`raytrn.models.decoder`,
:mod:`raytrn.models.moe`), building (:func:`build_model`) and counting (:func:`model_stats`) any of them. Model code
is single-device; parallelism is applied afterwards (:mod:`raytrn.train.parallelize`)."""

from raytrn.models.build import build_model
from raytrn.models.stats import ModelStats, model_stats

__all__ = ["ModelStats", "build_model", "model_stats"]
