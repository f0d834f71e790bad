"""Checkpoints you can trust (raytrn.checkpoint: manifest, finder): a checkpoint counts once its manifest is
written; resume takes the newest committed one whose files match; retention never deletes the newest committed one;
a failed save is left uncommitted and training goes on. One process, real files, no Ray."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from raytrn.checkpoint import dcp
from raytrn.checkpoint.finder import latest_checkpoint, newest_pointer, resume_point
from raytrn.checkpoint.manifest import COMMIT_FILE, FORMAT, is_committed, read_commit
from raytrn.checkpoint.progress import Progress
from raytrn.checkpoint.rundir import RunDir
from raytrn.errors import CheckpointError, RunStopped
from raytrn.train.schedule import Schedule
from tests.unit.gloo_ranks import spawn_ranks
from tests.unit.test_dcp import job, trained

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def save(
    t: Any, j: Any, step: int, *, final: bool = False, val_loss: float | None = None, settle: bool = True
) -> list[Any]:
    """A save at ``step``; ``settle``: then wait for the retention round it started (it runs beside the next steps:
    test_retention_runs_beside_the_steps_and_never_beside_a_save), so that the test reads what it left."""
    progress = Progress(step=step, tokens_seen=100 * step, epoch=step // 10, epoch_samples=step % 10)
    report = {"step": step, **({"val_loss": val_loss} if val_loss is not None else {})}
    saved = list(t.checkpoints.save(t, progress, Schedule.from_job(j), report, final=final))
    if settle:
        t.checkpoints.settle()
    return saved


def root(j: Any) -> Path:
    return Path(RunDir.of(j).dcp)


def test_a_save_is_committed_with_every_file_its_size_and_sha256(tmp_path: Path) -> None:
    j = job(tmp_path, "checkpoint.keep_last=null")
    t = trained(j)
    [saved] = save(t, j, 7)
    location = root(j) / "step_00000007"
    manifest = json.loads((location / COMMIT_FILE).read_text())
    assert manifest["format"] == FORMAT and manifest["step"] == 7 and manifest["world_size"] == 1
    assert manifest["layout"] == {"data_parallel": "none", "tensor_parallel_size": 1, "data_parallel_size": 1}
    assert manifest["progress"]["tokens_seen"] == 700 and manifest["progress"]["epoch_samples"] == 7
    assert manifest["schedule"] == Schedule.from_job(j).to_dict()
    on_disk = sorted(p.name for p in location.iterdir() if p.name != COMMIT_FILE)
    assert sorted(manifest["files"]) == on_disk == [".metadata", "__0_0.distcp"]
    for name, entry in manifest["files"].items():
        data = (location / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert saved.step == 7  # reported to Ray only once committed


def test_keep_last_keeps_the_newest_committed_and_leaves_others_alone(tmp_path: Path) -> None:
    j = job(tmp_path, "checkpoint.keep_last=2")
    t = trained(j)
    for step in (1, 2, 3):
        save(t, j, step)
    assert RunDir.of(j).dcp_steps() == [2, 3]
    (root(j) / "notes").mkdir()  # not raytrn's: never touched
    shutil.copytree(root(j) / "step_00000003", root(j) / "step_00000009")  # a save in flight (newer): kept
    (root(j) / "step_00000009" / COMMIT_FILE).unlink()
    save(t, j, 4)
    assert RunDir.of(j).dcp_steps() == [3, 4, 9]
    assert sorted(p.name for p in root(j).iterdir()) == ["notes", "step_00000003", "step_00000004", "step_00000009"]
    save(t, j, 10)  # newer than the leftover: it goes
    assert RunDir.of(j).dcp_steps() == [4, 10]


def test_keep_best_keeps_the_lowest_val_loss_checkpoint_beside_the_newest(tmp_path: Path) -> None:
    """checkpoint.keep_best: the committed checkpoint of the lowest val_loss (its manifest records it) survives
    keep_last; a better one later replaces it; without keep_best it goes like any other."""
    j = job(tmp_path, "checkpoint.keep_last=2", "checkpoint.keep_best=true")
    t = trained(j)
    for step, loss in ((2, 3.0), (4, 1.5), (6, None), (8, 2.5), (10, 2.0)):
        save(t, j, step, val_loss=loss)
    assert RunDir.of(j).dcp_steps() == [4, 8, 10]
    assert read_commit(RunDir.of(j).dcp_step(4)).val_loss == 1.5
    assert read_commit(RunDir.of(j).dcp_step(10)).val_loss == 2.0
    assert t.checkpoints.deleted == {2, 6}  # what the run's checkpoint tags mark deleted
    save(t, j, 12, val_loss=1.0)  # a new best: the old one is just an old checkpoint now
    assert RunDir.of(j).dcp_steps() == [10, 12]
    plain = job(tmp_path / "plain", "checkpoint.keep_last=2")
    t = trained(plain)
    for step, loss in ((2, 1.0), (4, 2.0), (6, 3.0)):
        save(t, plain, step, val_loss=loss)
    assert RunDir.of(plain).dcp_steps() == [4, 6]


def test_a_pinned_checkpoint_outlives_keep_last_until_unpinned_or_lapsed(tmp_path: Path) -> None:
    """An evaluation off the loop pins the checkpoint it reads (raytrn.checkpoint.pins): retention keeps it; once
    unpinned (or its pin lapsed: a reader that died) it goes at the next prune. Only raytrn's pin files are read."""
    from raytrn.checkpoint.manifest import prune
    from raytrn.checkpoint.pins import pin, pinned, unpin

    j = job(tmp_path, "checkpoint.keep_last=1")
    run, t = RunDir.of(j), trained(j)
    save(t, j, 1)
    pin(run, 1, ttl_s=600)
    pin(run, 2, ttl_s=-1)  # lapsed
    (Path(run.pins) / "notes.txt").write_text("not a pin")
    assert pinned(run) == {1}
    save(t, j, 2)
    save(t, j, 3)
    assert run.dcp_steps() == [1, 3]  # step 1 pinned; 2 went (its pin lapsed)
    from raytrn.checkpoint.dcp import check_complete

    check_complete(run.dcp_step(1))  # what the pin is for: the reader still finds it whole
    unpin(run, 1)
    unpin(run, 1)  # gone already: nothing
    assert prune(run, keep_last=1) == [1] and run.dcp_steps() == [3]
    assert (Path(run.pins) / "notes.txt").exists()


