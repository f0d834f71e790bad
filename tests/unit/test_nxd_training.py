"""The NxD path of the training step, run on CPU against a functional stand-in for neuronx-distributed.

The stand-in builds a real (tiny) HF Llama and a real AdamW that clips and exposes ``grad_norm`` the way
``NxDOptimizer`` does, and saves and loads checkpoints the way ``neuronx_distributed.trainer`` does
(``load_checkpoint`` restores model, optimizer and scheduler and returns the user content *as saved*), so
these tests check raytrn's wiring (which model/optimizer/loss the step uses, the fused optimizer step, the
data-parallel batch arithmetic, batch ownership, the sharded save and resume), not NxD itself.
"""

from __future__ import annotations

import copy
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from raytrn.checkpoint.progress import Progress
from raytrn.config import load_job
from raytrn.train.build import build_training
from raytrn.train.schedule import Schedule
from raytrn.train.step import train_step
from raytrn.xla.checkpoints import NxdCheckpoints
from raytrn.xla.neuron_xla import NeuronXlaBackend
from raytrn.xla.nxd import uses_nxd

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


class ClippingAdamW(torch.optim.AdamW):
    """AdamW whose step() clips first and records the pre-clip norm, like NxDOptimizer."""

    def __init__(self, params: Any, max_norm: float | None = None, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.max_norm = max_norm
        self.grad_norm: torch.Tensor | None = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm or float("inf"))
        return super().step(closure)


@pytest.fixture
def nxd_standin(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    seen: dict[str, Any] = {}

    def module(name: str, **attrs: Any) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)

    def initialize_parallel_optimizer(cfg: Any, cls: type, groups: Any, **defaults: Any) -> Any:
        seen["optimizer_defaults"] = defaults
        return ClippingAdamW(groups, **defaults)

    saved: dict[str, dict[str, Any]] = {}  # path -> {tag -> what was written}
    seen["saved"] = saved

    def save_checkpoint(path: str, tag: str, *, model: Any, optimizer: Any, scheduler: Any, user_content: Any = None,
                        num_kept_ckpts: int | None = None, **kw: Any) -> None:  # fmt: skip
        tags = saved.setdefault(path, {})
        tags[tag] = {
            "model": copy.deepcopy(model.state_dict()),
            "optim": copy.deepcopy(optimizer.state_dict()),
            "scheduler": scheduler.state_dict(),
            "user_content.pt": copy.deepcopy(user_content),
        }
        for old in sorted(tags)[: -num_kept_ckpts or None] if num_kept_ckpts else []:
            del tags[old]

    def load_checkpoint(path: str, tag: str | None = None, model: Any = None, optimizer: Any = None,
                        scheduler: Any = None, **kw: Any) -> Any:  # fmt: skip
        entry = saved[path][tag or sorted(saved[path])[-1]]
        if model is not None:
            model.load_state_dict(entry["model"])
        if optimizer is not None:
            optimizer.load_state_dict(entry["optim"])
        if scheduler is not None:
            scheduler.load_state_dict(entry["scheduler"])
        return entry["user_content.pt"]  # as NxD does: the user content exactly as it was saved

    class Storage:
        def __init__(self, path: str) -> None:
            self.path = path

        def list_completed_checkpoint_tags(self) -> list[str]:
            return sorted(saved.get(self.path, {}))

        def file_exists(self, name: str) -> bool:
            tag, _, file = name.partition("/")
            return file in saved.get(self.path, {}).get(tag, {})

        def load_object(self, name: str, map_location: Any = None) -> Any:
            tag, _, file = name.partition("/")
            return saved[self.path][tag][file]

    module("neuronx_distributed")
    module(
        "neuronx_distributed.trainer",
        neuronx_distributed_config=lambda **kw: seen.setdefault("config", kw),
        initialize_parallel_model=lambda cfg, fn, include_buffers: fn(),
        initialize_parallel_optimizer=initialize_parallel_optimizer,
        save_checkpoint=save_checkpoint,
        load_checkpoint=load_checkpoint,
    )
    module("neuronx_distributed.trainer.checkpoint_storage", create_checkpoint_storage=Storage)
    module("neuronx_distributed.parallel_layers")
    module(
        "neuronx_distributed.parallel_layers.parallel_state",
        get_tensor_model_parallel_size=lambda: 2,
        get_data_parallel_size=lambda: 16,
    )
    module(
        "neuronx_distributed.parallel_layers.loss_functions",
        parallel_cross_entropy=lambda logits, target: F.cross_entropy(logits.float(), target, reduction="none"),
    )
    module("modeling_llama_nxd", LlamaForCausalLM=lambda config: LlamaForCausalLM(config))
    return seen


