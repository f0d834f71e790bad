"""Sharded checkpoints refused before training, the older state.pt format, async saves; one process, no Ray."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from raytrn.backends.cpu import CpuBackend
from raytrn.checkpoint import dcp, manifest, plain
from raytrn.checkpoint.progress import Progress
from raytrn.checkpoint.rundir import RunDir
from raytrn.checkpoint.sharded import DcpCheckpoints
from raytrn.config import load_job
from raytrn.errors import CheckpointError, RaytrnError
from raytrn.one_process import no_dist
from raytrn.train.build import build_training
from raytrn.train.schedule import Schedule
from raytrn.train.step import train_step

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def job(tmp: Path, *overrides: str) -> Any:
    return load_job(
        REPO / "jobs" / "tiny.yaml",
        ["data.manifest=unused", "data.seq_len=16", "model.vocab_size=512", "scaling.min_workers=1",
         "scaling.max_workers=1", f"checkpoint.storage={tmp}", "tracking.run_name=r", *overrides],
        resolve=False,
    )  # fmt: skip


def trained(j: Any, steps: int = 2) -> Any:
    t = build_training(j, CpuBackend(), world_size=1)
    rows = torch.randint(0, 512, (steps * 16, 17), generator=torch.Generator().manual_seed(0))
    batches = iter(rows.split(16))
    for _ in range(steps):
        train_step(t, batches, CpuBackend())
    return t


def saved(tmp: Path, *overrides: str) -> tuple[Any, str]:
    j = job(tmp, *overrides)
    t = trained(j)
    location = RunDir.of(j).dcp_step(2)
    dcp.save(dcp.training_state(t.model, t.optimizer, t.scheduler), location)
    return j, location


@pytest.mark.parametrize(
    "family", [("llama", "tiny"), ("qwen3", "tiny-qwen3"), ("qwen3_moe", "tiny-qwen3-moe")], ids=lambda f: f[0]
)
def test_a_resumed_training_equals_the_uninterrupted_one(tmp_path: Path, family: tuple[str, str]) -> None:
    """4 steps in one go, and 2 steps + a sharded checkpoint + a fresh process's model, optimizer and schedule
    loaded from it + 2 more steps: bit-identical weights (Qwen3's per-head norms, Qwen3-MoE's router and stacked
    experts included) and optimizer moments."""
    j = job(tmp_path, f"model.family={family[0]}", f"model.preset={family[1]}")
    rows = torch.randint(0, 512, (4 * 16, 17), generator=torch.Generator().manual_seed(0)).split(16)
    whole = build_training(j, CpuBackend(), world_size=1)
    for batch in rows:
        train_step(whole, iter([batch]), CpuBackend())
    first = build_training(j, CpuBackend(), world_size=1)
    for batch in rows[:2]:
        train_step(first, iter([batch]), CpuBackend())
    location = RunDir.of(j).dcp_step(2)
    dcp.save(dcp.training_state(first.model, first.optimizer, first.scheduler), location)
    resumed = build_training(j, CpuBackend(), world_size=1)
    dcp.load(location, resumed.model, resumed.optimizer, resumed.scheduler, source="test")
    for batch in rows[2:]:
        train_step(resumed, iter([batch]), CpuBackend())
    names = [n for n, _ in whole.model.named_parameters()]
    assert (family[0] != "llama") == any(n.endswith("self_attn.q_norm.weight") for n in names)
    assert (family[0] == "qwen3_moe") == any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(whole.optimizer.state.values(), resumed.optimizer.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_missing_shard_is_refused_before_anything_loads(tmp_path: Path) -> None:
    j, location = saved(tmp_path)
    (Path(location) / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError) as e:
        dcp.check_resumable(j, location)
    assert f"checkpoint {location} is incomplete (missing __0_0.distcp of 1 shard file(s))" in str(e.value)
    assert "resume from an earlier checkpoint" in str(e.value)


def test_truncated_shard_and_missing_metadata_are_refused(tmp_path: Path) -> None:
    j, location = saved(tmp_path)
    shard = Path(location) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated __0_0.distcp"):
        dcp.check_resumable(j, location)
    (Path(location) / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"no readable \.metadata .* the save that made this checkpoint did not"):
        dcp.check_resumable(j, location)


def test_another_model_names_the_first_mismatching_tensor(tmp_path: Path) -> None:
    _, location = saved(tmp_path)
    wider = job(tmp_path, "model.intermediate_size=256")
    with pytest.raises(CheckpointError) as e:
        dcp.check_resumable(wider, location)
    assert (
        "tensor 'model.layers.0.mlp.gate_proj.weight' has shape (384, 128) but the job's model has (256, 128)"
        in str(e.value)
    )
    t = build_training(wider, CpuBackend(), world_size=1)  # the workers refuse it the same way
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.gate_proj.weight"):
        dcp.load(location, t.model, t.optimizer, t.scheduler, source=wider.source)
    deeper = job(tmp_path, "model.num_layers=3")
    with pytest.raises(CheckpointError, match="has no tensor 'model.layers.2.self_attn.q_proj.weight'"):
        dcp.check_resumable(deeper, location)


def test_older_state_pt_resumes_into_ddp_and_is_refused_by_fsdp_with_how_to_convert(tmp_path: Path) -> None:
    from raytrn.checkpoint.statefile import save_state

    j = job(tmp_path)
    t = trained(j)
    old = tmp_path / "checkpoint_00000002"
    progress = Progress(step=2, tokens_seen=64)
    save_state(str(old), model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, progress=progress)
    fresh = build_training(j, CpuBackend(), world_size=1)
    assert fresh.checkpoints.load(str(old), fresh) == progress
    assert all(
        torch.equal(a, b) for a, b in zip(t.model.state_dict().values(), fresh.model.state_dict().values(), strict=True)
    )
    sharded = DcpCheckpoints(j, rank=0, plain_layout=False)  # what an fsdp / TP worker has
    with pytest.raises(CheckpointError) as e:
        sharded.load(str(old), fresh)
    assert "single-file state.pt of an older raytrn" in str(e.value)
    assert "parallel.data_parallel: ddp and parallel.tensor_parallel_size: 1" in str(e.value)


def test_async_checkpoint_is_recorded_once_written(tmp_path: Path) -> None:
    """checkpoint.async: a save returns the previous checkpoint (now complete); the final save is synchronous."""
    j = job(tmp_path, "checkpoint.async=true", "checkpoint.keep_last=null")
    t = trained(j, steps=1)
    sched = Schedule.from_job(j)
    assert t.checkpoints.save(t, Progress(step=1), sched, {}, final=False) == []
    [first] = t.checkpoints.save(t, Progress(step=2), sched, {}, final=False)
    assert first.step == 1 and (Path(RunDir.of(j).dcp_step(1)) / ".metadata").is_file()
    done = t.checkpoints.save(t, Progress(step=3), sched, {}, final=True)
    assert [r.step for r in done] == [2, 3]
    assert RunDir.of(j).dcp_steps() == [1, 2, 3]
    assert all(manifest.is_committed(RunDir.of(j).dcp_step(s)) for s in (1, 2, 3))


def test_an_async_checkpoint_holds_its_steps_state_while_the_next_step_trains_beside_its_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint.async copies the state to host memory beside the next step: its forward and backward run while the
    copy is in flight (here a copy ends only once the training thread waits for it: in flight however slow the
    machine), its optimizer step waits for the copy (the checkpoint holds step 1's weights and moments, not step
    2's), and a restore into the same tensors waits for it too."""
    from torch.distributed.checkpoint.staging import DefaultStager

    from raytrn.checkpoint.staging import Staging

    copying: list[float] = []
    released = threading.Event()
    stage, wait = DefaultStager._stage, Staging.wait

    def stage_once_waited_for(self: Any, state: Any, **kwargs: Any) -> Any:
        copying.append(time.perf_counter())
        assert released.wait(60), "nothing waited for the copy"
        return stage(self, state, **kwargs)

    def wait_and_release(self: Staging) -> None:
        if self._copy is not None:  # a copy in flight: it ends 0.1 s after the wait began
            threading.Timer(0.1, released.set).start()
        wait(self)

    monkeypatch.setattr(DefaultStager, "_stage", stage_once_waited_for)
    monkeypatch.setattr(Staging, "wait", wait_and_release)
    j = job(tmp_path, "checkpoint.async=true", "checkpoint.keep_last=null")
    t = trained(j, steps=1)
    at_step_1 = {k: v.clone() for k, v in dcp.training_state(t.model, t.optimizer, t.scheduler)["optim"]["state"]
                 ["model.embed_tokens.weight"].items() if isinstance(v, torch.Tensor)}  # fmt: skip
    weights_1 = {k: v.clone() for k, v in t.model.state_dict().items()}
    sched = Schedule.from_job(j)
    assert t.checkpoints.save(t, Progress(step=1), sched, {}, final=False) == []
    staging = t.checkpoints.staging
    assert staging is not None and staging.waits == 0 and not released.is_set()  # the save did not wait for its copy
    rows = torch.randint(0, 512, (16, 17), generator=torch.Generator().manual_seed(1))
    train_step(t, iter(rows.split(16)), CpuBackend())  # step 2: its optimizer step waited for the copy
    assert staging.waits == 1 and staging.waited_s >= 0.09, vars(staging)
    assert not torch.equal(t.model.state_dict()["model.embed_tokens.weight"], weights_1["model.embed_tokens.weight"])
    done = t.checkpoints.save(t, Progress(step=2), sched, {}, final=True)
    assert [r.step for r in done] == [1, 2] and t.checkpoints.staging is None  # the last save closed it
    fresh = build_training(j, CpuBackend(), world_size=1)
    dcp.load(RunDir.of(j).dcp_step(1), fresh.model, fresh.optimizer, fresh.scheduler, source=j.source)
    for name, value in fresh.model.state_dict().items():
        torch.testing.assert_close(value, weights_1[name], rtol=0, atol=0, msg=name)
    moments = dcp.training_state(fresh.model, fresh.optimizer, fresh.scheduler)["optim"]["state"]
    for key, value in at_step_1.items():
        torch.testing.assert_close(moments["model.embed_tokens.weight"][key], value, rtol=0, atol=0)
    # a restore while a copy is in flight waits for it (it writes into the tensors being copied)
    released.clear()
    t.checkpoints.save(t, Progress(step=3), sched, {}, final=False)
    t.checkpoints.load_committed(
        manifest.Candidate(RunDir.of(j).dcp_step(2), manifest.read_commit(RunDir.of(j).dcp_step(2))), t
    )
    assert t.checkpoints.staging is not None and t.checkpoints.staging.waits == 1  # a new stager: its first wait
    assert len(copying) == 2


