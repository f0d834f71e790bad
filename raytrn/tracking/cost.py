"""Dollars and model FLOPs utilisation: price tables, per-device peaks and a running cost tracker.

Pure functions and tables, no torch, no Ray, no boto3. Prices change and differ by region: every
table here is a default that a caller (or the job spec) can override, e.g. with a spot price.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: On-demand Linux price, USD per instance-hour, AWS us-east-1 list prices (aws.amazon.com/ec2/pricing
#: and the instance pages), as of mid-2025. Prices change and vary by region; override with
#: ``usd_per_hour(..., override=...)`` or a spot price. Figures marked "check" were not re-verified.
PRICES_USD_PER_HOUR: dict[str, float] = {
    # Trainium (aws.amazon.com/ec2/instance-types/trn1/).
    "trn1.2xlarge": 1.34,
    "trn1.32xlarge": 21.50,
    "trn1n.32xlarge": 24.78,
    # Trainium2: us-east-1 on-demand list price, check your region (commonly cited figure, not re-verified).
    "trn2.48xlarge": 46.98,
    # trn2u (UltraServer members) are sold through capacity reservations, not on demand: no list price here.
    # Set tracking.usd_per_hour to what your reservation costs per instance-hour.
    # Trainium3 (trn3, trn3p, trn3e): no public price; like trn2u, capacity reservations. Set tracking.usd_per_hour.
    # NVIDIA GPUs, after AWS's June 2025 price cut on P4/P5 (check: not re-verified).
    "p4d.24xlarge": 21.96,  # 8x A100 40GB
    "p5.48xlarge": 55.04,  # 8x H100 SXM
    "p5e.48xlarge": 63.30,  # 8x H200 (mostly sold as Capacity Blocks; same figure as p5en, check)
    "p5en.48xlarge": 63.30,  # 8x H200
    "g5.xlarge": 1.006,  # 1x A10G
}

#: Dense (no sparsity) BF16 peak FLOP/s of one accelerator device as raytrn runs one worker on it.
PEAK_FLOPS_BF16: dict[str, float] = {
    # AWS Neuron docs, trn1-arch: a Trainium chip is 190 TFLOPS BF16 with 2 NeuronCore-v2 -> 95 per core.
    "trn1": 95e12,
    # AWS Neuron docs, trn2-arch: a Trainium2 chip is 667 TFLOPS dense BF16 with 8 physical
    # NeuronCore-v3 -> 83.375 per physical core; a logical core (LNC=2, the default) is two of them.
    "trn2": 667e12 / 8,
    # UNCONFIRMED per core: Neuron architecture docs, trainium3 (2025-12): a Trainium3 chip is 671 TFLOPS dense BF16
    # with 8 physical NeuronCore-v4 -> 83.875 per physical core, taken as split evenly; a logical core (LNC=2, the
    # default, itself unconfirmed on trn3) is two of them.
    "trn3": 671e12 / 8,
    # NVIDIA datasheets, dense BF16 tensor-core peak (the sparse figures are twice these).
    "A100": 312e12,
    "H100": 989e12,  # H100 SXM5
    "H200": 989e12,  # same compute as H100 SXM, more/faster memory
}

#: GPU model behind an instance family (the part of the instance type before the dot).
_GPU_BY_FAMILY = {"p4d": "A100", "p4de": "A100", "p5": "H100", "p5e": "H200", "p5en": "H200"}


def _family(instance_type: str | None) -> str:
    return (instance_type or "").split(".", 1)[0]


def peak_flops_per_worker(
    accelerator: str, instance_type: str | None, *, lnc: int | None = None, gpu: str | None = None
) -> float | None:
    """Dense BF16 peak FLOP/s of one worker's device, or None when unknown (cpu, unlisted hardware).

    neuron / neuron-xla: one (logical) NeuronCore; trn2/trn2u and trn3/trn3p/trn3e (UNCONFIRMED) at ``lnc``
    (default 2) physical cores per logical core.
    cuda: one GPU, named by ``gpu`` or inferred from the instance family (p4d: A100, p5: H100, p5e/p5en: H200).
    """
    if accelerator in ("neuron", "neuron-xla"):
        family = _family(instance_type) or ("trn2" if accelerator == "neuron" else "trn1")
        if family in ("trn1", "trn1n"):
            return PEAK_FLOPS_BF16["trn1"]
        if family in ("trn2", "trn2u"):
            return PEAK_FLOPS_BF16["trn2"] * (lnc or 2)
        if family in ("trn3", "trn3p", "trn3e"):
            return PEAK_FLOPS_BF16["trn3"] * (lnc or 2)
        return None
    if accelerator == "cuda":
        name = gpu or _GPU_BY_FAMILY.get(_family(instance_type))
        if name is None:
            return None
        for known, peak in PEAK_FLOPS_BF16.items():
            if known.lower() in name.lower():  # "NVIDIA H100 80GB HBM3" -> H100
                return peak
        return None
    return None


def usd_per_hour(
    instance_type: str | None, *, override: float | None = None, spot_price: float | None = None
) -> float | None:
    """Price of one instance-hour: the spot price when given, else the override, else the table; None if unknown."""
    if spot_price is not None:
        return float(spot_price)
    if override is not None:
        return float(override)
    if instance_type is None:
        return None
    return PRICES_USD_PER_HOUR.get(instance_type)


def mfu(tokens_per_s: float, flops_per_token: float, num_workers: int, peak_per_worker: float | None) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the workers' summed peak; None if the peak is unknown."""
    if not peak_per_worker or num_workers <= 0:
        return None
    return tokens_per_s * flops_per_token / (num_workers * peak_per_worker)


@dataclass
class CostTracker:
    """Running cost of a job of ``num_nodes`` instances, fed with elapsed wall time and tokens seen.

    ``base_usd`` is what the run cost before this worker group started (earlier groups and invocations:
    the checkpoint's ``cost_usd``), so the metric keeps running across restarts and resizes.
    """

    usd_per_hour_per_node: float | None
    num_nodes: int
    base_usd: float = 0.0
    cost_usd: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.cost_usd = self.base_usd

    def update(self, elapsed_s: float, tokens: int) -> dict[str, float]:
        """Metrics after ``elapsed_s`` seconds (since this worker group started) and ``tokens`` tokens in total
        (over the whole run).

        Keys: ``cost_usd`` and, once tokens > 0, ``usd_per_1m_tokens`` and ``tokens_per_usd``;
        empty when the price is unknown.
        """
        if self.usd_per_hour_per_node is None:
            return {}
        self.cost_usd = self.base_usd + self.usd_per_hour_per_node * self.num_nodes * max(elapsed_s, 0.0) / 3600.0
        out = {"cost_usd": self.cost_usd}
        if tokens > 0:
            out["usd_per_1m_tokens"] = self.cost_usd / tokens * 1e6
        if tokens > 0 and self.cost_usd > 0:
            out["tokens_per_usd"] = tokens / self.cost_usd
        return out
