"""Trainium targets (paper, not measured): per-node tokens/s and the MFU they imply for the shipped trn jobs.

The only published anchor is AWS's trn1 Llama-3.1-8B result (47.95 sequences/s on 32 trn1.32xlarge at
seq 8192, TP 32 + ZeRO-1). FLOPs/token come from raytrn's own model_stats (what raytrn logs as MFU)
and the per-node peak from raytrn's peak table, so these targets line up with the ``mfu`` metric a
real run logs. A job with no published figure gets the 8B's MFU carried over, marked as extrapolated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import REPO
from raytrn.estimate.reference import PUBLISHED_THROUGHPUT

#: AWS Neuron docs, trn1 Llama-3.1-8B pretraining (NxD): sequences/s, nodes, sequence length (``raytrn estimate``
#: takes its MFU from the same figure).
PUBLISHED: dict[str, dict[str, Any]] = PUBLISHED_THROUGHPUT


def targets() -> list[dict[str, Any]]:
    from raytrn.config import load_job
    from raytrn.models import model_stats
    from raytrn.tracking.cost import peak_flops_per_worker

    rows: list[dict[str, Any]] = []
    for path in sorted((REPO / "jobs").glob("*trn*.yaml")):
        job = load_job(path)
        s = job.scaling
        flops = model_stats(job.model, job.data.seq_len).flops_per_token
        peak = peak_flops_per_worker(s.accelerator, s.instance_type, lnc=job.neuron.lnc)
        node_peak = peak * (s.workers_per_node or 1) if peak else None
        rows.append(
            {
                "job": Path(path).stem,
                "instance_type": s.instance_type,
                "seq_len": job.data.seq_len,
                "flops_per_token": flops,
                "node_peak_flops": node_peak,
            }
        )
    anchor_mfu = None
    for row in rows:
        pub = PUBLISHED.get(row["job"])
        if pub and row["node_peak_flops"]:
            row["tokens_per_s_per_node"] = pub["seq_per_s"] * pub["seq_len"] / pub["nodes"]
            row["mfu"] = row["tokens_per_s_per_node"] * row["flops_per_token"] / row["node_peak_flops"]
            row["source"] = f"{pub['what']}: {pub['seq_per_s']} seq/s on {pub['nodes']} nodes"
            anchor_mfu = row["mfu"]
    for row in rows:
        if "mfu" not in row and anchor_mfu and row["node_peak_flops"]:
            row["mfu"] = anchor_mfu
            row["tokens_per_s_per_node"] = anchor_mfu * row["node_peak_flops"] / row["flops_per_token"]
            row["source"] = "no published figure: the 8B's MFU carried over (extrapolated)"
    return rows