def test_where_dcps_stager_cannot_be_made_the_async_save_copies_at_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """DCP's stager makes a ``torch.Stream`` on any accelerator torch reports: where it cannot, checkpoint.async
    copies at each save as before (one warning), and its checkpoints commit."""
    from torch.distributed.checkpoint.staging import DefaultStager

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("streams are not supported on this device")

    monkeypatch.setattr(DefaultStager, "__init__", refuse)
    j = job(tmp_path, "checkpoint.async=true", "checkpoint.keep_last=null")
    t = trained(j, steps=1)
    sched = Schedule.from_job(j)
    assert t.checkpoints.save(t, Progress(step=1), sched, {}, final=False) == []
    assert [r.step for r in t.checkpoints.save(t, Progress(step=2), sched, {}, final=False)] == [1]
    assert [r.step for r in t.checkpoints.save(t, Progress(step=3), sched, {}, final=True)] == [2, 3]
    assert t.checkpoints.staging is None
    assert caplog.text.count("copied to host memory at each save") == 1, caplog.text


def test_remote_deletes_stay_inside_their_root() -> None:
    from raytrn.storage import remove_tree

    for uri in ("s3://bucket/run/other/step_00000001", "s3://bucket/run/dcp/../x", "s3://bucket/run/dcp"):
        with pytest.raises(RaytrnError, match="not strictly inside"):
            remove_tree(uri, "s3://bucket/run/dcp")


