"""HSDP (``parallel.data_parallel: hsdp``): FSDP2 sharding within a shard group, replicas across the groups, on real
gloo processes (one spawn of 4 running every layout), and what ``raytrn validate`` and ``raytrn estimate`` say of it.
No Ray.

The 4 ranks train, each layout against one process on the same global batches: the tiny Llama as 2 replicas x 2
shards, as 2 replicas x (1 shard x TP 2), and the tiny Qwen3-MoE as 2 replicas x (EP 2 inside a shard group) and as
one shard group of 4 (EP 2 x 2 shards of the experts).
The first layout's DCP checkpoint then loads into FSDP over the same 4 ranks and into one process, weights and AdamW
moments bit-equal (DCP reshards hsdp -> fsdp -> one process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from raytrn.backends.cpu import CpuBackend
from raytrn.config import JobSpec
from raytrn.errors import ConfigError
from raytrn.estimate.memory import estimate_memory
from raytrn.train.build import build_training
from raytrn.train.checks import check_parallel, check_spec
from raytrn.train.step import read_metrics, train_step
from tests.unit.gloo_ranks import init_gloo, spawn_ranks, tiny_job

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
GLOBAL_ROWS = 8  # 2 micro-batches a rank at DP 4 (gradient accumulation under hsdp's no_sync), 4 at DP 2
SEQ = 32
STEPS = 3
DEADLINE_S = 300  # the spawn (imports and all) takes ~15 s on 2 free cores
#: One process vs 4 (loss and every parameter after STEPS): the same maths, summed in another order.
TOLERANCE = 2e-5
MOE = ("model.family=qwen3_moe", "model.preset=tiny-qwen3-moe", "model.router_aux_loss_coef=0.01")
#: name -> overrides of the layouts the 4 ranks train (each compared with one process on the same batches).
LAYOUTS = {
    "hsdp": ("parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=2"),
    "hsdp-tp2": ("parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=2", "parallel.tensor_parallel_size=2"),
    "hsdp-ep2": (*MOE, "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=2", "parallel.expert_parallel_size=2"),
    # one shard group of 4: the experts sharded over 2 ranks as well (their reduce-scatter summed, then divided)
    "hsdp4-ep2": (*MOE, "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=4", "parallel.expert_parallel_size=2"),
}


def job(tmp: Path, *overrides: str, workers: int = WORLD) -> JobSpec:
    """The tiny job at ``workers`` workers, ``GLOBAL_ROWS`` sequences a step."""
    return tiny_job(tmp, *overrides, workers=workers, seq=SEQ, rows=GLOBAL_ROWS, name="hsdp")


def global_batch(step: int) -> torch.Tensor:
    """Global step ``step``'s rows, the same for every layout (16 of the 512 ids: the loss falls within a few)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 16, (GLOBAL_ROWS, SEQ + 1), generator=gen) * 31 % 512


def train(t: Any, j: JobSpec, world: int, rank: int) -> list[float]:
    """``STEPS`` steps of this rank's share of every global batch (a TP group's ranks read the same); the losses."""
    from raytrn.config.sizes import data_parallel_rank, data_parallel_size

    dp, dp_rank = data_parallel_size(j, world), data_parallel_rank(j, rank)
    out = []
    for step in range(1, STEPS + 1):
        rows = global_batch(step).chunk(dp)[dp_rank]
        result = train_step(t, iter(rows.split(j.data.micro_batch_size)), CpuBackend())
        out.append(read_metrics(result, world)["loss"])
    return out


def full_params(t: Any) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective under FSDP/HSDP/TP)."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in t.model.named_parameters()
    }