def test_a_prune_stopped_half_way_leaves_no_committed_checkpoint_with_files_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention deletes a checkpoint's manifest before its files: a kill or a storage error in the middle leaves an
    uncommitted leftover (never resumed, deleted by the next prune), not a committed-looking partial checkpoint."""
    from raytrn.checkpoint import manifest
    from raytrn.checkpoint.manifest import prune

    j = job(tmp_path, "checkpoint.keep_last=1")
    run, t = RunDir.of(j), trained(j)
    save(t, j, 1)
    real_remove_tree = manifest.storage.remove_tree

    def stopped_half_way(uri: str, root: str) -> None:  # one data file deleted, then the storage fails
        next(p for p in sorted(Path(uri).iterdir()) if p.name != COMMIT_FILE).unlink()
        raise OSError("connection reset")

    monkeypatch.setattr(manifest.storage, "remove_tree", stopped_half_way)
    save(t, j, 2)  # its commit, then retention deletes step 1 (a failure there is a warning: the save stands)
    assert not is_committed(run.dcp_step(1)) and run.dcp_steps() == [1, 2]
    assert [c.location for c in manifest.candidates(run)] == [run.dcp_step(2)]
    monkeypatch.setattr(manifest.storage, "remove_tree", real_remove_tree)
    assert prune(run, keep_last=1) == [1] and run.dcp_steps() == [2]


def _deletes_held(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """A storage whose deletes take a while: each of retention's checkpoint deletes sets ``deleting``, then waits for
    ``gate``. Returns ``(gate, deleting)``."""
    from raytrn.checkpoint import manifest

    gate, deleting = threading.Event(), threading.Event()
    real_delete = manifest._delete

    def held(run_dir: RunDir, step: int) -> None:
        deleting.set()
        assert gate.wait(30)
        real_delete(run_dir, step)

    monkeypatch.setattr(manifest, "_delete", held)
    return gate, deleting


def _save_in_thread(t: Any, j: Any, step: int) -> threading.Thread:
    """:func:`save` of ``step`` in a thread of its own, its retention round not waited for."""
    thread = threading.Thread(target=save, args=(t, j, step), kwargs={"settle": False}, daemon=True)
    thread.start()
    return thread


def _next_save_waits_for_the_round(t: Any, j: Any, gate: threading.Event, why: str) -> None:
    """Step 3's save, started while the round deleting step 1 is held at ``gate``: it waits (nothing cleared or written
    beside the round: steps 1 and 2 stand) until the round is let go, then saves, step 1 counted deleted."""
    run = RunDir.of(j)
    third = _save_in_thread(t, j, 3)
    time.sleep(0.5)
    assert third.is_alive() and run.dcp_steps() == [1, 2], why
    gate.set()
    third.join(30)
    assert not third.is_alive() and t.checkpoints.deleted == {1}


def test_retention_runs_beside_the_steps_and_never_beside_a_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's retention round after a commit runs in a thread of its own: the save returns (the steps go on) while
    it deletes; the next save waits for it before it clears or writes anything; the last save returns with its round
    done; what a round deleted counts once it is done."""
    j = job(tmp_path, "checkpoint.keep_last=1")
    run, t = RunDir.of(j), trained(j)
    save(t, j, 1)
    gate, deleting = _deletes_held(monkeypatch)
    second = _save_in_thread(t, j, 2)
    second.join(10)
    assert not second.is_alive(), "the save waited for its retention round"
    assert deleting.wait(10) and is_committed(run.dcp_step(2)) and run.dcp_steps() == [1, 2]  # step 1's delete waits
    assert t.checkpoints.deleted == set()  # (counted once the round is done)
    _next_save_waits_for_the_round(t, j, gate, "the next save started beside the round")
    save(t, j, 4, final=True, settle=False)  # the last save: its round is done when it returns
    assert run.dcp_steps() == [4] and t.checkpoints.deleted == {1, 2, 3}


