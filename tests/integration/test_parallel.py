"""FSDP2, tensor parallelism and DCP checkpoints on real multi-process ``torch.distributed`` (gloo, CPU).

Every layout is compared with one process training on the same global batches: loss curves within a
stated tolerance (collectives sum in another order), and checkpoints that reload bit-equal into any other
layout (4 workers fsdp -> 2 workers ddp -> 3 workers fsdp). The workers run raytrn's own build and step
(``Backend.build_training`` + ``train_step``) without Ray; ``test_train.py`` runs the same code under Ray.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from raytrn.backends.cpu import CpuBackend
from raytrn.config import load_job

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GLOBAL_ROWS = 12  # divisible by every data-parallel size used here: 1, 2, 3, 4
SEQ = 32
#: Loss of a distributed layout vs one process, per step: the same maths, summed in another order.
LOSS_RTOL = 2e-5


def tiny_job(tmp: Path, *overrides: str) -> Any:
    return load_job(
        REPO / "jobs" / "tiny.yaml",
        [
            "data.manifest=unused",
            f"data.seq_len={SEQ}",
            "model.vocab_size=512",
            "data.grad_accum=null",
            f"data.global_batch_size={GLOBAL_ROWS}",
            "data.micro_batch_size=1",
            "optim.warmup_steps=2",
            "scaling.min_workers=1",
            "scaling.max_workers=4",
            f"checkpoint.storage={tmp / 'ckpt'}",
            "tracking.run_name=parallel",
            "run.max_steps=20",
            *overrides,
        ],
        resolve=False,
    )


def global_batch(step: int) -> torch.Tensor:
    """The rows of global step ``step`` (the same for every layout): 16 of the 512 token ids, so the loss falls
    within a few steps."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 16, (GLOBAL_ROWS, SEQ + 1), generator=gen) * 31 % 512


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the worker (a forked process) --------------------------------------------------------------------


#: What the fork server imports once (see :func:`start_processes`): torch and raytrn's build and step take ~2.5 s
#: a process, and this file starts ~60 of them.
PRELOAD = ["torch", "torch.distributed", "raytrn.train.build", "raytrn.train.step", "raytrn.checkpoint.dcp", __name__]


def start_processes(fn: Any, world: int, plan: dict[str, Any], out: str) -> None:
    """``fn(rank, world, port, plan, out)`` on ``world`` processes, forked from a server that imported
    :data:`PRELOAD` (started at the first call, the same one for the whole file): each is a fresh process, as
    spawned ones are, without paying the imports. A forked process has the server's environment, not this
    one's: the plan carries this one's (``_enter``)."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(PRELOAD)
    plan = {**plan, "env": dict(os.environ)}
    mp.start_processes(fn, args=(world, _free_port(), plan, out), nprocs=world, start_method="forkserver")


def _enter(rank: int, world: int, port: int, plan: dict[str, Any]) -> None:
    """A worker's environment: the test's (``start_processes``) and the process group's rendezvous."""
    os.environ.clear()
    os.environ.update(plan["env"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))


