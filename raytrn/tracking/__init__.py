"""Experiment tracking (MLflow)."""
