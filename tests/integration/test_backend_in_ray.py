"""Inside a Ray Train worker the backends lay the model out over the process group Ray formed (the
single-process path of ``bench/gpu.py``, no wrapping, must not leak into real jobs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _probe(config: dict) -> None:
    import ray.train
    import torch

    from raytrn.backends.base import in_ray_train_worker
    from raytrn.backends.cpu import CpuBackend
    from raytrn.config import load_job
    from raytrn.models import build_model

    job = load_job(REPO / "jobs" / "tiny.yaml", ["data.manifest=unused"], resolve=False)
    ctx = ray.train.get_context()
    from raytrn.train.build import native_layout

    lay_out = native_layout(CpuBackend())
    par = lay_out(build_model(job.model, seed=0), job, world_size=ctx.get_world_size(), compile=None)
    seen = {
        "in_worker": in_ray_train_worker(),
        "process_group": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "layout": par.data_parallel,
        "wrapper": type(par.model).__name__,
    }
    if ctx.get_world_rank() == 0:  # Result.metrics is None for a report without a checkpoint: a file instead
        Path(config["out"]).write_text(json.dumps(seen))


def test_in_a_ray_train_worker_the_model_is_laid_out_over_rays_process_group(ray_session, tmp_path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrn.backends.base import in_ray_train_worker

    assert not in_ray_train_worker()  # the driver is not a worker
    trainer = TorchTrainer(
        _probe,
        train_loop_config={"out": str(tmp_path / "seen.json")},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="backend-in-ray", storage_path=str(tmp_path)),
    )
    trainer.fit()
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {
        "in_worker": True,
        "process_group": "gloo",
        "layout": "ddp",
        "wrapper": "DistributedDataParallel",
    }


# -- TorchNeuron's Ray backend, on gloo -----------------------------------------------------------------------------


def _neuron_probe(config: dict) -> None:
    """Under raytrn's TorchNeuron Ray backend (process group gloo instead of neuron): the worker's environment,
    and three steps of NeuronBackend's own build (FSDP, torch.compile with fullgraph=True, dynamic=False) on CPU."""
    import os

    import ray.train
    import torch
    import torch.distributed as dist

    from raytrn.backends.neuron import NeuronBackend
    from raytrn.train.build import build_training
    from raytrn.train.step import read_metrics, train_step

    class NeuronOnCpu(NeuronBackend):
        """Everything but the device: the CPU, and Dynamo's eager backend in place of neuronx-cc."""

        compile_options = {**NeuronBackend.compile_options, "backend": "eager"}

        def device(self) -> torch.device:
            return torch.device("cpu")

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    job = _neuron_job()
    t = build_training(job, NeuronOnCpu(), world_size=world, rank=rank)
    losses = []
    for step in range(1, 4):
        rows = _global_rows(step).chunk(world)[rank]
        losses.append(read_metrics(train_step(t, iter(rows.split(1)), NeuronOnCpu()), world)["loss"])
    env = {k: os.environ.get(k) for k in _ENV_KEYS}
    seen = {"env": env, "process_group": dist.get_backend(), "world": dist.get_world_size(), "losses": losses,
            "layout": type(t.model).__name__, "compiled": all(b._compiled_call_impl is not None for b in t.model.model.layers)}  # fmt: skip
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(seen))


_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NEURON_RT_VISIBLE_CORES",
             "NEURON_LOGICAL_NC_CONFIG", "NEURON_CC_FLAGS", "FI_PROVIDER", "NEURON_RT_ROOT_COMM_ID")  # fmt: skip


def _neuron_job():
    from raytrn.config import load_job

    return load_job(
        REPO / "jobs" / "llama3.2-1b-trn2.yaml",
        ["data.manifest=unused", "model.preset=null", "model.num_layers=2", "model.hidden_size=64",
         "model.intermediate_size=128", "model.num_attention_heads=4", "model.num_key_value_heads=2",
         "model.vocab_size=256", "model.max_position_embeddings=64", "model.autocast=none", "data.seq_len=32",
         "data.global_batch_size=4", "data.micro_batch_size=1", "optim.warmup_steps=1",
         "parallel.activation_checkpointing=none", "neuron.compile_cache=null"],
        resolve=False,
    )  # fmt: skip


def _global_rows(step: int):
    import torch

    gen = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, 256, (4, 33), generator=gen)


def test_torchneuron_ray_backend_sets_the_env_and_trains_like_one_process(ray_session, tmp_path) -> None:
    """Two workers, each given a NeuronCore by Ray, on raytrn's TorchNeuron backend config: the env is the
    topology's (Ray's core ids kept), the process group forms from env://, and FSDP + compile over 2 workers
    follows one process on the same global batches."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from raytrn.backends.cpu import CpuBackend
    from raytrn.backends.neuron import TorchNeuronConfig
    from raytrn.compat import hosted_trainer
    from raytrn.train.build import build_training
    from raytrn.train.step import read_metrics, train_step

    job = _neuron_job()
    trainer = hosted_trainer(DataParallelTrainer)(  # as raytrn train runs it: the controller in this process
        _neuron_probe,
        train_loop_config={"out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1, "neuron_cores": 1}),
        backend_config=TorchNeuronConfig(backend="gloo", instance_type="trn2.48xlarge", workers_per_node=64),
        run_config=RunConfig(name="torchneuron-backend", storage_path=str(tmp_path)),
    )
    trainer.fit()
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(s["env"]["NEURON_RT_VISIBLE_CORES"] for s in seen) == ["0", "1"]  # Ray's assignment, kept
    for rank, s in enumerate(seen):
        assert s["process_group"] == "gloo" and s["world"] == 2
        assert s["layout"] == "FSDPLlamaForCausalLM" and s["compiled"]
        env = s["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "2",
            "2",
        )
        assert (env["NEURON_LOGICAL_NC_CONFIG"], env["FI_PROVIDER"], env["NEURON_RT_ROOT_COMM_ID"]) == (
            "2",
            "efa",
            None,
        )
        assert env["NEURON_CC_FLAGS"] == "--logical-nc-config 2"  # the config sets no cc_flags
    # The reference: one process, the whole global batch.
    t = build_training(job, CpuBackend(), world_size=1)
    ref = [read_metrics(train_step(t, iter(_global_rows(s).split(1)), CpuBackend()), 1)["loss"] for s in (1, 2, 3)]
    assert seen[0]["losses"] == seen[1]["losses"]
    assert seen[0]["losses"] == pytest.approx(ref, rel=2e-5)
