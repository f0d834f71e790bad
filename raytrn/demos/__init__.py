"""Demos beyond `make demo` (they build on it): `python -m raytrn.demos.finetune`."""
