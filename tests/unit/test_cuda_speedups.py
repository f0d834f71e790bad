"""The CUDA speed settings (autocast, fused AdamW, torch.compile) and the backends outside a Ray Train worker.

These run on CPU: a CudaBackend whose device is the CPU stands in for a GPU, so the step takes the
same path it takes on CUDA (autocast and fused AdamW both exist on CPU).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from raytrn.backends.base import in_ray_train_worker
from raytrn.backends.cpu import CpuBackend
from raytrn.backends.cuda import CudaBackend
from raytrn.config import JobSpec, parse_job
from raytrn.errors import ConfigError
from raytrn.models import build_model
from raytrn.train.build import build_training, native_layout
from raytrn.train.checks import check_job
from raytrn.train.loss import cross_entropy
from raytrn.train.step import train_step

pytestmark = pytest.mark.unit


def job(accelerator: str = "cuda", **sections: dict[str, Any]) -> JobSpec:
    raw: dict[str, Any] = {
        "model": {"preset": "tiny", "autocast": "bfloat16"},
        "data": {"manifest": "unused", "seq_len": 16, "micro_batch_size": 2, "grad_accum": 2},
        "optim": {"lr": 1e-3, "fused": True},
        "scaling": {"accelerator": accelerator},
        "run": {"max_steps": 10},
    }
    for name, fields in sections.items():
        raw[name] = {**raw.get(name, {}), **fields}
    return parse_job(raw, source="job.yaml")


class CudaOnCpu(CudaBackend):
    """The cuda backend's step path with the CPU as its device."""

    def device(self) -> torch.device:
        return torch.device("cpu")


def test_outside_ray_train_the_cuda_backend_uses_the_current_gpu() -> None:
    import ray.train  # noqa: F401  (imported, but no Train context: still not a worker)

    assert not in_ray_train_worker()
    assert CudaBackend().device() == torch.device("cuda", 0)  # a device object; no GPU needed to name it


def test_one_process_is_not_wrapped() -> None:
    """Without a process group (one process, e.g. bench/gpu.py) the model is trained as built: no DDP/FSDP."""
    model = build_model(job().model, seed=0)
    par = native_layout(CpuBackend())(model, job("cpu"), world_size=1, compile=None)
    assert par.model is model and par.data_parallel == "none"


def test_cuda_step_uses_autocast_and_fused_adamw() -> None:
    t = build_training(job(), CudaOnCpu(), world_size=1)
    assert t.autocast_dtype is torch.bfloat16
    assert t.optimizer.defaults["fused"] is True
    assert next(t.model.parameters()).dtype is torch.float32  # master weights stay fp32
    seen: list[torch.dtype] = []
    t.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    batches = itertools.cycle(
        [torch.randint(0, 4096, (2, 17), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    )
    result = train_step(t, batches, CudaOnCpu())
    assert seen == [torch.bfloat16, torch.bfloat16]  # matmuls ran in bf16 for both micro-batches
    assert torch.isfinite(result.loss) and result.loss.dtype is torch.float32


def test_off_cuda_the_settings_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    j = job("cpu", run={"compile": True})
    warnings = CpuBackend().ignored_settings(j)
    assert [w.split("=")[0] for w in warnings] == ["model.autocast", "optim.fused", "run.compile"]
    assert all("ignored on scaling.accelerator='cpu'" in w for w in warnings)
    assert CudaBackend().ignored_settings(j) == []
    with caplog.at_level("WARNING", logger="raytrn.backends.base"):
        t = build_training(j, CpuBackend(), world_size=1)
    assert t.autocast_dtype is None and not t.optimizer.defaults["fused"]
    assert t.loss_fn is cross_entropy  # not compiled
    assert [r.getMessage() for r in caplog.records] == warnings
    assert [line for line in check_job(j, data=False) if line.startswith("warning:")] == [
        f"warning: {w}" for w in warnings
    ]


def test_defaults_change_nothing() -> None:
    j = job("cpu", model={"autocast": "none"}, optim={"fused": False})
    assert (j.model.autocast, j.optim.fused, j.run.compile) == ("none", False, False)
    assert CpuBackend().ignored_settings(j) == []


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"model": {"dtype": "bfloat16"}}, "model: Value error, autocast='bfloat16' needs dtype='float32'"),
        ({"model": {"autocast": "float16"}}, "model.autocast: Input should be 'none' or 'bfloat16'"),
        ({"optim": {"fused": "sometimes"}}, "optim.fused: Input should be a valid boolean"),
        ({"run": {"compile": 3}}, "run.compile: Input should be a valid boolean"),
    ],
)
def test_bad_values_are_config_errors(sections: dict[str, dict[str, Any]], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        job(**sections)
    assert str(e.value).startswith("job.yaml: " + message.split(": Value error, ")[0])
    assert message.split(": ", 1)[1].removeprefix("Value error, ") in str(e.value)