def full_state(t: Any) -> dict[str, Any]:
    """Weights and AdamW moments as full tensors by name (a collective; rank 0's, empty elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(
        t.model, t.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {"model": model, "optim": optim.get("state", {})}


def _rank(rank: int, world: int, port: int, tmp: str) -> None:
    """Every layout of :data:`LAYOUTS` in turn, then the hsdp checkpoint loaded into fsdp; rank 0 saves the results."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from raytrn.checkpoint import dcp

    init_gloo(rank, world, port)
    out: dict[str, Any] = {}
    try:
        for name, overrides in LAYOUTS.items():
            j = job(Path(tmp), *overrides)
            t = build_training(j, CpuBackend(), world_size=world, rank=rank)
            q = t.model.model.layers[0].self_attn.q_proj.weight
            assert isinstance(q, DTensor)
            record = {
                "losses": train(t, j, world, rank),
                "params": full_params(t),
                "mesh": q.device_mesh.mesh_dim_names,
            }
            record["placements"] = [type(p).__name__ for p in q.placements]
            record["checkpoint"] = {"layout": t.checkpoints.layout, "plain": t.checkpoints.plain_layout}
            out[name] = record
            if name == "hsdp":  # its checkpoint, then loaded into fsdp over the same ranks
                dcp.save(dcp.training_state(t.model, t.optimizer, t.scheduler), str(Path(tmp) / "ck"))
                out["saved"] = full_state(t)
                fsdp = build_training(job(Path(tmp), "parallel.data_parallel=fsdp"), CpuBackend(), world_size=world)
                dcp.load(str(Path(tmp) / "ck"), fsdp.model, fsdp.optimizer, fsdp.scheduler, source="test")
                out["fsdp"] = full_state(fsdp)
                out["fsdp_placements"] = [
                    type(p).__name__ for p in fsdp.model.model.layers[0].self_attn.q_proj.weight.placements
                ]
        if rank == 0:
            torch.save(out, Path(tmp) / "out.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hsdp")
    spawn_ranks(_rank, WORLD, str(tmp), deadline_s=DEADLINE_S)
    return tmp, torch.load(tmp / "out.pt", weights_only=False)


def _one_process(tmp: Path, overrides: tuple[str, ...]) -> tuple[list[float], dict[str, torch.Tensor]]:
    one = [o for o in overrides if not o.startswith("parallel.")]
    j = job(tmp, *one, workers=1)
    t = build_training(j, CpuBackend(), world_size=1)
    return train(t, j, 1, 0), full_params(t)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hsdp_trains_as_one_process_does(four_ranks: tuple[Path, dict[str, Any]], name: str) -> None:
    """Losses and every parameter (gathered) after 3 steps within 2e-5 of one process on the same global batches;
    the parameters sharded over ``dp_shard`` and replicated over ``dp_replicate`` (and split over ``tp``)."""
    tmp, out = four_ranks
    losses, params = _one_process(tmp, LAYOUTS[name])
    got = out[name]
    assert got["losses"] == pytest.approx(losses, rel=TOLERANCE)
    assert losses[-1] < losses[0]  # it trains
    assert got["params"].keys() == params.keys()
    for param_name, value in params.items():
        torch.testing.assert_close(
            got["params"][param_name], value, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda m, n=param_name: f"{n}: {m}"
        )
    assert got["mesh"] == (("dp_replicate", "dp_shard", "tp") if "tp2" in name else ("dp_replicate", "dp_shard"))
    # replicated over the groups, sharded within one (TP's split first: FSDP's shard is a strided one then)
    assert got["placements"] == (["Replicate", "_StridedShard", "Shard"] if "tp2" in name else ["Replicate", "Shard"])
    # the checkpoint says how it was written, and is the sharded (DCP) kind, never the older state.pt's
    shard, tp = (4, 1) if name.startswith("hsdp4") else (2, 2 if "tp2" in name else 1)
    expected = {"data_parallel": "hsdp", "tensor_parallel_size": tp, "hsdp_shard_size": shard,
                "data_parallel_size": WORLD // tp}  # fmt: skip
    if "ep2" in name:
        expected["expert_parallel_size"] = 2
    assert got["checkpoint"] == {"layout": expected, "plain": False}


def test_an_hsdp_checkpoint_loads_into_fsdp_and_into_one_process(four_ranks: tuple[Path, dict[str, Any]]) -> None:
    """DCP reshards: the hsdp checkpoint (4 ranks, 2 x 2) restores bit-equal into FSDP over 4 ranks and into one
    process (weights and every AdamW moment)."""
    from raytrn.checkpoint import dcp

    tmp, out = four_ranks
    assert out["fsdp_placements"] == ["Shard"]
    one = build_training(job(tmp, workers=1), CpuBackend(), world_size=1)
    dcp.load(str(tmp / "ck"), one.model, one.optimizer, one.scheduler, source="test")
    saved, named = out["saved"], dict(one.model.named_parameters())
    for loaded in (out["fsdp"]["model"], {n: p.detach() for n, p in named.items()}):
        assert loaded.keys() == saved["model"].keys()
        assert all(torch.equal(loaded[n], v) for n, v in saved["model"].items())
    assert out["fsdp"]["optim"].keys() == saved["optim"].keys()
    for param_name, moments in saved["optim"].items():
        mine = one.optimizer.state[named[param_name]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(out["fsdp"]["optim"][param_name][key], moments[key])
            assert torch.equal(mine[key], moments[key])
    assert one.scheduler.state_dict()["last_epoch"] == STEPS


# -- what validate and estimate say (pure) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("parallel.data_parallel=hsdp",), "parallel.data_parallel: hsdp needs the size of its shard groups"),
        (("parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=3"),
         "8 worker(s) (a world size the job can take) is not a multiple of parallel.hsdp_shard_size 3"),
        (("parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=3", "parallel.tensor_parallel_size=2"),
         "parallel.hsdp_shard_size 3 (hsdp's shard group) is not a multiple of parallel.tensor_parallel_size 2"),
        (("parallel.data_parallel=hsdp", "scaling.workers_per_node=1", "parallel.tensor_parallel_size=2"),
         "scaling.workers_per_node 1 (hsdp's shard group) is not a multiple of parallel.tensor_parallel_size 2"),
        (("parallel.data_parallel=fsdp", "parallel.hsdp_shard_size=2"),
         "hsdp_shard_size 2 with data_parallel fsdp: it sizes hsdp's shard groups"),
        ((*MOE, "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=2", "parallel.expert_parallel_size=4"),
         "parallel.expert_parallel_size 4 does not divide the 2 data-parallel ranks of hsdp's shard group"),
        (("parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=4", "scaling.accelerator=xla-cpu"),
         "parallel.data_parallel=hsdp: scaling.accelerator xla-cpu runs one plain worker"),
    ],
)  # fmt: skip
def test_bad_hsdp_layouts_are_refused_one_clear_error_each(
    tmp_path: Path, overrides: tuple[str, ...], expected: str
) -> None:
    """What ``raytrn validate`` runs (the layout, then the batch) on 8 workers: the one error that names the fix."""
    with pytest.raises(ConfigError) as e:
        check_spec(job(tmp_path, *overrides, workers=8))
    assert expected in str(e.value), str(e.value)