def _worker(rank: int, world: int, port: int, plan: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    _enter(rank, world, port, plan)
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    _run_plan(rank, world, plan, Path(out))
    if dist.is_initialized():
        # Every rank done before any goes: a rank that exits while a peer's gloo pair still has work on the wire
        # aborts that peer. Then out at once, without tearing the process group down: its threads' teardown still
        # aborted a rank now and then ("terminate called without an active exception": once in CI, once in the stop
        # 46 rehearsal, after the rank had written its record).
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _run_plan(rank: int, world: int, plan: dict[str, Any], out: Path) -> None:
    from raytrn.config.sizes import data_parallel_size
    from raytrn.train.build import build_training
    from raytrn.train.step import read_metrics, train_step

    job = tiny_job(Path(plan["tmp"]), *plan["overrides"])
    backend = _Bf16Cpu() if plan.get("bf16") else _CompiledCpu() if plan.get("compiled") else CpuBackend()
    t = build_training(job, backend, world_size=world, rank=rank)
    seen: list[str] = []
    inner = getattr(t.model, "module", t.model)  # DDP wraps
    mlp = inner.model.layers[0].mlp  # a MoE layer's returns its output and its routing's sums
    getattr(mlp, "down_proj", mlp).register_forward_hook(
        lambda m, i, o: seen.append(str((o[0] if isinstance(o, tuple) else o).dtype))
    )
    tp = job.parallel.tensor_parallel_size
    dp, dp_rank = data_parallel_size(job, world), rank // tp
    record: dict[str, Any] = {"losses": {}}
    start = 0
    if plan.get("init"):  # model.init_from: every rank reads its own slices of the HF checkpoint
        from raytrn.models.hf import load_weights

        load_weights(t.model, plan["init"], tied=job.model.tie_word_embeddings, source="test")
        _dump_full(t, out / f"init-{plan['name']}.pt", rank)
    if plan.get("load"):
        from raytrn.checkpoint import dcp

        dcp.load(plan["load"], t.model, t.optimizer, t.scheduler, source="test")
        start = plan["start"]
        _dump_full(t, out / f"loaded-{plan['name']}.pt", rank)
    if plan.get("load_snapshot"):  # the memory tier's files of another layout (every rank's), resharded here
        from raytrn.checkpoint import memfiles

        held = {f.name: f.read_bytes() for f in Path(plan["load_snapshot"]).iterdir()}
        memfiles.load_from_memory(held.__getitem__, t.model, t.optimizer, t.scheduler)
        start = plan["start"]
        _dump_full(t, out / f"loaded-{plan['name']}.pt", rank)
    if plan.get("grads"):  # the first step's gradients (loss, aux loss, averaged over the global batch), full
        _dump_grads(t, global_batch(1).chunk(dp)[dp_rank].split(job.data.micro_batch_size), out, plan["name"], rank)
    for step in range(start + 1, plan["steps"] + 1):
        rows = global_batch(step).chunk(dp)[dp_rank]  # this replica's share, micro-batch by micro-batch
        micro = list(rows.split(job.data.micro_batch_size))
        if plan.get("masked"):  # instruction data: rows trained on in part, unevenly across the ranks
            micro = [_masked(m) for m in micro]
        result = train_step(t, iter(micro), backend)
        metrics = read_metrics(result, world)
        record["losses"][step] = metrics["loss"]
        if "moe_dropped_fraction" in metrics:
            record.setdefault("dropped", {})[step] = metrics["moe_dropped_fraction"]
        record.setdefault("trained", {})[step] = result.trained_tokens
    if plan.get("eval"):  # the validation loss over the same rows at any world size
        from raytrn.data.manifest import load_manifest
        from raytrn.train.evaluate import Evaluator

        evaluator = Evaluator(job, load_manifest(plan["eval"]), dp=dp, dp_rank=dp_rank)
        record["val"] = evaluator.evaluate(t, backend)
    if plan.get("save"):
        from raytrn.checkpoint import dcp

        state = dcp.training_state(t.model, t.optimizer, t.scheduler)
        if plan.get("async"):
            group = torch.distributed.new_group(backend="gloo") if world > 1 else None
            dcp.async_save(state, plan["save"], process_group=group)[0].result()
        else:
            dcp.save(state, plan["save"])
        _dump_full(t, out / f"saved-{plan['name']}.pt", rank)
    if plan.get("snapshot"):  # the memory tier's in-memory snapshot of the same state, its files to a directory
        from raytrn.checkpoint import memfiles

        snapshotter = memfiles.Snapshotter(t.model, t.optimizer, t.scheduler)
        group = torch.distributed.new_group(backend="gloo") if world > 1 else None
        for file_name, data in snapshotter.write(snapshotter.stage(), process_group=group).items():
            Path(plan["snapshot"]).mkdir(exist_ok=True)
            (Path(plan["snapshot"]) / file_name).write_bytes(bytes(data))
    if plan.get("export"):
        from raytrn.models.export import save_hf

        specs = {n: (v.dtype, tuple(v.shape)) for n, v in getattr(t.model, "module", t.model).state_dict().items()}
        save_hf(job.model, t.export(), plan["export"] if rank == 0 else None, specs=specs)
    record["compute_dtypes"] = sorted(set(seen))
    record["param_dtypes"] = sorted({str(p.dtype) for p in t.model.parameters()})
    record["autocast"] = str(t.autocast_dtype)
    if rank == 0:
        (out / f"record-{plan['name']}.json").write_text(json.dumps(record))


def _dump_grads(t: Any, micro: Any, out: Path, name: str, rank: int) -> None:
    """Rank 0 saves every parameter's gradient of one step over ``micro`` (gathered: a collective), then drops them."""
    from contextlib import nullcontext

    from torch.distributed.tensor import DTensor

    from raytrn.train.step import forward, with_aux_loss

    for i, batch in enumerate(micro):
        with nullcontext() if i == len(micro) - 1 else t.no_sync():
            logits, targets, _, result = forward(t, batch)
            (with_aux_loss(t, t.loss_fn(logits, targets), result) / len(micro)).backward()
    grads = {}
    for param_name, param in getattr(t.model, "module", t.model).named_parameters():
        grad = param.grad
        grads[param_name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    t.optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save(grads, out / f"grads-{name}.pt")


def _masked(rows: torch.Tensor) -> Any:
    """A micro-batch whose targets are trained on only where the token id is not a multiple of 3 (masks of
    different sizes on every row and rank)."""
    from raytrn.data.batch import TokenBatch

    return TokenBatch(rows, rows % 3 != 0, None)


class _Bf16Cpu(CpuBackend):
    """The cuda backend's mixed precision (model.autocast: bfloat16) on gloo/CPU."""

    def autocast_dtype(self, job: Any) -> torch.dtype | None:
        return torch.bfloat16


class _CompiledCpu(CpuBackend):
    """torch.compile as TorchNeuron's (fullgraph, static shapes), with aot_eager: the graphs traced and run in
    eager kernels (the same numbers), on gloo."""

    compile_options = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}


def _dump_full(t: Any, path: Path, rank: int) -> None:
    """Model weights and AdamW moments as full tensors keyed by name (a collective under FSDP/TP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(
        t.model, t.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"model": model_state, "optim": optim_state["state"], "sched": t.scheduler.state_dict()}, path)


def _same_state(out: Path, saved: str, loaded: str) -> dict[str, Any]:
    """Layout ``saved``'s state as it saved it and ``loaded``'s as it loaded it (``_dump_full``), bit-equal: every
    weight, every AdamW moment and step, the schedule. Returns the saved one."""
    a = torch.load(out / f"saved-{saved}.pt", weights_only=False)
    b = torch.load(out / f"loaded-{loaded}.pt", weights_only=False)
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), (saved, loaded, name)
    assert a["optim"].keys() == b["optim"].keys()
    for name, moments in a["optim"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(moments[key], b["optim"][name][key]), (saved, loaded, name, key)
    assert a["sched"] == b["sched"]
    return a


def run_layout(tmp: Path, world: int, name: str, *overrides: str, **plan: Any) -> dict[str, Any]:
    """Run ``plan`` on ``world`` gloo processes; rank 0's record (loss per step)."""
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    plan = {"name": name, "tmp": str(tmp), "overrides": list(overrides), "steps": 6, **plan}
    start_processes(_worker, world, plan, str(out))
    return json.loads((out / f"record-{name}.json").read_text())


def losses(record: dict[str, Any]) -> list[float]:
    return [record["losses"][k] for k in sorted(record["losses"], key=int)]


MOE = ("model.family=qwen3_moe", "model.preset=tiny-qwen3-moe", "model.router_aux_loss_coef=0.01")


@pytest.fixture(scope="module")
def moe_one(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """The tiny Qwen3-MoE's reference: one process, 3 steps, the first step's gradients."""
    tmp = tmp_path_factory.mktemp("moe")
    return tmp, run_layout(tmp, 1, "moe-one", *MOE, steps=3, grads=True)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """The reference: one process, the whole global batch, 12 steps."""
    tmp = tmp_path_factory.mktemp("single")
    record = run_layout(tmp, 1, "single", steps=12)
    return tmp, record


# -- tests ---------------------------------------------------------------------------------------------


def test_fsdp_and_ddp_follow_the_single_process_curve(single, tmp_path) -> None:
    _, ref = single
    ddp = run_layout(tmp_path, 2, "ddp", "parallel.data_parallel=ddp")
    fsdp = run_layout(tmp_path, 2, "fsdp", "parallel.data_parallel=fsdp")
    assert losses(ddp) == pytest.approx(losses(ref)[:6], rel=LOSS_RTOL)
    assert losses(fsdp) == pytest.approx(losses(ddp), rel=LOSS_RTOL)
    assert losses(ref)[5] < losses(ref)[0] - 0.3  # it trains


def test_tensor_parallel_2_equals_tp_1(single, tmp_path) -> None:
    _, ref = single
    tp2 = run_layout(tmp_path, 2, "tp2", "parallel.data_parallel=fsdp", "parallel.tensor_parallel_size=2")
    assert losses(tp2) == pytest.approx(losses(ref)[:6], rel=LOSS_RTOL)


def test_qwen3_under_fsdp_x_tensor_parallel_follows_one_process(tmp_path) -> None:
    """Qwen3's per-head query and key norms on each rank's own heads (TP 2 splits the heads), under FSDP: the
    same losses and gradients as one process (the norms' weights see every head: their gradients are summed over
    the TP group, not each rank's half)."""
    qwen3 = ("model.family=qwen3", "model.preset=tiny-qwen3")
    one = run_layout(tmp_path, 1, "qwen3-one", *qwen3, steps=4, grads=True)
    tp2 = run_layout(tmp_path, 2, "qwen3-tp2", *qwen3, "parallel.data_parallel=fsdp",
                     "parallel.tensor_parallel_size=2", steps=4, grads=True)  # fmt: skip
    assert losses(tp2) == pytest.approx(losses(one), rel=LOSS_RTOL)
    _same_grads(tmp_path, "qwen3-one", "qwen3-tp2")
    assert losses(one)[3] < losses(one)[0]  # it trains


def test_dp2_x_tp2_on_4_workers_with_activation_checkpointing(single, tmp_path) -> None:
    _, ref = single
    run = run_layout(
        tmp_path, 4, "dp2tp2", "parallel.data_parallel=fsdp", "parallel.tensor_parallel_size=2",
        "parallel.activation_checkpointing=selective", "model.tie_word_embeddings=false",
    )  # fmt: skip
    assert losses(run) == pytest.approx(losses(ref)[:6], rel=LOSS_RTOL)


def test_fsdp_mixed_precision_computes_in_bf16_and_keeps_fp32_weights(single, tmp_path) -> None:
    """model.autocast: bfloat16 under fsdp is FSDP's MixedPrecisionPolicy (bf16 compute, fp32 reduce), not
    torch.autocast; the parameters (and AdamW state) stay float32."""
    _, ref = single
    run = run_layout(tmp_path, 2, "bf16", "parallel.data_parallel=fsdp", bf16=True)
    assert run["compute_dtypes"] == ["torch.bfloat16"] and run["param_dtypes"] == ["torch.float32"]
    assert run["autocast"] == "None"  # the policy casts; no autocast region on top
    assert losses(run) == pytest.approx(losses(ref)[:6], rel=2e-2)  # bf16 rounding, same trajectory
    assert losses(run) != pytest.approx(losses(ref)[:6], rel=1e-6)  # and it did compute in bf16


def test_resharded_resume_fsdp4_ddp2_fsdp3(single, tmp_path) -> None:
    """A checkpoint written by 4 fsdp workers loads bit-equal into 2 ddp workers, whose checkpoint loads
    bit-equal into 3 fsdp workers; the losses stay on the uninterrupted single-process curve."""
    _, ref = single
    out = tmp_path / "out"
    first = run_layout(tmp_path, 4, "fsdp4", "parallel.data_parallel=fsdp", steps=4, save=str(tmp_path / "ck4"))
    second = run_layout(
        tmp_path, 2, "ddp2", "parallel.data_parallel=ddp", steps=8, start=4,
        load=str(tmp_path / "ck4"), save=str(tmp_path / "ck8"),
    )  # fmt: skip
    third = run_layout(
        tmp_path, 3, "fsdp3", "parallel.data_parallel=fsdp", "parallel.activation_checkpointing=full",
        steps=12, start=8, load=str(tmp_path / "ck8"),
    )  # fmt: skip
    for saved, loaded in (("fsdp4", "ddp2"), ("ddp2", "fsdp3")):
        _same_state(out, saved, loaded)
    curve = losses(first) + losses(second) + losses(third)
    assert curve == pytest.approx(losses(ref), rel=LOSS_RTOL)


def test_async_save_writes_the_same_checkpoint_as_sync(tmp_path) -> None:
    from raytrn.checkpoint import dcp
    from raytrn.train.build import build_training

    run_layout(tmp_path, 2, "sync", "parallel.data_parallel=fsdp", steps=2, save=str(tmp_path / "sync"))
    run_layout(
        tmp_path, 2, "async", "parallel.data_parallel=fsdp", steps=2, save=str(tmp_path / "async"), **{"async": True}
    )
    job = tiny_job(tmp_path)
    states = []
    for name in ("sync", "async"):
        t = build_training(job, CpuBackend(), world_size=1)
        dcp.load(str(tmp_path / name), t.model, t.optimizer, t.scheduler, source="test")
        states.append((t.model.state_dict(), t.optimizer.state_dict()))
    (ma, oa), (mb, ob) = states
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    assert all(torch.equal(oa["state"][i][k], ob["state"][i][k]) for i in oa["state"] for k in oa["state"][i])


def test_s3_round_trip_and_hf_export_from_shards(single, tmp_path, s3_bucket, s3_endpoint) -> None:
    """2 tensor-parallel workers save to S3 (moto) and export HF safetensors gathered tensor by tensor; one
    process loads the S3 checkpoint, and transformers loads the export: all equal to the 2-worker weights."""
    from transformers import AutoModelForCausalLM

    from raytrn.checkpoint import dcp
    from raytrn.train.build import build_training

    location = f"s3://{s3_bucket}/ckpt/run/dcp/step_00000002"
    os.environ["AWS_ENDPOINT_URL"] = s3_endpoint  # the workers get this environment (monkeypatch set it here)
    export = tmp_path / "hf"
    export.mkdir()
    run_layout(
        tmp_path, 2, "s3", "parallel.data_parallel=fsdp", "parallel.tensor_parallel_size=2",
        steps=2, save=location, export=str(export),
    )  # fmt: skip
    job = tiny_job(tmp_path)
    t = build_training(job, CpuBackend(), world_size=1)
    dcp.load(location, t.model, t.optimizer, t.scheduler, source="test")
    saved = torch.load(tmp_path / "out" / "saved-s3.pt", weights_only=False)["model"]
    for name, value in t.model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    hf = AutoModelForCausalLM.from_pretrained(export).eval()
    ids = global_batch(99)[:2, :SEQ]
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, t.model.eval()(input_ids=ids).logits)


def test_s3_upload_streams_parts_and_leaves_nothing_on_error(s3_bucket, s3_endpoint) -> None:
    """raytrn.storage.S3Upload (how DCP files reach S3): parts go up while writing, each with its CRC32; the size
    and sha256 it reports are the object's; small objects are one put; an aborted upload leaves neither an object
    nor a pending multipart upload."""
    import hashlib

    import boto3

    from raytrn.storage import S3Upload

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    data = os.urandom(12 << 20)
    up = S3Upload(f"{s3_bucket}/big", part_size=5 << 20)
    for i in range(0, len(data), 3 << 18):  # written in 768 KB pieces that straddle the parts' edges
        up.write(memoryview(data)[i : i + (3 << 18)])
    assert up.tell() == len(data)
    up.close()
    up.close()  # idempotent
    assert s3.get_object(Bucket=s3_bucket, Key="big")["Body"].read() == data
    assert (up.size, up.hexdigest()) == (len(data), hashlib.sha256(data).hexdigest())
    assert s3.head_object(Bucket=s3_bucket, Key="big", PartNumber=1)["PartsCount"] == 3
    checksum = s3.get_object_attributes(Bucket=s3_bucket, Key="big", ObjectAttributes=["Checksum"])["Checksum"]
    assert checksum.get("ChecksumCRC32") and checksum["ChecksumType"] == "COMPOSITE"  # one CRC32 per part
    small = S3Upload(f"{s3_bucket}/small")
    small.write(b"abc")
    small.finish()
    assert s3.get_object(Bucket=s3_bucket, Key="small")["Body"].read() == b"abc"
    assert (small.size, small.hexdigest()) == (3, hashlib.sha256(b"abc").hexdigest())
    broken = S3Upload(f"{s3_bucket}/broken", part_size=5 << 20)
    broken.write(data)
    broken.abort()
    assert "Contents" not in s3.list_objects_v2(Bucket=s3_bucket, Prefix="broken")
    assert not s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads")


def test_a_dcp_save_to_s3_writes_only_its_files(s3_bucket, s3_endpoint) -> None:
    """On S3 a DCP save makes no directory markers and no ``.metadata.tmp`` (written under its name, no copy and
    delete); the digests it returns are the objects' bytes; it loads back equal."""
    import hashlib

    import boto3
    import torch.distributed.checkpoint as torch_dcp

    from raytrn.checkpoint import dcp

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    state = {"w": torch.randn(300, 500), "b": torch.arange(7)}
    digests = dcp.save(state, f"s3://{s3_bucket}/run/dcp/step_1")
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert keys == ["run/dcp/step_1/.metadata", "run/dcp/step_1/__0_0.distcp"]
    for key in keys:
        body = s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        assert digests[key.rsplit("/", 1)[1]] == (len(body), hashlib.sha256(body).hexdigest())
    back = {"w": torch.zeros(300, 500), "b": torch.zeros(7, dtype=torch.long)}
    reader = dcp.storage_reader(f"s3://{s3_bucket}/run/dcp/step_1")
    torch_dcp.load(back, storage_reader=reader, no_dist=True)  # its tensors read in place from the file's bytes
    assert not reader.fs._kept  # the file let go once read
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])