class CpuNeuronBackend(NeuronXlaBackend):
    """The Neuron backend's training construction, on eager CPU tensors instead of NeuronCores."""

    def device(self) -> torch.device:
        return torch.device("cpu")

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def sync(self) -> None:
        pass

    def wrap_batches(self, batches: Any) -> Any:
        return iter(batches)


def _tp_job(*overrides: str):
    return load_job(
        REPO / "jobs" / "tiny.yaml",
        [
            "scaling.accelerator=neuron-xla",
            "scaling.instance_type=trn1.32xlarge",
            "scaling.workers_per_node=32",
            "scaling.min_workers=32",
            "scaling.max_workers=64",
            "scaling.resources_per_worker={neuron_cores: 1}",
            "parallel.tensor_parallel_size=2",
            "parallel.zero1=true",
            "model.vocab_size=512",
            "model.dtype=float32",
            "data.seq_len=32",
            "data.micro_batch_size=2",
            "data.grad_accum=null",
            "data.global_batch_size=64",
            "optim.lr=1e-2",
            "optim.warmup_steps=0",
            *overrides,
        ],
    )


def test_tensor_parallel_training_uses_nxd_model_optimizer_and_loss(nxd_standin: dict[str, Any]) -> None:
    job = _tp_job()
    t = build_training(job, CpuNeuronBackend(), world_size=32)
    assert isinstance(t.checkpoints, NxdCheckpoints) and t.export is None  # NxD's shards, no HF export
    assert isinstance(t.optimizer, ClippingAdamW)
    # ZeRO-1: the clip norm goes to the optimizer itself (NxD would otherwise default it to 1.0).
    assert nxd_standin["optimizer_defaults"]["max_norm"] == job.optim.grad_clip_norm
    assert nxd_standin["config"]["tensor_parallel_size"] == 2
    # 32 workers at TP 2 = 16 replicas: 64 sequences/step = 2 x grad_accum x 16.
    assert t.grad_accum == 2

    gen = torch.Generator().manual_seed(0)
    fixed = torch.randint(0, 512, (2, 33), generator=gen)
    batches = iter([fixed] * 40)  # the same batch again and again: the loss must fall
    first = train_step(t, batches, CpuNeuronBackend())
    for _ in range(10):
        last = train_step(t, batches, CpuNeuronBackend())
    assert last.loss.item() < first.loss.item() - 0.5
    assert last.grad_norm is t.optimizer.grad_norm and float(last.grad_norm) > 0  # read from the fused step
    assert t.scheduler.last_epoch == 11


