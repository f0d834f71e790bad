"""The parallel layouts of the torch.distributed backends (cpu, cuda, neuron): DDP/FSDP, tensor parallel over DTensor,
activation checkpointing; what they refuse (raytrn.train.checks.check_parallel). Moved from test_nxd.py, whose XLA
half checks neuronx-distributed's layouts."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from raytrn.config import JobSpec, apply_overrides, parse_job
from raytrn.errors import ConfigError
from raytrn.train.checks import check_parallel, check_spec

pytestmark = pytest.mark.unit

JOBS = Path(__file__).resolve().parents[2] / "jobs"
_RAW = yaml.safe_load((JOBS / "llama3.2-1b-trn1.yaml").read_text())
PLAIN = "parallel={tensor_parallel_size: 1, zero1: false, sequence_parallel: false}"


def job(name: str = "llama3.2-1b-trn1.yaml", *overrides: str) -> JobSpec:
    """The shipped 1B job (the shapes of a real model) with ``--set``-style overrides (source "job.yaml")."""
    assert name == "llama3.2-1b-trn1.yaml"
    raw = copy.deepcopy(_RAW)
    apply_overrides(raw, list(overrides))
    return parse_job(raw, source="job.yaml")


def config_error(j: JobSpec) -> str:
    """The ConfigError of the checks every command runs on a spec (the parallel layout, then the batch)."""
    with pytest.raises(ConfigError) as e:
        check_spec(j)
    return str(e.value)


def test_plain_jobs_have_nothing_to_say() -> None:
    cpu = job("llama3.2-1b-trn1.yaml", PLAIN, "scaling.accelerator=cpu")
    assert check_parallel(cpu) == []


@pytest.mark.parametrize(
    ("accelerator", "overrides", "expected"),
    [
        ("cpu", ["parallel.tensor_parallel_size=2"], "parallel.tensor_parallel_size=2 needs parallel.data_parallel: fsdp"),
        ("cuda", ["parallel.zero1=true"], "parallel.zero1=true is neuronx-distributed's"),
        ("cpu", ["parallel.zero1=true"], "use parallel.data_parallel: fsdp, which shards parameters, gradients"),
        ("cpu", ["parallel.sequence_parallel=true", "parallel.tensor_parallel_size=2"], "sequence parallelism is not supported on torch.distributed yet"),
    ],
)  # fmt: skip
def test_each_accelerator_refuses_the_layouts_it_cannot_run(
    accelerator: str, overrides: list[str], expected: str
) -> None:
    msg = config_error(job("llama3.2-1b-trn1.yaml", PLAIN, f"scaling.accelerator={accelerator}", *overrides))
    assert msg.startswith("job.yaml: ") and expected in msg, msg


def test_torch_distributed_layouts_are_accepted_and_described() -> None:
    cpu = job(
        "llama3.2-1b-trn1.yaml", PLAIN, "scaling.accelerator=cpu",
        "parallel.data_parallel=fsdp", "parallel.tensor_parallel_size=8", "parallel.activation_checkpointing=selective",
    )  # fmt: skip
    [line] = check_parallel(cpu)
    assert line.startswith("parallel: fsdp over ") and line.endswith(
        "data-parallel rank(s), tensor parallel 8 (DTensor), selective activation checkpointing"
    )


def test_native_tensor_parallel_needs_whole_kv_heads_per_rank() -> None:
    """DTensor's plan splits the kv heads too (NxD would replicate them): 8 kv heads and TP 16 is refused."""
    cpu = job(
        "llama3.2-1b-trn1.yaml", PLAIN, "scaling.accelerator=cpu", "parallel.data_parallel=fsdp",
        "parallel.tensor_parallel_size=16",
    )  # fmt: skip
    msg = config_error(cpu)
    assert "model.num_key_value_heads (8) % 16 = 8: each rank computes num_key_value_heads / TP kv heads" in msg
    assert "tensor_parallel_size values this model allows: 1, 2, 4, 8." in msg
    assert "NxD replicates" not in msg
