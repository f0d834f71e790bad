"""LoRA (raytrn.models.lora) on a Hugging Face Llama (and Qwen3, for the exports) made here: training starts at the base model, only the adapters
train (optimizer and checkpoints hold nothing else), the merged export is a plain Llama that ``transformers`` loads,
the adapter export a directory that ``peft`` loads, each computing what raytrn's model computes. One process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from raytrn.backends.cpu import CpuBackend
from raytrn.checkpoint.progress import Progress
from raytrn.errors import ConfigError
from raytrn.models.hf import load_weights
from raytrn.models.lora import LoRALinear, trainable_parameters
from raytrn.train.build import build_training
from raytrn.train.schedule import Schedule
from raytrn.train.step import train_step
from tests.unit.test_init_from import hf_checkpoint, job_for, qwen3_checkpoint

pytestmark = pytest.mark.unit

TARGETS = "[q_proj, v_proj, down_proj]"


def lora_job(ckpt: Path, tmp: Path, *overrides: str) -> Any:
    return job_for(ckpt, "data.seq_len=16", f"model.lora={{rank: 4, alpha: 8, targets: {TARGETS}}}",
                   f"checkpoint.storage={tmp / 'ckpt'}", "tracking.run_name=lora", *overrides)  # fmt: skip


def trained(job: Any, ckpt: Path, steps: int = 3) -> Any:
    t = build_training(job, CpuBackend(), world_size=1)
    load_weights(t.model, str(ckpt), tied=False, source="t")
    rows = torch.randint(0, 512, (job.data.micro_batch_size * steps, 17), generator=torch.Generator().manual_seed(0))
    batches = iter(rows.split(job.data.micro_batch_size))
    for _ in range(steps):
        train_step(t, batches, CpuBackend())
    return t


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(4))


def test_only_the_adapters_train_and_training_starts_at_the_base_model(tmp_path: Path) -> None:
    hf = hf_checkpoint(tmp_path / "hf")
    job = lora_job(tmp_path / "hf", tmp_path)
    t = build_training(job, CpuBackend(), world_size=1)
    load_weights(t.model, str(tmp_path / "hf"), tied=False, source="t")
    assert torch.equal(logits(t.model, IDS), logits(hf, IDS))  # B = 0: the base model exactly
    adapted = [n for n, m in t.model.named_modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == 2 * 3 and all(n.rsplit(".", 1)[-1] in ("q_proj", "v_proj", "down_proj") for n in adapted)
    trainable, total = trainable_parameters(t.model)
    in_optimizer = sum(p.numel() for g in t.optimizer.param_groups for p in g["params"])
    assert in_optimizer == trainable == sum(p.numel() for n, p in t.model.named_parameters() if ".lora_" in n)
    assert trainable < total / 20
    base = {n: p.detach().clone() for n, p in t.model.named_parameters() if ".lora_" not in n}
    rows = torch.randint(0, 512, (job.data.micro_batch_size * 2, 17), generator=torch.Generator().manual_seed(0))
    batches = iter(rows.split(job.data.micro_batch_size))
    for _ in range(2):
        train_step(t, batches, CpuBackend())
    assert all(torch.equal(p, base[n]) for n, p in t.model.named_parameters() if ".lora_" not in n)
    assert not torch.equal(logits(t.model, IDS), logits(hf, IDS))  # the adapters did learn


def test_checkpoints_hold_the_adapters_only_and_resume_them(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from raytrn.checkpoint.finder import newest_committed
    from raytrn.checkpoint.rundir import RunDir

    hf_checkpoint(tmp_path / "hf")
    job = lora_job(tmp_path / "hf", tmp_path)
    t = trained(job, tmp_path / "hf")
    [saved] = t.checkpoints.save(t, Progress(step=3), Schedule.from_job(job), {}, final=False)
    location = RunDir.of(job).dcp_step(3)
    keys = FileSystemReader(location).read_metadata().state_dict_metadata
    model_keys = sorted(k for k in keys if k.startswith("model."))
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys
    fresh = build_training(job, CpuBackend(), world_size=1)
    load_weights(fresh.model, str(tmp_path / "hf"), tied=False, source="t")  # every start: the base from init_from
    fresh.checkpoints.load_committed(newest_committed(RunDir.of(job)), fresh)
    assert torch.equal(logits(fresh.model, IDS), logits(t.model, IDS))


def checkpoint_of(family: str, out: Path) -> Any:
    """A tiny random HF checkpoint of ``family`` (Llama, or Qwen3: per-head norms, heads of their own width)."""
    return hf_checkpoint(out) if family == "llama" else qwen3_checkpoint(out, tie=False)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_merged_export_is_a_plain_model_transformers_loads(tmp_path: Path, family: str) -> None:
    import json

    from transformers import AutoModelForCausalLM

    from raytrn.tracking.export import export_hf

    checkpoint_of(family, tmp_path / "hf")
    job = lora_job(tmp_path / "hf", tmp_path)
    assert job.model.family == family
    t = trained(job, tmp_path / "hf")
    specs = {n: (v.dtype, tuple(v.shape)) for n, v in t.model.state_dict().items()}
    (tmp_path / "merged").mkdir()
    export_hf(job, iter(t.model.state_dict().items()), str(tmp_path / "merged"), specs)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == family
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in n for n in back.state_dict())
    torch.testing.assert_close(logits(back, IDS), logits(t.model, IDS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_adapter_export_is_a_peft_adapter(tmp_path: Path, family: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raytrn.tracking.export import export_hf

    checkpoint_of(family, tmp_path / "hf")
    job = lora_job(tmp_path / "hf", tmp_path, "tracking.export=adapter")
    t = trained(job, tmp_path / "hf")
    specs = {n: (v.dtype, tuple(v.shape)) for n, v in t.model.state_dict().items()}
    (tmp_path / "adapter").mkdir()
    export_hf(job, iter(t.model.state_dict().items()), str(tmp_path / "adapter"), specs)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(peft_model, IDS), logits(t.model, IDS), rtol=1e-5, atol=1e-5)


def test_bad_lora_settings_are_refused(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path / "hf")
    job = lora_job(tmp_path / "hf", tmp_path, "model.lora.targets=[q_proj, qkv_proj]")
    with pytest.raises(ConfigError) as e:
        build_training(job, CpuBackend(), world_size=1)
    assert "model.lora.targets: qkv_proj match(es) no linear layer of the model" in str(e.value)
    assert "its linear layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in str(
        e.value
    )
    with pytest.raises(ConfigError, match="model.lora with parallel.tensor_parallel_size > 1 is not supported"):
        lora_job(tmp_path / "hf", tmp_path, "parallel.tensor_parallel_size=2")
    from raytrn.config import load_job

    with pytest.raises(ConfigError, match="model.lora trains adapters on a pretrained model: set model.init_from"):
        load_job(Path(__file__).resolve().parents[2] / "jobs" / "tiny.yaml", ["data.manifest=x", "model.lora={}"])