def _tiny_hf(path: Path) -> None:
    """A Hugging Face Llama of the tiny job's sizes (random weights) at ``path`` (sharded, with an index)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    hf = LlamaForCausalLM(
        LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
    )  # fmt: skip
    hf.save_pretrained(path, max_shard_size="600KB")


def test_lora_under_ddp_and_fsdp_follows_one_process(tmp_path) -> None:
    """model.lora on 2 workers (ddp, fsdp) from the same init_from: the loss curve of one process."""
    _tiny_hf(tmp_path / "hf")
    lora = (f"model.init_from={tmp_path / 'hf'}", "model.lora={rank: 4, alpha: 8, targets: [q_proj, v_proj, up_proj]}",
            "model.tie_word_embeddings=false")  # fmt: skip
    one = run_layout(tmp_path, 1, "lora1", *lora, init=str(tmp_path / "hf"))
    ddp = run_layout(tmp_path, 2, "lora-ddp", *lora, "parallel.data_parallel=ddp", init=str(tmp_path / "hf"))
    fsdp = run_layout(tmp_path, 2, "lora-fsdp", *lora, "parallel.data_parallel=fsdp", init=str(tmp_path / "hf"))
    assert losses(ddp) == pytest.approx(losses(one), rel=LOSS_RTOL)
    assert losses(fsdp) == pytest.approx(losses(one), rel=LOSS_RTOL)
    assert losses(one)[-1] < losses(one)[0]  # the adapters learn


def test_init_from_a_hugging_face_checkpoint_into_fsdp_and_tensor_parallel(tmp_path) -> None:
    """model.init_from on 4 workers, FSDP x TP 2: every rank reads only the slices its shards hold (DCP's Hugging
    Face reader), and the model gathered back is the checkpoint, tensor for tensor, bit-equal."""
    from safetensors.torch import load_file

    _tiny_hf(tmp_path / "hf")
    run_layout(
        tmp_path, 4, "init", "parallel.data_parallel=fsdp", "parallel.tensor_parallel_size=2",
        "model.tie_word_embeddings=false", steps=0, init=str(tmp_path / "hf"),
    )  # fmt: skip
    loaded = torch.load(tmp_path / "out" / "init-init.pt")["model"]
    saved = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        saved.update(load_file(f))
    assert sorted(loaded) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def test_qwen3_moe_under_ddp_and_fsdp_follows_one_process_and_loads_its_experts_sharded(moe_one, tmp_path) -> None:
    """The tiny Qwen3-MoE (dropless, the load-balancing loss in the gradients) on 2 workers, DDP and FSDP (the
    stacked experts sharded): the losses of one process. Then model.init_from a transformers-saved checkpoint (one
    tensor per expert) into FSDP on 3 workers, 4 experts (2, 2 and none a rank): gathered back, the checkpoint's
    experts stacked, bit-equal."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tmp, one = moe_one
    moe = MOE
    ddp = run_layout(tmp, 2, "moe-ddp", *moe, "parallel.data_parallel=ddp", steps=3, grads=True)
    fsdp = run_layout(tmp, 2, "moe-fsdp", *moe, "parallel.data_parallel=fsdp", steps=3, grads=True)
    for name, run in (("moe-ddp", ddp), ("moe-fsdp", fsdp)):
        assert losses(run) == pytest.approx(losses(one), rel=LOSS_RTOL)
        _same_grads(tmp, "moe-one", name)

    torch.manual_seed(3)
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=384, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "hf-moe")
    from_hf = ("model.family=null", "model.preset=null", "model.hidden_size=null", "model.intermediate_size=null",
               "model.num_layers=null", "model.num_attention_heads=null", "model.num_key_value_heads=null",
               f"model.init_from={tmp_path / 'hf-moe'}", "parallel.data_parallel=fsdp")  # fmt: skip
    run_layout(tmp_path, 3, "moe-init", *from_hf, steps=0, init=str(tmp_path / "hf-moe"))
    # Expert parallel 2 x FSDP 2: each rank reads its one expert of its EP half (2 of 4) of every layer.
    run_layout(tmp_path, 4, "moe-init-ep", *from_hf, "parallel.expert_parallel_size=2", steps=0,
               init=str(tmp_path / "hf-moe"))  # fmt: skip
    saved = load_file(tmp_path / "hf-moe" / "model.safetensors")
    for layer, run in itertools.product(range(2), ("moe-init", "moe-init-ep")):
        loaded = torch.load(tmp_path / "out" / f"init-{run}.pt")["model"]
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = torch.stack([torch.cat([saved[f"{prefix}.{e}.gate_proj.weight"], saved[f"{prefix}.{e}.up_proj.weight"]])
                               for e in range(4)])  # fmt: skip
        down = torch.stack([saved[f"{prefix}.{e}.down_proj.weight"] for e in range(4)])
        assert torch.equal(loaded[f"{prefix}.gate_up_proj"], gate_up) and torch.equal(
            loaded[f"{prefix}.down_proj"], down
        ), run
        others = {n: t for n, t in saved.items() if ".experts." not in n}
        assert all(torch.equal(loaded[n], t) for n, t in others.items()) and len(loaded) == len(others) + 4


