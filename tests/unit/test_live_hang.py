"""A live replica hung outside a collective (raytrn.train.watchdog.live_hang_watch) on real gloo processes, no Ray.

Three replicas a, b, c of the tiny Llama train 6 steps, each with the hang watch the live loop runs. At step 3, c's
main thread is stuck in a call that never returns (a sleep: the GIL released, as a stuck device or filesystem call
leaves it), so its heartbeat thread beats on and it is not "lost" by its silence. a and b wait for it at the step's
start for ``scaling.peer_timeout_s``, re-form without it and train step 3 and the rest, as one process does (losses
and final weights within 1e-4); their own watches do not fire (the re-formation's wait is inside their bound). c's
watch fires: every thread's stack in ``<run>/hangs/step_00000002/rank_2.txt``, and the process exits with the hang
status (75), so that Ray Train can replace it (under Ray its replacement joins live, as after a kill:
``tests/chaos/test_live_recovery.py``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from raytrn.config import JobSpec, load_job
from tests.unit.gloo_ranks import process
from tests.unit.test_live_group import REPO, SEQ, build, micro_batch, one_process_step, records

pytestmark = pytest.mark.unit

MICRO, STEPS, HANG_AT = 6, 6, 3
PEER_TIMEOUT_S, DEAD_S, HANG_S = 2.0, 1.0, 3.0  # the watch's bound: 3 + 2 x 2 = 7 s
DEADLINE_S = 180
TOLERANCE = 1e-4


def job(root: str) -> JobSpec:
    return load_job(
        REPO / "jobs" / "tiny.yaml",
        ["data.manifest=unused", f"data.seq_len={SEQ}", "model.vocab_size=256", "optim.warmup_steps=2",
         f"run.hang_timeout_s={HANG_S}", f"scaling.peer_timeout_s={PEER_TIMEOUT_S}", f"checkpoint.storage={root}",
         "tracking.run_name=hang"],
        resolve=False,
    )  # fmt: skip


def micro_loss(model: torch.nn.Module, step: int, stuck: bool = False) -> Any:
    from raytrn.train.loss import cross_entropy

    def loss(k: int) -> torch.Tensor:
        if stuck:
            time.sleep(600)  # never returns within the test: the hang watch ends the process first
        rows = micro_batch(step, k)
        return cross_entropy(model(input_ids=rows[:, :-1]).logits, rows[:, 1:])

    return loss


def _member(name: str, port: int, out: str) -> None:
    from raytrn.train.live.group import LiveGroup
    from raytrn.train.live.step import LiveTrainer
    from raytrn.train.watchdog import live_hang_watch

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=DEADLINE_S))
    j = job(str(Path(out) / "runs"))
    group = LiveGroup(store, name, timeout_s=j.scaling.peer_timeout_s, dead_after_s=DEAD_S)
    model, optimizer, scheduler = build(j)
    trainer = LiveTrainer(group, model, optimizer, scheduler, grad_clip_norm=j.optim.grad_clip_norm)
    group.found(["a", "b", "c"])
    hangs = live_hang_watch(j, group.rank, None)
    for step in range(1, STEPS + 1):
        result = trainer.step(step, MICRO, micro_loss(model, step, stuck=(name, step) == ("c", HANG_AT)))
        record = {"step": step, "loss": result.loss, "micro": [result.micro_batches.start, result.micro_batches.stop],
                  "replicas": result.replicas, "lost": [list(r.lost) for r in result.reformed]}  # fmt: skip
        with (Path(out) / f"{name}.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        hangs.step_done(step)
    hangs.close()
    torch.save(model.state_dict(), Path(out) / f"final-{name}.pt")
    if group.rank == 0:
        group.finish()
    group.leave()
    os._exit(0)


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int | None]]:
    out = tmp_path_factory.mktemp("live-hang")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=DEADLINE_S))
    procs = {n: process(_member, n, store.port, str(out)) for n in "abc"}
    try:
        for p in procs.values():
            p.start()
        for n in "ab":
            procs[n].join(DEADLINE_S)
        procs["c"].join(60)  # its watch's bound is 7 s (polled every 1.75 s) from its step 2
    finally:
        for p in procs.values():  # ours, by handle: a member that did not end (a failure)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
                p.join(10)
    return out, {n: p.exitcode for n, p in procs.items()}


def test_the_others_drop_a_hung_replica_and_train_as_one_process_does(
    hung: tuple[Path, dict[str, int | None]],
) -> None:
    out, codes = hung
    assert codes["a"] == 0 and codes["b"] == 0, codes  # their watches did not fire across the re-formation
    j = job(str(out / "reference"))
    model, optimizer, scheduler = build(j)
    logs = {n: records(out, n) for n in "abc"}
    assert set(logs["a"]) == set(logs["b"]) == set(range(1, STEPS + 1)) and set(logs["c"]) == {1, 2}, logs
    for step in range(1, STEPS + 1):
        total = one_process_step(j, model, optimizer, scheduler, micro_loss(model, step), MICRO)
        committed = {n: log[step] for n, log in logs.items() if step in log}
        assert sorted(k for r in committed.values() for k in range(*r["micro"])) == list(range(MICRO)), committed
        for n, r in committed.items():
            assert r["loss"] == pytest.approx(total / MICRO, abs=TOLERANCE), (step, n)
            assert r["replicas"] == (3 if step < HANG_AT else 2), (step, n, r)
    for n in "ab":  # c dropped at step 3's start (its heartbeat beating), that step trained by the two others
        assert logs[n][HANG_AT]["lost"] == [["c"]], logs[n][HANG_AT]
    final = torch.load(out / "final-a.pt", weights_only=True)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(final[key], value, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda m, n=key: f"{n}: {m}")


def test_the_hung_replica_dumps_its_stacks_and_exits_for_its_replacement(
    hung: tuple[Path, dict[str, int | None]],
) -> None:
    from raytrn.train.watchdog import HANG_EXIT

    out, codes = hung
    assert codes["c"] == HANG_EXIT, codes
    dumps = sorted((out / "runs").glob("**/hangs/step_*/rank_*.txt"))
    assert [(d.parent.name, d.name) for d in dumps] == [("step_00000002", "rank_2.txt")], dumps
    text = dumps[0].read_text()
    # faulthandler's dump of every thread: the stuck call's frame, and the heartbeat thread that kept beating
    assert "most recent call first" in text and "test_live_hang.py" in text and "group.py" in text, text[:3000]
