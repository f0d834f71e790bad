"""One job per run (raytrn.checkpoint.lease): a second driver is refused naming the holder, a stale lease is taken
over only when asked, and a lease is renewed and released only by its holder. Local files, and a real S3 endpoint
(the moto server on 127.0.0.1) for the conditional puts."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrn.checkpoint import lease as leases
from raytrn.checkpoint.lease import LEASE_FILE, STALE_AFTER_S, LeaseError, acquire
from raytrn.checkpoint.rundir import RunDir

pytestmark = pytest.mark.unit


def _write_holder(path: Path, **changes: object) -> None:
    now = time.time()
    holder = {"host": socket.gethostname(), "pid": 1, "started_at": now, "heartbeat_at": now, "token": "theirs"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**holder, **changes}))


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
    _write_holder(path, host="other-host", pid=4242, heartbeat_at=time.time() - STALE_AFTER_S - 5)
    with pytest.raises(LeaseError, match=r"has a stale lease .* its holder is gone .*run again with --take-over"):
        acquire(run)
    _write_holder(path, host="other-host", pid=4242, heartbeat_at=time.time() - 60)  # alive elsewhere: refused
    with pytest.raises(LeaseError, match="is in use by another job"):
        acquire(run, take_over=True)
    _write_holder(path, host="other-host", pid=4242, heartbeat_at=time.time() - STALE_AFTER_S - 5)
    mine = acquire(run, take_over=True)
    assert json.loads(path.read_text())["token"] == mine.holder.token
    mine.release()
    assert not path.exists()


def test_the_lease_of_a_dead_driver_of_this_machine_is_replaced_at_once(tmp_path: Path) -> None:
    """A driver SIGKILLed here (its pid is gone): the next run of the job needs no --take-over."""
    path = tmp_path / "r1" / LEASE_FILE
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    _write_holder(path, pid=proc.pid)
    mine = acquire(RunDir(str(tmp_path), "r1"))
    assert json.loads(path.read_text())["token"] == mine.holder.token
    mine.release()


def test_a_lease_taken_over_is_neither_renewed_nor_released_by_its_old_holder(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path), "r1")
    path = tmp_path / "r1" / LEASE_FILE
    old = acquire(run)
    _write_holder(path, token="new-holder")  # as a --take-over by another job would
    with pytest.raises(LeaseError, match="taken over by another job"):
        old.renew()
    old.release()
    assert json.loads(path.read_text())["token"] == "new-holder"


def test_the_heartbeat_renews_the_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases, "HEARTBEAT_S", 0.05)
    held = acquire(RunDir(str(tmp_path), "r1"))
    first = held.holder.heartbeat_at
    deadline = time.monotonic() + 10
    while json.loads((tmp_path / "r1" / LEASE_FILE).read_text())["heartbeat_at"] == first:
        assert time.monotonic() < deadline, "no heartbeat within 10 s"
        time.sleep(0.05)
    held.release()


def test_on_s3_the_lease_is_a_conditional_put(s3_bucket: str) -> None:
    """If-None-Match: * creates it, If-Match (its ETag) renews and takes it over: on the moto server."""
    run = RunDir(f"s3://{s3_bucket}/ckpts", "r1")
    first = acquire(run)
    with pytest.raises(LeaseError, match="is in use by another job"):
        acquire(run)
    first.renew()  # If-Match our ETag: still ours
    first._stop.set()  # the driver "dies": no more heartbeats, the lease stays
    stale = json.loads(leases.storage.read_text(first.path) or "")
    stale["heartbeat_at"] -= STALE_AFTER_S + 5
    leases._s3_client().put_object(Bucket=s3_bucket, Key="ckpts/r1/" + LEASE_FILE, Body=json.dumps(stale).encode())
    taker = acquire(run, take_over=True)
    with pytest.raises(leases._Precondition):
        first.renew()  # its ETag is gone: the old holder cannot write any more
    first.release()  # not ours any more: left alone
    assert json.loads(leases.storage.read_text(taker.path) or "")["token"] == taker.holder.token
    taker.release()
    assert leases.storage.read_text(taker.path) is None