def _same_grads(tmp: Path, a: str, b: str) -> None:
    """Every parameter's gradient of layout ``a`` equal to ``b``'s within 2e-5 of its largest entry."""
    ga, gb = (torch.load(tmp / "out" / f"grads-{n}.pt") for n in (a, b))
    assert ga.keys() == gb.keys()
    for name in ga:
        scale = float(ga[name].abs().max().clamp(min=1e-6))
        assert torch.allclose(ga[name], gb[name], rtol=0, atol=LOSS_RTOL * scale), (a, b, name)
    assert all(float(g.abs().max()) > 0 for g in ga.values())  # every parameter learns


def test_expert_parallel_follows_one_process(moe_one, tmp_path) -> None:
    """The tiny Qwen3-MoE (8 experts, 2 a token, the aux loss in the gradients) with its experts spread over 2
    ranks: EP 2 on 2 workers, EP 2 x FSDP 2 on 4 (each expert also sharded over its 2 holders), EP 2 with TP 2
    attention on 4, TP 2 without EP on 2 (the experts replicated over the TP group), and EP 2 under torch.compile
    (fullgraph, as on Neuron: every part of a block but the experts, whose FSDP hooks would break the graph). The
    first step's gradients (every parameter, gathered) and 3 steps of losses equal one
    process's within 2e-5. The capacity dispatch at factor 1.0 (assignments dropped): EP 2 equals FSDP 2 without EP
    (the same per-rank slots; that capacity with room for every assignment is the dropless result is unit-tested)."""
    tmp, one = moe_one
    moe = (*MOE, "parallel.data_parallel=fsdp")
    for name, world, extra in (
        ("ep2", 2, ("parallel.expert_parallel_size=2",)),
        ("ep2-fsdp2", 4, ("parallel.expert_parallel_size=2",)),
        ("ep2-tp2", 4, ("parallel.expert_parallel_size=2", "parallel.tensor_parallel_size=2")),
        ("tp2", 2, ("parallel.tensor_parallel_size=2",)),  # TP attention, the experts whole on both ranks
        ("ep2-compiled", 2, ("parallel.expert_parallel_size=2", "run.compile=true")),  # the block's parts compiled
    ):
        run = run_layout(tmp, world, name, *moe, *extra, steps=3, grads=True, compiled="run.compile=true" in extra)
        assert losses(run) == pytest.approx(losses(one), rel=LOSS_RTOL), name
        _same_grads(tmp, "moe-one", name)
    assert losses(one)[2] < losses(one)[0]  # it trains
    tight = ("model.moe_capacity_factor=1.0",)
    fsdp = run_layout(tmp_path, 2, "cap-fsdp2", *moe, *tight, steps=2, grads=True)
    ep = run_layout(tmp_path, 2, "cap-ep2", *moe, *tight, "parallel.expert_parallel_size=2", steps=2, grads=True)
    assert losses(ep) == pytest.approx(losses(fsdp), rel=LOSS_RTOL)
    _same_grads(tmp_path, "cap-fsdp2", "cap-ep2")
    assert ep["dropped"] == pytest.approx(fsdp["dropped"]) and min(ep["dropped"].values()) > 0


