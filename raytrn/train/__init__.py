"""Training: the per-worker loop (`loop`), the Ray Train trainer factory (`trainer`) and pre-flight checks."""