def test_retentions_deletions_are_logged_as_routine(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Retention's line at every save goes to the run's Ray log, not the terminal (``raytrn.ray_output.ROUTINE``)."""
    from raytrn.ray_output import ROUTINE

    j = job(tmp_path, "checkpoint.keep_last=1")
    t = trained(j)
    save(t, j, 1)
    with caplog.at_level(logging.INFO, logger="raytrn"):
        save(t, j, 2, final=True, settle=False)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("deleted checkpoints of steps [1]")]
    assert all(getattr(record, key) == value for key, value in ROUTINE.items())


def test_a_retention_round_keeps_the_steps_it_is_told_are_being_written(tmp_path: Path) -> None:
    """A step saved again after a rollback can be older than the newest committed one: the round started beside its
    write keeps it (and anything newer than the newest committed one, as always)."""
    from raytrn.checkpoint.manifest import prune

    j = job(tmp_path, "checkpoint.keep_last=null")
    run, t = RunDir.of(j), trained(j)
    for step in (1, 2, 3):
        save(t, j, step)
    assert prune(run, keep_last=1, keep=(2,)) == [1] and run.dcp_steps() == [2, 3]
    assert prune(run, keep_last=1) == [2] and run.dcp_steps() == [3]


def test_an_uncommitted_checkpoint_is_never_resumed(tmp_path: Path) -> None:
    """A save that died before its manifest (here: every shard there, only the manifest missing)."""
    j = job(tmp_path, "checkpoint.keep_last=null")
    t = trained(j)
    save(t, j, 2)
    save(t, j, 4)
    (root(j) / "step_00000004" / COMMIT_FILE).unlink()
    assert resume_point(j, rank=0, world_size=1).commit.step == 2
    meta, location = latest_checkpoint(j)
    assert meta is not None and meta.progress.step == 2 and location == str(root(j) / "step_00000002")
    save(t, j, 4)  # saving the step again replaces the leftover and commits it
    assert resume_point(j, rank=0, world_size=1).commit.step == 4


def _two_saves_the_newest_bit_flipped(tmp_path: Path) -> tuple[Any, Path, bytearray]:
    """Committed checkpoints of steps 2 and 4, one bit of step 4's shard flipped (same size: only its sha256, a
    read of the file, tells): the job, that shard and its damaged bytes."""
    j = job(tmp_path, "checkpoint.keep_last=null")
    t = trained(j)
    save(t, j, 2)
    save(t, j, 4)
    shard = root(j) / "step_00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return j, shard, data


def test_a_corrupt_checkpoint_is_skipped_with_a_warning_naming_the_file(tmp_path: Path, caplog) -> None:
    j, shard, data = _two_saves_the_newest_bit_flipped(tmp_path)
    assert latest_checkpoint(j)[0].progress.step == 4  # type: ignore[union-attr]  # the driver checks sizes
    with caplog.at_level(logging.WARNING, logger="raytrn.checkpoint.finder"):
        chosen = resume_point(j, rank=0, world_size=1)
    assert chosen.commit.step == 2
    assert "step_00000004: skipped: its files do not match its manifest (__0_0.distcp: sha256" in caplog.text
    sized = job(tmp_path, "checkpoint.keep_last=null", "checkpoint.verify=size")
    assert resume_point(sized, rank=0, world_size=1).commit.step == 4  # what verify: size trades away

    shard.write_bytes(bytes(data[:100]))  # truncated: the size check (driver and workers) catches it
    with caplog.at_level(logging.WARNING, logger="raytrn.checkpoint.manifest"):
        assert latest_checkpoint(j)[0].progress.step == 2  # type: ignore[union-attr]
    assert "__0_0.distcp: 100 bytes, the manifest says" in caplog.text


def test_behind_a_snapshot_at_least_as_new_only_the_newest_manifest_is_read(tmp_path: Path) -> None:
    """A group that restores an in-memory snapshot at least as new as every committed checkpoint reads no checkpoint
    file: the newest checkpoint is named (its manifest read), not hashed; an older snapshot hashes it."""
    j, _, _ = _two_saves_the_newest_bit_flipped(tmp_path)
    assert resume_point(j, rank=0, world_size=1).commit.step == 2  # read, hashed, skipped
    assert resume_point(j, rank=0, world_size=1, snapshot=5).commit.step == 4  # never read
    assert resume_point(j, rank=0, world_size=1, snapshot=4).commit.step == 4  # the same step: memory's, not read
    assert resume_point(j, rank=0, world_size=1, snapshot=3).commit.step == 2  # older: checked as before
    (root(j) / "step_00000002" / "__0_0.distcp").write_bytes(b"x")
    (root(j) / "step_00000004" / "__0_0.distcp").write_bytes(b"x")
    for snapshot in (None, 1, 5):  # every checkpoint bad: never a silent step back, to a snapshot either
        with pytest.raises(CheckpointError):
            resume_point(j, rank=0, world_size=1, snapshot=snapshot)
    fresh = job(tmp_path / "fresh")
    assert resume_point(fresh, rank=0, world_size=1, snapshot=5) is None  # none committed yet: the snapshot


def test_a_manifest_that_does_not_match_its_files_is_skipped(tmp_path: Path, caplog) -> None:
    j = job(tmp_path, "checkpoint.keep_last=null")
    t = trained(j)
    save(t, j, 2)
    save(t, j, 4)
    path = root(j) / "step_00000004" / COMMIT_FILE
    manifest = json.loads(path.read_text())
    manifest["files"]["__1_0.distcp"] = {"size": 10, "sha256": "0" * 64}  # a rank's file that is not there
    path.write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="raytrn.checkpoint.manifest"):
        assert resume_point(j, rank=0, world_size=1).commit.step == 2
    assert "__1_0.distcp: missing" in caplog.text
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="raytrn.checkpoint.manifest"):
        assert resume_point(j, rank=0, world_size=1).commit.step == 2
    assert "commit.json is unreadable" in caplog.text


def test_when_every_committed_checkpoint_is_bad_nothing_silently_starts_over(tmp_path: Path) -> None:
    j = job(tmp_path, "checkpoint.keep_last=null")
    t = trained(j)
    save(t, j, 2)
    (root(j) / "step_00000002" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="every committed checkpoint under .* failed its check"):
        resume_point(j, rank=0, world_size=1)
    with pytest.raises(CheckpointError, match="raytrn will not silently start over"):
        latest_checkpoint(j)
    fresh = job(tmp_path / "other")
    assert resume_point(fresh, rank=0, world_size=1) is None and latest_checkpoint(fresh) == (None, None)


def test_a_failed_save_is_left_uncommitted_and_training_goes_on(tmp_path: Path, monkeypatch, caplog) -> None:
    """The storage failing past raytrn's retries (here: the write raises): not reported, not committed, counted;
    the last save (or a preemption's) raises instead."""
    j = job(tmp_path, "checkpoint.keep_last=null")
    t = trained(j)
    save(t, j, 2)
    real = dcp.save

    def failing(state: Any, location: str) -> Any:
        real(state, location)  # every shard written ...
        raise OSError("S3 unavailable")  # ... but the save failed (as DCP raises it on every rank)

    monkeypatch.setattr(dcp, "save", failing)
    with caplog.at_level(logging.WARNING, logger="raytrn.checkpoint.sharded"):
        assert save(t, j, 4) == []
    assert "could not be written (S3 unavailable); training goes on" in caplog.text
    assert t.checkpoints.failed == 1 and not is_committed(str(root(j) / "step_00000004"))
    assert resume_point(j, rank=0, world_size=1).commit.step == 2
    with pytest.raises(CheckpointError, match="could not be written: S3 unavailable"):
        save(t, j, 6, final=True)


def test_saves_failing_in_a_row_stop_the_job_at_max_consecutive_failures(tmp_path: Path, monkeypatch) -> None:
    """Each failed save is counted (the checkpoint_failures metric); a commit resets the run of failures; the
    max_consecutive_failures-th in a row raises, naming the setting and the last cause."""
    j = job(tmp_path, "checkpoint.keep_last=null", "checkpoint.max_consecutive_failures=2")
    t = trained(j)
    real = dcp.save
    down = True

    def flaky(state: Any, location: str) -> Any:
        if down:
            raise OSError("No space left on device")
        return real(state, location)

    monkeypatch.setattr(dcp, "save", flaky)
    assert save(t, j, 2) == []
    down = False
    assert [s.step for s in save(t, j, 4)] == [4]  # committed: the run of failures starts over
    down = True
    assert save(t, j, 6) == [] and t.checkpoints.consecutive_failures == 1
    with pytest.raises(RunStopped) as e:  # the run ends FAILED: no worker-group restart fixes the storage
        save(t, j, 8)
    assert isinstance(e.value, CheckpointError)
    assert "checkpoint.max_consecutive_failures=2: the last 2 saves failed" in str(e.value)
    assert "No space left on device" in str(e.value) and "resumes from its newest committed checkpoint" in str(e.value)
    assert t.checkpoints.failed == 3


def test_a_live_groups_failed_saves_count_on_across_its_re_formations(tmp_path: Path, monkeypatch) -> None:
    """Under scaling.recovery: live each generation of the group gets its checkpoints made anew (its rank and size
    moved): the run's failed saves count on through them, so max_consecutive_failures in a row stops the run as on
    the restart path (at stop 57 a re-formation started the count over), and checkpoint_failures is the run's."""
    from types import SimpleNamespace

    from raytrn.train.live.group import Generation
    from raytrn.train.live_loop import LiveCheckpoints

    j = job(tmp_path, "checkpoint.keep_last=null", "checkpoint.max_consecutive_failures=2")
    t = trained(j)

    def down(state: Any, location: str) -> Any:
        raise OSError("No space left on device")

    monkeypatch.setattr(dcp, "save", down)
    live = LiveCheckpoints(j)
    t.checkpoints = live.of(SimpleNamespace(generation=Generation(0, ("w0", "w1")), rank=0))
    assert save(t, j, 2) == [] and live.failed == 1
    t.checkpoints = live.of(SimpleNamespace(generation=Generation(1, ("w0",)), rank=0))  # w1 lost: re-formed
    with pytest.raises(RunStopped, match="the last 2 saves failed"):
        save(t, j, 4)
    assert live.failed == 2


def test_a_re_formed_live_group_waits_for_the_retention_round_of_the_one_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retention round in flight when the live group re-forms (its checkpoints made anew) is the new generation's:
    its next save waits for it, and the steps it deleted count on (checkpoint.keep_best's tags)."""
    from types import SimpleNamespace

    from raytrn.train.live.group import Generation
    from raytrn.train.live_loop import LiveCheckpoints

    j = job(tmp_path, "checkpoint.keep_last=1")
    run, t = RunDir.of(j), trained(j)
    live = LiveCheckpoints(j)
    t.checkpoints = live.of(SimpleNamespace(generation=Generation(0, ("w0", "w1")), rank=0))
    save(t, j, 1)
    gate, deleting = _deletes_held(monkeypatch)
    save(t, j, 2, settle=False)  # its round (deleting step 1) waits at the gate
    assert deleting.wait(10)
    t.checkpoints = live.of(SimpleNamespace(generation=Generation(1, ("w0",)), rank=0))  # w1 lost: re-formed
    _next_save_waits_for_the_round(t, j, gate, "the new generation's save started beside the round")
    t.checkpoints.settle()
    assert run.dcp_steps() == [3] and t.checkpoints.deleted == {1, 2}


def test_a_save_that_fails_for_another_reason_than_storage_raises(tmp_path: Path, monkeypatch) -> None:
    """A lost peer (gloo's error) or a bug is not skipped as a storage hiccup: the group fails and restarts."""
    j = job(tmp_path)
    t = trained(j)

    def broken(state: Any, location: str) -> Any:
        raise RuntimeError("gloo: Connection reset by peer")

    monkeypatch.setattr(dcp, "save", broken)
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        save(t, j, 2)


def test_storage_that_cannot_be_listed_fails_the_driver_instead_of_starting_the_run_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real pyarrow S3 filesystem against a closed port on 127.0.0.1 (one attempt): the listing's error stops
    the driver, naming the storage; retention and tidying after a run only warn."""
    import socket

    from raytrn import storage
    from raytrn.checkpoint.manifest import tidy_pointers

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setattr(storage, "S3_ATTEMPTS", 1)
    j = job(tmp_path, "checkpoint.storage=s3://bucket/ckpts")
    with pytest.raises(CheckpointError, match=r"checkpoint.storage: cannot list s3://bucket/ckpts/.*would start over"):
        latest_checkpoint(j)
    with pytest.raises(CheckpointError, match="cannot list"):
        newest_pointer(RunDir.of(j))  # the rule of a run without manifests (and of the frozen XLA path)
    assert tidy_pointers(RunDir.of(j)) == []


def test_a_restart_reads_the_manifests_only_as_far_as_the_checkpoint_it_resumes(tmp_path: Path, monkeypatch) -> None:
    """Five committed checkpoints: a restart reads the newest's manifest, not all five (on S3 each is a GET); when
    the newest fails its hash, the one before it is read next, and no further."""
    from raytrn.checkpoint import manifest

    j = job(tmp_path, "checkpoint.keep_last=null")
    t = trained(j)
    for step in (1, 2, 3, 4, 5):
        save(t, j, step)
    reads: list[str] = []
    real = manifest.read_commit
    monkeypatch.setattr(manifest, "read_commit", lambda location: reads.append(Path(location).name) or real(location))
    assert resume_point(j, rank=0, world_size=1).commit.step == 5
    assert reads == ["step_00000005"]
    shard = root(j) / "step_00000005" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    reads.clear()
    assert resume_point(j, rank=0, world_size=1).commit.step == 4
    assert reads == ["step_00000005", "step_00000004"]


def _resume_rank(rank: int, world: int, port: int, tmp: str, out: Any) -> None:
    import datetime
    import os

    import torch.distributed as dist

    from raytrn.checkpoint import manifest

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    reads: list[str] = []
    real = manifest.read_commit
    manifest.read_commit = lambda location: reads.append(Path(location).name) or real(location)  # type: ignore[assignment]
    chosen = resume_point(job(Path(tmp), "checkpoint.keep_last=null"), rank=rank, world_size=world)
    out[rank] = (chosen.commit.step if chosen else None, reads)
    dist.destroy_process_group()


def test_two_ranks_walk_the_candidates_in_step_to_the_same_checkpoint(tmp_path: Path) -> None:
    """A collective: rank 0 lists, each rank hashes its share of each candidate's files; the newest fails (a bit
    flipped in a shard one of them hashes), so both ranks move on to the one before together and agree on it. Only
    rank 0 reads manifests, as far as that one."""
    import torch.multiprocessing as mp

    j, _, _ = _two_saves_the_newest_bit_flipped(tmp_path)
    with mp.Manager() as manager:
        out = manager.dict()
        spawn_ranks(_resume_rank, 2, str(tmp_path), out, deadline_s=120)
        results = dict(out)
    assert results == {0: (2, ["step_00000004", "step_00000002"]), 1: (2, [])}