def test_expert_parallel_checkpoints_reshard_ep2_ep1_ep4(tmp_path) -> None:
    """A checkpoint written with the experts spread over 2 ranks loads bit-equal (weights, AdamW moments, schedule)
    into one process (EP 1), whose checkpoint loads bit-equal into EP 4 on 4 workers; training goes on from each.
    The memory tier's snapshot of the EP 2 state restores bit-equal into one process too."""
    moe = (*MOE, "parallel.data_parallel=fsdp")
    out = tmp_path / "out"
    run_layout(tmp_path, 2, "ep2", *moe, "parallel.expert_parallel_size=2", steps=2, save=str(tmp_path / "ck2"),
               snapshot=str(tmp_path / "mem2"))  # fmt: skip
    run_layout(tmp_path, 1, "ep1", *moe, steps=3, start=2, load=str(tmp_path / "ck2"), save=str(tmp_path / "ck3"))
    run_layout(tmp_path, 1, "ep1-mem", *moe, steps=2, start=2, load_snapshot=str(tmp_path / "mem2"))
    last = run_layout(tmp_path, 4, "ep4", *moe, "parallel.expert_parallel_size=4", steps=4, start=3,
                      load=str(tmp_path / "ck3"))  # fmt: skip
    for saved, loaded in (("ep2", "ep1"), ("ep1", "ep4"), ("ep2", "ep1-mem")):
        state = _same_state(out, saved, loaded)
        assert any(".experts." in n for n in state["model"])
    assert len(losses(last)) == 1


