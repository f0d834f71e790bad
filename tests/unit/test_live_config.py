"""``scaling.recovery: live``: what ``raytrn validate`` refuses and says of it, and what the driver sets up for it
(the Ray Train backend with replica groups, no in-memory snapshot keeper, the controller's failure line). No Ray
cluster: the backend's store and the workers run in tests/chaos/test_live_recovery.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrn.config import JobSpec, load_job
from raytrn.errors import ConfigError
from raytrn.train.checks import check_spec

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LIVE = ("scaling.recovery=live", "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=1")


def job(tmp: Path, *overrides: str, workers: int = 3) -> JobSpec:
    return load_job(
        REPO / "jobs" / "tiny.yaml",
        ["data.manifest=unused", "data.grad_accum=null", "data.global_batch_size=48", "data.micro_batch_size=8",
         f"scaling.min_workers={workers}", f"scaling.max_workers={workers}", f"checkpoint.storage={tmp}", *overrides],
        resolve=False,
    )  # fmt: skip


def test_a_live_job_validates_and_says_what_its_loop_runs(tmp_path: Path) -> None:
    lines = check_spec(job(tmp_path, *LIVE))
    assert any("scaling.recovery: live" in line and "runs the hang watchdog" in line
               and "its rank 0 alone takes the in-memory snapshots" in line
               and "preemption notice leaves at a step boundary" in line
               and "rollback loads the checkpoint into the live replicas in place" in line for line in lines), lines  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("scaling.recovery=live",), "scaling.recovery: live needs whole model replicas of one worker each"),
        (("scaling.recovery=live", "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=3"),
         "(now data_parallel: hsdp, shard groups of 3)"),
        (("scaling.recovery=live", "parallel.data_parallel=fsdp"), "(now data_parallel: fsdp)"),
        ((*LIVE, "parallel.tensor_parallel_size=3", "model.preset=tiny"), None),
        ((*LIVE, "scaling.max_workers=6"), "scaling.recovery: live trains at one size (min_workers 3, max_workers 6)"),
        ((*LIVE, "scaling.accelerator=cuda"), "scaling.recovery: live runs on accelerator cpu"),
        ((*LIVE, "scaling.accelerator=xla-cpu"), "scaling.recovery: live runs on accelerator cpu"),
        ((*LIVE, "scaling.peer_timeout_s=0.5"), "peer_timeout_s"),
    ],
)  # fmt: skip
def test_what_live_recovery_cannot_train_is_refused_naming_the_fix(
    tmp_path: Path, overrides: tuple[str, ...], expected: str | None
) -> None:
    with pytest.raises(ConfigError) as e:
        check_spec(job(tmp_path, *overrides))
    message = str(e.value)
    assert (expected or "tensor_parallel_size") in message, message
    if "recovery: live" in message:
        assert "scaling.recovery: restart" in message  # the way back is named


def test_the_driver_asks_ray_train_for_replica_groups_and_a_snapshot_keeper_as_for_a_restart(tmp_path: Path) -> None:
    from raytrn.backends import get_backend
    from raytrn.backends.live_ray import LiveGroupBackend, LiveGroupConfig
    from raytrn.backends.ray_backend import ProcessGroupConfig
    from raytrn.train.trainer import memory_tier_may_run

    live, restart = job(tmp_path, *LIVE, "scaling.peer_timeout_s=7"), job(tmp_path)
    backend = get_backend("cpu")
    config = backend.ray_backend_config(live)
    assert isinstance(config, LiveGroupConfig) and config.timeout_s == 7 and config.backend == "gloo"
    assert config.backend_cls is LiveGroupBackend and LiveGroupBackend.has_replica_groups is True
    assert isinstance(backend.ray_backend_config(restart), ProcessGroupConfig)
    # a frozen replica is given up by Ray Train's health check after scaling.peer_timeout_s (the trainer passes it to
    # raytrn.compat.hosted_trainer); the restart path keeps Ray's 600 s
    assert config.worker_timeout_s == 7 and backend.ray_backend_config(restart).worker_timeout_s is None
    # the tier by the same rule as the restart path's (the live rank 0 snapshots for a restart after every replica was
    # lost: raytrn.train.live_snapshots): on by default on several nodes, off on one, as asked otherwise
    assert memory_tier_may_run(live, alive_nodes=3) and memory_tier_may_run(restart, alive_nodes=3)
    assert not memory_tier_may_run(live, alive_nodes=1)
    assert not memory_tier_may_run(job(tmp_path, *LIVE, "checkpoint.memory_every_n_steps=0"), alive_nodes=3)


def test_a_failure_under_live_recovery_ends_no_group_and_says_the_others_train_on() -> None:
    from raytrn.train.events import RunEvents

    said: list[str] = []
    live = RunEvents(10, live=True, out=said.append, alive_nodes=lambda: None)
    live.failure_decided(True, {}, RuntimeError("boom"), False)
    assert live.ends == [] and live.failures == 1
    assert "the other replicas train on; its replica is replaced when capacity allows (failure 1 of" in said[-1]
    restart = RunEvents(10, out=said.append, alive_nodes=lambda: None)
    restart.failure_decided(True, {}, RuntimeError("boom"), False)
    assert len(restart.ends) == 1 and "restarting the group from the newest state" in said[-1]
    # a replica that left on a notice, its node then taken away: Ray charges the preemption budget, and so says raytrn
    from ray.exceptions import RayActorError

    live.failure_decided(True, {1: RayActorError(preempted=True)}, RuntimeError("lost"), True)
    assert live.failures == 1 and live.ends == []
    assert "(its node preempted after its notice); the other replicas train on" in said[-1], said[-1]
    assert said[-1].endswith("(a preemption: not counted against scaling.max_failures)"), said[-1]


def test_a_moe_replica_trains_the_restart_paths_objective_and_logs_the_loss_alone(tmp_path: Path) -> None:
    """MicroLosses (the live loop's micro-batch loss) adds a MoE model's load-balancing loss to what it takes
    gradients of, as the restart path's train_step does: one replica accumulating every micro-batch lands on
    train_step's parameters; the reported loss is the language model's alone."""
    import torch

    from raytrn.backends import get_backend
    from raytrn.train.build import build_training
    from raytrn.train.live_loop import MicroLosses
    from raytrn.train.step import train_step

    spec = load_job(
        REPO / "jobs" / "tiny-moe.yaml",
        ["data.manifest=unused", "data.seq_len=16", "data.micro_batch_size=2", "data.grad_accum=3",
         "scaling.min_workers=1", "scaling.max_workers=1", f"checkpoint.storage={tmp_path}"],
        resolve=False,
    )  # fmt: skip
    backend = get_backend("cpu")
    generator = torch.Generator().manual_seed(0)
    micro = [torch.randint(0, spec.model.vocab_size, (2, 17), generator=generator) for _ in range(3)]
    torch.manual_seed(0)
    restart = build_training(spec, backend, world_size=1)
    torch.manual_seed(0)
    live = build_training(spec, backend, world_size=1)
    assert live.aux_loss_coef > 0
    reference = train_step(restart, iter(micro), backend)

    losses = MicroLosses(live, micro)
    logged = []
    for k in range(len(micro)):
        objective, loss = losses(k)
        assert float((objective - loss).detach()) > 0  # the load-balancing loss, weighted, is in the objective only
        (objective / len(micro)).backward()
        logged.append(float(loss))
    live.clip_and_step()
    assert sum(logged) / len(micro) == pytest.approx(float(reference.loss), abs=1e-6)
    for (name, a), b in zip(restart.model.named_parameters(), live.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