def test_sharded_checkpoint_resumes_counters_weights_and_schedule(nxd_standin: dict[str, Any], tmp_path: Path) -> None:
    """The loop's NxD save and resume: NxD returns its user content with raytrn's layout key in it, and the
    counters come back from it (it used to reach Progress(**content) and fail the first resume)."""
    job = _tp_job(f"checkpoint.storage={tmp_path}", "tracking.run_name=nxd-resume")
    gen = torch.Generator().manual_seed(1)
    batches = iter([torch.randint(0, 512, (2, 33), generator=gen) for _ in range(12)])
    t = build_training(job, CpuNeuronBackend(), world_size=32)
    for _ in range(3):
        train_step(t, batches, CpuNeuronBackend())
    progress = Progress(step=3, tokens_seen=3 * 64 * 32, epoch=1, last_logged_step=3, cost_usd=1.25)
    [saved] = t.checkpoints.save(t, progress, Schedule.from_job(job), {"step": 3}, final=False)
    assert saved.step == 3 and saved.write is not None
    directory = t.checkpoints.directory  # type: ignore[attr-defined]
    [content] = [e["user_content.pt"] for e in nxd_standin["saved"][directory].values()]
    assert "raytrn_parallel" in content  # the layout key travels in the same user content

    fresh = build_training(job, CpuNeuronBackend(), world_size=32)
    assert fresh.checkpoints.load(str(tmp_path), fresh) == progress
    for (name, a), (_, b) in zip(t.model.state_dict().items(), fresh.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert fresh.scheduler.last_epoch == t.scheduler.last_epoch == 3
    # Both continue identically from here (optimizer moments restored too).
    nxt = torch.randint(0, 512, (2, 33), generator=gen)
    a, b = train_step(t, iter([nxt] * 2), CpuNeuronBackend()), train_step(fresh, iter([nxt] * 2), CpuNeuronBackend())
    assert torch.equal(a.loss, b.loss)


def test_plain_neuron_job_has_no_nxd() -> None:
    job = _tp_job("parallel.tensor_parallel_size=1", "parallel.zero1=false")
    assert not uses_nxd(job)


@pytest.mark.parametrize(("tp", "world"), [(2, 8), (8, 32), (32, 128)])
def test_tp_groups_share_rows_and_replicas_partition_them(tp: int, world: int) -> None:
    from raytrn.config.sizes import data_parallel_rank
    from raytrn.data.order import RankSlice, SampleOrder, plan_epoch

    job = _tp_job(f"parallel.tensor_parallel_size={tp}")
    dp = world // tp
    order = SampleOrder(shard_rows=[20 * dp], block_rows=8, seed=1)

    def rows(rank: int) -> list[int]:
        part = RankSlice(rank=data_parallel_rank(job, rank), size=dp, global_batch=2 * dp)
        return [i for p in plan_epoch(order, part, 0) for i in p.ids.tolist()]

    by_rank = {r: rows(r) for r in range(world)}
    assert all(by_rank[r] == by_rank[r - r % tp] for r in range(world))  # a TP group reads the same rows
    replicas = [by_rank[g * tp] for g in range(dp)]
    assert sorted(sum(replicas, [])) == list(range(20 * dp))  # the replicas share the epoch out, once each


def test_rank0_efficiency_metrics_for_a_trn_job() -> None:
    """Cost from the instance's price and node count, MFU from FLOPs/token and the NeuronCore peak."""
    from raytrn.models import model_stats
    from raytrn.train.metrics import Efficiency

    job = load_job(REPO / "jobs" / "llama3-8b-trn1.yaml")
    eff = Efficiency(job, world_size=1024)  # 32 trn1.32xlarge
    assert eff.cost.num_nodes == 32 and eff.peak == 95e12
    tokens_per_s = 47.95 * 8192  # AWS's published Llama-3.1-8B figure on 32 nodes
    out = eff.metrics(tokens_per_s, tokens_total=int(tokens_per_s))
    assert out["mfu"] == pytest.approx(tokens_per_s * model_stats(job.model, 8192).flops_per_token / (1024 * 95e12))
    assert out["mfu"] == pytest.approx(0.234, abs=0.002)
    assert out["cost_usd"] > 0 and out["usd_per_1m_tokens"] > 0

    spot = load_job(REPO / "jobs" / "llama3-8b-trn1.yaml", ["tracking.spot_usd_per_hour=10"])
    assert Efficiency(spot, world_size=64).cost.usd_per_hour_per_node == 10