def test_hsdp_on_neuron_xla_is_refused(tmp_path: Path) -> None:
    from raytrn.xla.nxd import check_parallel as check_nxd

    j = job(tmp_path, "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=4", "scaling.accelerator=neuron-xla")
    with pytest.raises(ConfigError, match="parallel.data_parallel=hsdp is not available on scaling.accelerator: "):
        check_nxd(j, require_installed=False)


def test_hsdp_is_described_and_elastic_sizes_move_in_whole_shard_groups(tmp_path: Path) -> None:
    from raytrn.config.sizes import describe_sizes, world_sizes

    fixed = job(tmp_path, "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=4", workers=8)
    assert check_parallel(fixed) == [
        "parallel: hsdp over 8 data-parallel rank(s) (sharded over 4 in each of 2 replicated group(s) of 4 workers)"
    ]
    node = job(tmp_path, "parallel.data_parallel=hsdp", "scaling.workers_per_node=2", "parallel.tensor_parallel_size=2",
               workers=8)  # fmt: skip
    assert check_parallel(node)[0].startswith(
        "parallel: hsdp over 4 data-parallel rank(s) (sharded over 1 in each of 4"
    )
    elastic = job(tmp_path, "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=4", "scaling.min_workers=2",
                  "scaling.max_workers=13", "data.global_batch_size=48")  # fmt: skip
    assert world_sizes(elastic) == [4, 8, 12]
    assert "whole hsdp shard groups of 4 workers" in describe_sizes(elastic)


def test_hsdp_memory_lies_between_fsdp_and_ddp(tmp_path: Path) -> None:
    """The state is sharded over a shard group's data-parallel ranks only: per worker more than fsdp over all of
    them, less than ddp's whole copy; what the gathered blocks and activations take is fsdp's."""
    big = ("model.preset=llama3.2-1b", "model.vocab_size=128256")
    ddp = estimate_memory(job(tmp_path, *big, workers=64), 64)
    fsdp = estimate_memory(job(tmp_path, *big, "parallel.data_parallel=fsdp", workers=64), 64)
    hsdp = estimate_memory(
        job(tmp_path, *big, "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=8", workers=64), 64
    )
    assert fsdp.total < hsdp.total < ddp.total
    assert hsdp.parameters == pytest.approx(fsdp.parameters * 8, rel=1e-3)  # 8 of 64 ranks: 8x fsdp's shard
    assert hsdp.optimizer == pytest.approx(fsdp.optimizer * 8, rel=1e-3)
    assert (hsdp.gathered, hsdp.activations, hsdp.gradient_buckets) == (fsdp.gathered, fsdp.activations, 0)
    assert hsdp.notes[0] == "hsdp over 8 of 64 data-parallel ranks"
