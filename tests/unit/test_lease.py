"""One job per run (raytrn.checkpoint.lease): a second driver is refused naming the holder, a stale lease (by the
store's clock) is taken over only when asked and by one job only, a lease is renewed and released only by its
holder, and a holder whose lease was taken over learns it. Local files, and a real S3 endpoint (the moto server on
127.0.0.1) for the conditional puts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from raytrn.checkpoint import lease as leases
from raytrn.checkpoint.lease import LEASE_FILE, STALE_AFTER_S, LeaseError, LeaseLost, acquire
from raytrn.checkpoint.rundir import RunDir

pytestmark = pytest.mark.unit


def _write_holder(path: Path, age_s: float = 0.0, **changes: object) -> None:
    """A lease as another driver wrote it, last written ``age_s`` ago (the file's modification time: the store's
    clock, which is what staleness is judged by)."""
    now = time.time()
    holder = {"host": socket.gethostname(), "pid": 1, "started_at": now, "heartbeat_at": now, "token": "theirs"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**holder, **changes}))
    os.utime(path, (now - age_s, now - age_s))


def test_a_second_job_on_a_held_run_is_refused_naming_the_holder(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path), "r1")
    first = acquire(run, job="raytrn-r1-abc")
    try:
        with pytest.raises(LeaseError) as e:
            acquire(run)
        msg = str(e.value)
        assert f"run 'r1' under {tmp_path} is in use by another job (host {socket.gethostname()}" in msg
        assert "job raytrn-r1-abc" in msg and "another tracking.run_name" in msg
        assert acquire(RunDir(str(tmp_path), "r2")).release() is None  # another run: free
    finally:
        first.release()
    assert not (tmp_path / "r1").exists()  # the run directory it made for the lease, empty: gone again
    acquire(run).release()  # released: the next job takes it
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "checkpoint_00000002").mkdir()  # a run that wrote something keeps its directory
    acquire(run).release()
    assert (tmp_path / "r1" / "checkpoint_00000002").is_dir()


def test_a_stale_lease_is_taken_over_only_when_asked(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path), "r1")
    path = tmp_path / "r1" / LEASE_FILE
    # a driver on another machine, silent for longer than STALE_AFTER_S
    _write_holder(path, STALE_AFTER_S + 5, host="other-host", pid=4242)
    with pytest.raises(LeaseError, match=r"has a stale lease .* its holder is silent .*run again with --take-over"):
        acquire(run)
    _write_holder(path, 60, host="other-host", pid=4242)  # alive elsewhere: refused
    with pytest.raises(LeaseError, match="is in use by another job"):
        acquire(run, take_over=True)
    _write_holder(path, STALE_AFTER_S + 5, host="other-host", pid=4242)
    mine = acquire(run, take_over=True)
    assert json.loads(path.read_text())["token"] == mine.holder.token
    mine.release()
    assert not path.exists()


def test_the_lease_of_a_dead_driver_of_this_machine_is_replaced_at_once(tmp_path: Path) -> None:
    """A driver SIGKILLed here (its pid is gone): the next run of the job needs no --take-over."""
    path = tmp_path / "r1" / LEASE_FILE
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    _write_holder(path, pid=proc.pid, machine=leases.machine_id())
    mine = acquire(RunDir(str(tmp_path), "r1"))
    assert json.loads(path.read_text())["token"] == mine.holder.token
    mine.release()


def test_a_fresh_lease_is_never_gone_whatever_its_pid_looks_like_from_here(tmp_path: Path) -> None:
    """A host of the same name that is another machine (another container, another boot): its pid means nothing
    here; and no clock but the store's is compared (a holder whose own clock is hours off is still fresh)."""
    run = RunDir(str(tmp_path), "r1")
    path = tmp_path / "r1" / LEASE_FILE
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    for machine in ("", f"{socket.gethostname()}/another-boot/4026531836"):
        _write_holder(path, 5, pid=proc.pid, machine=machine, heartbeat_at=time.time() - 10 * STALE_AFTER_S)
        for take_over in (False, True):
            with pytest.raises(LeaseError, match="is in use by another job"):
                acquire(run, take_over=take_over)
    # its own clock says it beat just now, but the store saw no write for longer than STALE_AFTER_S: stale
    _write_holder(path, STALE_AFTER_S + 5, host="other-host", heartbeat_at=time.time() + 3600)
    with pytest.raises(LeaseError, match="has a stale lease"):
        acquire(run)
    acquire(run, take_over=True).release()


def _take_over(path: str, barrier: Any, done: Any, wins: Any) -> None:
    """One job's ``--take-over``; every job of the round stays until all four have tried (``done``): a winner that
    exited at once would leave a lease whose holder is gone, which a slower job then rightly takes over in turn."""
    run = RunDir(*path.rsplit("/", 1))
    barrier.wait(timeout=60)
    try:
        held = acquire(run, take_over=True)
        wins.append(held.holder.token)
        held._stop.set()  # keeps the lease (no release): the round's winner
    except LeaseError:
        pass
    finally:
        done.wait(timeout=60)


