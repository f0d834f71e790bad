"""Model builders. Model code is single-device; parallelism is applied by the backend afterwards."""

from raytrn.models.llama import PRESETS, ModelStats, build_model, model_stats

__all__ = ["PRESETS", "ModelStats", "build_model", "model_stats"]