def test_masked_loss_is_the_mean_over_the_global_batch_at_any_layout(tmp_path) -> None:
    """Instruction data: the loss is the mean over the trained tokens of the whole global batch, whatever the ranks
    hold (their masks differ in size): 2 ddp and 4 (dp2 x tp2) workers follow one process."""
    one = run_layout(tmp_path, 1, "masked1", masked=True)
    ddp = run_layout(tmp_path, 2, "masked-ddp", "parallel.data_parallel=ddp", masked=True)
    tp = run_layout(tmp_path, 4, "masked-tp", "parallel.data_parallel=fsdp", "parallel.tensor_parallel_size=2",
                    "model.tie_word_embeddings=false", masked=True)  # fmt: skip
    assert losses(ddp) == pytest.approx(losses(one), rel=LOSS_RTOL)
    assert losses(tp) == pytest.approx(losses(one), rel=LOSS_RTOL)
    assert ddp["trained"] == one["trained"] == tp["trained"]  # the global count, on every layout
    assert 0 < one["trained"]["1"] < GLOBAL_ROWS * SEQ


def _validation_set(path: Path) -> Path:
    """A prepared-like dataset of 30 rows of SEQ + 1 token ids (one shard), as `raytrn data prepare` writes it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrn.data.manifest import MANIFEST_NAME, Manifest, ShardInfo, SourceInfo, TokenizerInfo

    path.mkdir()
    rows = torch.randint(0, 512, (30, SEQ + 1), generator=torch.Generator().manual_seed(11)).int().numpy()
    offsets = pa.array(list(range(0, rows.size + 1, SEQ + 1)), pa.int32())
    pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))}),
                   path / "shard-00000.parquet")  # fmt: skip
    (path / "tokenizer.json").write_text("{}")
    manifest = Manifest(
        seq_len=SEQ, row_len=SEQ + 1, num_rows=30, num_tokens=rows.size, dropped_tail_tokens=0, rows_per_shard=30,
        shards=[ShardInfo(path="shard-00000.parquet", rows=30, tokens=rows.size,
                          bytes=(path / "shard-00000.parquet").stat().st_size)],
        tokenizer=TokenizerInfo(file="tokenizer.json", sha256=hashlib.sha256(b"{}").hexdigest(), vocab_size=512,
                                eos_token="e", eos_id=0, trained=True),
        source=SourceInfo(inputs=[], num_files=1, num_documents=1, fingerprint="f"), created_by="test",
    )  # fmt: skip
    (path / MANIFEST_NAME).write_text(manifest.to_json())
    return path


def test_validation_loss_is_the_same_at_any_world_size(tmp_path) -> None:
    """The same rows (the first eval_batches global batches, in manifest order) and the same mean at 1, 2 and 3
    workers: evaluation compares runs of any size."""
    val = str(_validation_set(tmp_path / "val"))
    sizes = {n: run_layout(tmp_path, n, f"eval{n}", "run.eval_batches=2", steps=0, eval=val) for n in (1, 2, 3)}
    ref = sizes[1]["val"]
    assert 0 < ref["val_loss"] < 10 and ref["val_perplexity"] == pytest.approx(math.exp(ref["val_loss"]))
    for n in (2, 3):
        assert sizes[n]["val"]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6), n


# -- raytrn estimate's memory against what workers hold (issue 31's check) -------------------------------------

#: Two model sizes (the unit test's one-process check uses the same), 4 rows of 128 tokens a worker.
ESTIMATE_SIZES = {
    "small": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 4096},
    "larger": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 6, "num_attention_heads": 8,
               "num_key_value_heads": 4, "vocab_size": 8192},
}  # fmt: skip
ESTIMATE_LAYOUTS = {
    "ddp": ("parallel.data_parallel=ddp",),
    "fsdp2": ("parallel.data_parallel=fsdp",),
    "tp2": ("parallel.data_parallel=fsdp", "parallel.tensor_parallel_size=2"),
    "lora-ddp": ("parallel.data_parallel=ddp", "model.lora={rank: 8}"),
}


def _probe_rank(rank: int, world: int, port: int, plan: dict[str, Any], out: str) -> None:
    """Every (size, layout) of ``plan`` in turn on the same gloo group: two steps of raytrn's build and step, the
    memory probe of the run (:mod:`raytrn.train.memory_probe`) at the second, beside the estimate's figure."""
    import torch.distributed as dist

    from raytrn.estimate.memory import estimate_memory
    from raytrn.train.build import build_training
    from raytrn.train.memory_probe import MemoryProbe
    from raytrn.train.step import train_step

    _enter(rank, world, port, plan)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    record = {}
    for name, overrides in plan["runs"].items():
        job = load_job(REPO / "jobs" / "tiny.yaml", overrides, resolve=False)
        t = build_training(job, CpuBackend(), world_size=world, rank=rank)
        probe = MemoryProbe(job, CpuBackend(), start_step=0)
        gen = torch.Generator().manual_seed(rank)
        for step in (1, 2):
            rows = torch.randint(0, job.model.vocab_size, (job.data.micro_batch_size, job.data.seq_len + 1),
                                 generator=gen)  # fmt: skip
            with probe.stepping(step):
                train_step(t, iter([rows]), CpuBackend())
            probe.measure(step, t.model, t.optimizer, t.grad_accum)
        assert probe.result is not None
        record[name] = {"measured": probe.result.bytes, "estimated": estimate_memory(job, world).probed}
        del t
    if rank == 0:
        Path(out, "probe.json").write_text(json.dumps(record))
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_the_memory_estimate_is_within_15_percent_of_what_2_workers_hold(tmp_path) -> None:
    """``raytrn estimate``'s memory a worker (the state and the tensors saved for backward) within 15% of what the
    run's memory probe measures on 2 gloo workers, for DDP, FSDP 2, TP 2 and LoRA (DDP) at two model sizes."""
    from transformers import LlamaConfig

    runs = {}
    for size, dims in ESTIMATE_SIZES.items():
        hf = tmp_path / size
        LlamaConfig(**dims, max_position_embeddings=512, tie_word_embeddings=False).save_pretrained(hf)
        for layout, overrides in ESTIMATE_LAYOUTS.items():
            runs[f"{size}-{layout}"] = [
                "data.manifest=unused", "data.seq_len=128", "data.micro_batch_size=4", "data.grad_accum=1",
                "scaling.min_workers=2", "scaling.max_workers=2", f"checkpoint.storage={tmp_path / 'ckpt'}",
                "model.preset=null", *(f"model.{k}=null" for k in ("hidden_size", "intermediate_size", "num_layers",
                "num_attention_heads", "num_key_value_heads", "vocab_size")), f"model.init_from={hf}",
                "model.tie_word_embeddings=false", *overrides,
            ]  # fmt: skip
    start_processes(_probe_rank, 2, {"runs": runs}, str(tmp_path))
    record = json.loads((tmp_path / "probe.json").read_text())
    print({name: round(r["measured"] / r["estimated"] - 1, 4) for name, r in record.items()})  # the errors, -s
    assert set(record) == set(runs)
    for name, r in record.items():
        assert r["measured"] == pytest.approx(r["estimated"], rel=0.15), name
