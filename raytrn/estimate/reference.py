"""Measured figures raytrn ships with its source: the MFU a model reached on a device, the time a restart took.

Each carries where it was measured. ``raytrn estimate`` takes an MFU from these when the job's MLflow history has
none (and says which it used); ``bench/trainium.py`` derives its per-node targets from the same anchor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Measured:
    value: float
    source: str


#: AWS Neuron docs, trn1 Llama-3.1-8B pre-training (NxD): sequences/s, nodes, sequence length.
PUBLISHED_THROUGHPUT: dict[str, dict[str, Any]] = {
    "llama3-8b-trn1": {"seq_per_s": 47.95, "nodes": 32, "seq_len": 8192, "what": "AWS trn1 Llama-3.1-8B, TP 32"},
}

#: Model FLOPs utilisation by device family: (value, source). trn1: AWS's published 8B result against raytrn's own
#: FLOPs/token (llama3-8b at seq 8192: 57.9 GFLOPs) and 95 TFLOP/s a core; trn2 has no published figure, so the
#: trn1 one is carried over (marked). H100: bench/GPU.md, raytrn's step on one H100, Llama 3.2 1B at seq 2048.
MFU: dict[str, Measured] = {
    "trn1": Measured(0.234, "AWS's published trn1 Llama-3.1-8B result (47.95 seq/s on 32 nodes, seq 8192)"),
    "trn2": Measured(0.234, "trn1's published 8B MFU carried over (no trn2 figure published: extrapolated)"),
    "H100": Measured(0.537, "bench/GPU.md: raytrn's step, Llama 3.2 1B, seq 2048, one H100 (datasheet peak)"),
}


def carried_over_to_moe(mfu: Measured, family: str) -> Measured:
    """A figure of :data:`MFU` (each measured on a dense model) used for a MoE model, labelled so: a MoE step's
    routing, token exchange and smaller expert matmuls are not what was measured."""
    return Measured(mfu.value, f"{mfu.source}; a dense model's MFU carried over to this MoE model ({family}): "
                               "none measured on one, pass --mfu")  # fmt: skip


#: Used when nothing above applies, shown as an assumption.
ASSUMED_MFU = Measured(0.30, "assumed (no measurement for this model and device): set --mfu")

#: Restart after a lost node, measured: the chaos suite (tests/chaos, 3 CPU nodes, docs/elasticity.md) from the
#: event to the restarted group's first step, 31-55 s. On Neuron the compile cache must be warm for a figure of
#: this order; a cold compile adds minutes.
RESTART_S = Measured(45.0, "the chaos suite's restarts on CPU nodes: 31-55 s from the event to the next step")