def test_async_final_save_reports_the_pending_checkpoint_and_its_own(tmp_path: Path) -> None:
    """The last save returns the pending checkpoint and its own, both committed; keep_last keeps the newest."""
    j = job(tmp_path, "checkpoint.async=true", "checkpoint.keep_last=1")
    t = trained(j, steps=1)
    sched = Schedule.from_job(j)
    t.checkpoints.save(t, Progress(step=1), sched, {}, final=False)
    t.checkpoints.save(t, Progress(step=2), sched, {}, final=False)
    done = t.checkpoints.save(t, Progress(step=3), sched, {}, final=True)
    assert [r.step for r in done] == [2, 3]
    assert RunDir.of(j).dcp_steps() == [3]


class _RunsCode:
    """A pickle that runs code when loaded (what weights_only=False would execute)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path(self.marker).touch, ())


def test_a_state_pt_holding_more_than_tensors_is_refused_without_running_it(tmp_path: Path) -> None:
    from raytrn.checkpoint.statefile import STATE_FILE, load_state

    j = job(tmp_path)
    t = build_training(j, CpuBackend(), world_size=1)
    ckpt = tmp_path / "checkpoint_00000002"
    ckpt.mkdir()
    marker = tmp_path / "code-ran"
    torch.save({"model": _RunsCode(str(marker))}, ckpt / STATE_FILE)
    with pytest.raises(CheckpointError, match=r"state\.pt: refusing to load it: it holds objects other than tensors"):
        load_state(str(ckpt), model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)
    assert not marker.exists()


def test_a_pointer_names_a_sharded_checkpoint_only_inside_its_own_run(tmp_path: Path) -> None:
    """meta.json's ``dcp`` is read as a step of this run: a moved run resumes from its own files, a pointer edited
    to name another directory reads nothing outside the run, one naming no step is refused."""
    run = RunDir(str(tmp_path / "ckpts"), "r1")
    assert run.own_dcp(run.dcp_step(4)) == run.dcp_step(4)
    assert run.own_dcp("/old/place/r1/dcp/step_00000004") == run.dcp_step(4)
    assert run.own_dcp("s3://elsewhere/x/step_00000004/") == run.dcp_step(4)
    for bad in ("/etc", "/tmp/evil", "s3://bucket/run/dcp/step_4", ""):
        with pytest.raises(CheckpointError, match="not a step of a raytrn run"):
            run.own_dcp(bad)


def _save_alone_in_a_group(rank: int, world: int, port: int, tmp: str) -> None:
    import warnings

    from tests.unit.gloo_ranks import rank_records

    with rank_records(rank, world, port, tmp) as out, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = torch.nn.Linear(4, 4)
        dcp.save_state({"model": model.state_dict()}, dcp.storage_writer(f"{tmp}/alone"), alone=True)
        back = {"model": torch.nn.Linear(4, 4).state_dict()}  # and read back alone (the evaluator's export)
        plain.load(back, dcp.storage_reader(f"{tmp}/alone"), no_dist=no_dist(alone=True))
        out["equal"] = all(torch.equal(v, back["model"][k]) for k, v in model.state_dict().items())
        out["warnings"] = [str(w.message) for w in caught]


def test_a_state_written_alone_in_a_process_group_says_nothing_of_it(tmp_path: Path) -> None:
    """The live rank 0 writes its whole replica alone (the memory tier), and the evaluator reads a checkpoint alone,
    while a process group exists: DCP's warning that it assumes one process (what raytrn asked for) stays off the
    run's terminal, as with no group at all."""
    from tests.unit.gloo_ranks import spawn_records

    [record] = spawn_records(_save_alone_in_a_group, 1, tmp_path, deadline_s=120)
    assert record["equal"] and not [w for w in record["warnings"] if "torch.distributed is disabled" in w], record
    assert (tmp_path / "alone" / ".metadata").exists()