def test_of_four_jobs_taking_over_one_stale_lease_exactly_one_wins(tmp_path: Path) -> None:
    """Four processes with --take-over on one stale lease, at once, 20 rounds: one winner a round, and the lease
    is the winner's (before: more than one winner in 3 and in 8 of 20 rounds)."""
    import multiprocessing

    # forked from multiprocessing's fork server (this module preloaded when this test starts it), not from pytest's
    # process, whose threads a fork would copy mid-flight (Python 3.12 warns at every such fork)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    with ctx.Manager() as manager:
        for round_ in range(20):
            path = tmp_path / f"r{round_}" / LEASE_FILE
            _write_holder(path, STALE_AFTER_S + 5, host="other-host")
            barrier, done, wins = manager.Barrier(4), manager.Barrier(4), manager.list()
            procs = [
                ctx.Process(target=_take_over, args=(str(tmp_path / f"r{round_}"), barrier, done, wins))
                for _ in range(4)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=60)
            assert len(wins) == 1, (round_, list(wins))
            assert json.loads(path.read_text())["token"] == wins[0]
            assert not list(path.parent.glob("*.takeover")) and not list(path.parent.glob("*.probe-*"))


def test_a_lease_taken_over_is_neither_renewed_nor_released_by_its_old_holder(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path), "r1")
    path = tmp_path / "r1" / LEASE_FILE
    old = acquire(run)
    _write_holder(path, token="new-holder", host="laptop-2", pid=777)  # as a --take-over by another job would
    with pytest.raises(LeaseLost, match=r"lease was taken over by another job \(host laptop-2, pid 777.*FAILED"):
        old.renew()
    old.release()
    assert json.loads(path.read_text())["token"] == "new-holder"


def test_a_holder_whose_lease_was_taken_over_is_told_between_heartbeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It reads its lease every CHECK_S between heartbeats (here none is due: HEARTBEAT_S is an hour). What the driver
    does with it (the workers stop at their next step, FAILED): tests/integration/test_train.py."""
    monkeypatch.setattr(leases, "CHECK_S", 0.05)
    monkeypatch.setattr(leases, "HEARTBEAT_S", 3600.0)
    run = RunDir(str(tmp_path), "r1")
    held = acquire(run)
    told: list[LeaseLost] = []
    held.watch(told.append)
    _write_holder(tmp_path / "r1" / LEASE_FILE, token="new-holder", host="laptop-2", pid=777)
    deadline = time.monotonic() + 10
    while not told:
        assert time.monotonic() < deadline, "not told within 10 s"
        time.sleep(0.05)
    assert held.lost is told[0] and "host laptop-2, pid 777" in str(told[0])
    late: list[LeaseLost] = []
    held.watch(late.append)  # watching after the fact: told at once
    assert late == told
    held.release()


def test_the_heartbeat_renews_the_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases, "HEARTBEAT_S", 0.05)
    held = acquire(RunDir(str(tmp_path), "r1"))
    first = held.holder.heartbeat_at
    deadline = time.monotonic() + 10
    while json.loads((tmp_path / "r1" / LEASE_FILE).read_text())["heartbeat_at"] == first:
        assert time.monotonic() < deadline, "no heartbeat within 10 s"
        time.sleep(0.05)
    held.release()


def test_on_s3_the_lease_is_a_conditional_put(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """If-None-Match: * creates it, If-Match (its ETag) renews and takes it over: on the moto server."""
    run = RunDir(f"s3://{s3_bucket}/ckpts", "r1")
    first = acquire(run)
    with pytest.raises(LeaseError, match="is in use by another job"):
        acquire(run)
    first.renew()  # If-Match our ETag: still ours
    first._stop.set()  # the driver "dies": no more heartbeats, the lease stays
    with pytest.raises(LeaseError, match="is in use by another job"):
        acquire(run, take_over=True)  # S3's LastModified says it was written just now
    monkeypatch.setattr(leases, "STALE_AFTER_S", 1.0)
    time.sleep(2.2)  # (S3's times are whole seconds)
    taker = acquire(run, take_over=True)
    with pytest.raises(LeaseLost, match=f"taken over by another job \\(host {socket.gethostname()}"):
        first.renew()  # its ETag is gone: the old holder cannot write any more
    first.release()  # not ours any more: left alone
    assert json.loads(leases.storage.read_text(taker.path) or "")["token"] == taker.holder.token
    taker.release()
    assert leases.storage.read_text(taker.path) is None


def test_an_unreachable_s3_endpoint_or_a_missing_bucket_is_one_line(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(LeaseError) as e:
        acquire(RunDir(f"s3://{s3_bucket}-missing/ckpts", "r1"))
    assert str(e.value).startswith(f"run lease s3://{s3_bucket}-missing/ckpts/r1/{LEASE_FILE}: S3 refused it")
    assert "NoSuchBucket" in str(e.value) and "\n" not in str(e.value)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(LeaseError, match=rf"cannot reach S3 \(AWS_ENDPOINT_URL=http://127.0.0.1:{port}\)") as e:
        acquire(RunDir(f"s3://{s3_bucket}/ckpts", "r1"))
    assert time.monotonic() - started < 10 and "\n" not in str(e.value)


def test_a_sweep_trial_replaces_an_earlier_attempt_of_itself_only(tmp_path: Path) -> None:
    """Ray Tune runs a trial once at a time: a lease of the same trial is an earlier attempt's (its node lost, say);
    another trial's, or a job's, is held."""
    run = RunDir(str(tmp_path), "sweep-t1")
    path = tmp_path / "sweep-t1" / LEASE_FILE
    _write_holder(path, 5, host="node-2", job="trial t1")
    acquire(run, job="trial t1", replaces_job=True).release()
    _write_holder(path, 5, host="node-2", job="trial t2")
    with pytest.raises(LeaseError, match="is in use by another job"):
        acquire(run, job="trial t1", replaces_job=True)
