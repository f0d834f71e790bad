"""Model builders. Model code is single-device; parallelism is applied by the backend afterwards."""

from raytrn.models.llama import ModelStats, build_model, model_stats

__all__ = ["ModelStats", "build_model", "model_stats"]
