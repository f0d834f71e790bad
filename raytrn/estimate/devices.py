"""What one worker's device is: its memory and peak, with where each figure comes from.

Trainium from :data:`raytrn.backends.neuron_env.INSTANCES` (HBM per chip over the logical cores at the job's LNC);
GPUs by instance family (NVIDIA datasheets); a CPU worker's share of this machine's memory. An instance type the
table marks unconfirmed (Trainium3) gives a device that says UNCONFIRMED, with the table's source.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrn.tracking.cost import peak_flops_per_worker

if TYPE_CHECKING:
    from raytrn.config import JobSpec

GIB = 1 << 30

#: GPU memory by instance family (NVIDIA datasheets; the instance pages).
GPU_MEMORY_GIB: dict[str, tuple[str, int]] = {
    "p4d": ("A100 40GB", 40),
    "p4de": ("A100 80GB", 80),
    "p5": ("H100 80GB", 80),
    "p5e": ("H200 141GB", 141),
    "p5en": ("H200 141GB", 141),
    "g5": ("A10G 24GB", 24),
}


@dataclass(frozen=True, kw_only=True)
class Device:
    """One worker's device."""

    name: str
    memory_bytes: int | None  # None: unknown (the estimate says so instead of fits / does not fit)
    peak_flops: float | None  # dense BF16 FLOP/s; None: unknown (cpu)
    source: str
    confirmed: bool = True  # False: figures not yet in the vendor's public pages (``source`` says where they are from)

    def describe(self) -> str:
        memory = f"{self.memory_bytes / GIB:,.1f} GiB" if self.memory_bytes else "memory unknown"
        peak = f", {self.peak_flops / 1e12:,.1f} TFLOP/s bf16" if self.peak_flops else ""
        return f"{self.name}: {memory}{peak} ({'' if self.confirmed else 'UNCONFIRMED: '}{self.source})"


def worker_device(job: JobSpec, *, instance_type: str | None = None) -> Device:
    """The device one of ``job``'s workers trains on (``instance_type`` overrides the job's, e.g. a cluster's)."""
    s = job.scaling
    itype = instance_type or s.instance_type
    family = (itype or "").split(".", 1)[0]
    peak = peak_flops_per_worker(s.accelerator, itype, lnc=job.neuron.lnc)
    if s.accelerator in ("neuron", "neuron-xla"):
        from raytrn.backends.neuron_env import INSTANCES

        spec = INSTANCES.get(itype or "")
        if spec is not None and spec.hbm_gib_per_chip:
            lnc = job.neuron.lnc if spec.default_lnc else None
            core = f"logical NeuronCore (LNC={lnc or spec.default_lnc})" if spec.default_lnc else "NeuronCore"
            source = f"{spec.hbm_gib_per_chip} GiB HBM a chip x {spec.neuron_devices} over {spec.cores(lnc)} cores"
            return Device(
                name=f"{itype} {core}",
                memory_bytes=spec.worker_memory_bytes(lnc),
                peak_flops=peak,
                source=source if spec.confirmed else f"{source}; {spec.name}'s figures from: {spec.source}",
                confirmed=spec.confirmed,
            )
        return Device(name=f"{itype or 'unknown instance'} NeuronCore", memory_bytes=None, peak_flops=peak,
                      source="no instance_type: set scaling.instance_type")  # fmt: skip
    if s.accelerator == "cuda":
        gpu = GPU_MEMORY_GIB.get(family)
        if gpu is None:
            return Device(name=f"{itype or 'unknown'} GPU", memory_bytes=None, peak_flops=peak,
                          source="GPU not known for this instance type")  # fmt: skip
        return Device(name=gpu[0], memory_bytes=gpu[1] * GIB, peak_flops=peak, source="NVIDIA datasheet")
    workers = s.workers_per_node or s.max_size
    total = _machine_memory()
    return Device(
        name=f"cpu worker (1 of {workers} on this machine)",
        memory_bytes=total // max(1, workers),
        peak_flops=None,
        source=f"this machine's {total / GIB:,.1f} GiB of RAM over {workers} worker(s)",
    )


def _machine_memory() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
