"""The in-memory tier's typed decisions (raytrn.checkpoint.messages): each refusal and passed-over snapshot rendered
to English here, the one place it is; they cross processes (pickle) and the board (JSON); the loop decides on kinds,
never on text (a stuck thread, the warnings' de-duplication, the rewind's answer); a store's file location is a type
its readers match on."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raytrn.checkpoint.messages import (
    ObjectLocation,
    Passed,
    PassedOver,
    Refusal,
    Refused,
    SlabLocation,
    StoresRewound,
    render,
)
from raytrn.checkpoint.progress import Progress
from tests.unit.memory_stand_ins import StandInKeeper, StandInStore
from tests.unit.test_memory_tier import _taking

pytestmark = pytest.mark.unit

MIB = 2**20

RENDERED = [
    (Refusal(Refused.STALE, 8, 0, generation=1, current=2),
     "rank 0's snapshot 8 refused: from an older worker group (generation 1; the stores are at 2)"),
    (Refusal(Refused.STALE, 8, None, generation=1, current=2),
     "snapshot 8's manifest refused: from an older worker group (generation 1; the stores are at 2)"),
    (Refusal(Refused.NOT_NEWER, 5, 0, sealed=5), "snapshot 5 is not newer than the complete snapshot 5"),
    (Refusal(Refused.NO_ROOM, 1, 2, nbytes=2 * MIB, held=2 * MIB, capacity=3 * MIB),
     "rank 2's snapshot 1 needs 2.0 MiB; this node's store holds 2.0 of 3.0 MiB"),
    (Refusal(Refused.NOT_ARRIVED, 4, 1, error="GetTimeoutError"),
     "rank 1's snapshot 4: its files did not arrive (GetTimeoutError)"),
    (Refusal(Refused.SLAB_FREED, 3, 0), "rank 0's snapshot 3: its slab was freed before its files were kept"),
    (Refusal(Refused.NO_STORE, 3, 0, nodes=("n1", "n2")), "no memory store on node(s) n1, n2"),
    (Refusal(Refused.COPIES_FAILED, 6, 1, error="OSError: full"), "snapshot 6: rank 1's copies failed (OSError: full)"),
    (Refusal(Refused.COPIES_LATE, 6, 1, timeout_s=60.0), "snapshot 6: rank 1's copies not kept within 60 s"),
    (Refusal(Refused.NOT_STAGED, 3, 0, error="MemoryError: host memory"),
     "snapshot 3: not staged on rank 0 (MemoryError: host memory)"),
    (Refusal(Refused.NOT_WRITTEN, 3, 0, error="ValueError: x"), "snapshot 3: not written (ValueError: x)"),
    (Refusal(Refused.NOT_AGREED, 3, error="RuntimeError: peer"), "snapshot 3: not agreed (RuntimeError: peer)"),
    (Refusal(Refused.WRITE_LATE, 5, 0, timeout_s=0.05), "snapshot 5: not written within 0 s"),
    (Refusal(Refused.SEAL_UNANSWERED, 9), "snapshot 9: a store did not answer the seal"),
    (Refusal(Refused.NOT_REWOUND, 7, error="ConnectionError: keeper gone"),
     "could not rewind the stores to step 7 (ConnectionError: keeper gone)"),
]  # fmt: skip

PASSED = [
    (PassedOver(10, Passed.NO_MANIFEST, lost_nodes=("n1",)),
     "snapshot 10: no manifest on a live node (its only copies were on lost node(s) n1)"),
    (PassedOver(10, Passed.NO_MANIFEST, complete=True, lost_nodes=("n1",)),
     "snapshot 10: no manifest on a live node (complete, but its only copies were on lost node(s) n1)"),
    (PassedOver(10, Passed.NO_MANIFEST, complete=True),
     "snapshot 10: no manifest on a live node (complete, but its only copies were on nodes that no longer answer)"),
    (PassedOver(10, Passed.NO_MANIFEST), "snapshot 10: no manifest on a live node (never completed, or only on lost nodes)"),
    (PassedOver(10, Passed.RANKS_MISSING, lost_nodes=("n1",), gone_nodes=("n1",), missing=(0,), world_size=3),
     "snapshot 10: rank(s) 0 of 3 missing (their only copies were on lost node(s) n1)"),
    (PassedOver(10, Passed.RANKS_MISSING, gone_nodes=("n1",), missing=(0,), world_size=3),
     "snapshot 10: rank(s) 0 of 3 missing (node(s) n1 no longer answer: lost, with the copies they held)"),
    (PassedOver(7, Passed.RANKS_MISSING, missing=(1, 2), world_size=3), "snapshot 7: rank(s) 1, 2 of 3 missing"),
    (PassedOver(None, Passed.UNASKED, error="GetTimeoutError: 60 s"), "could not ask the stores (GetTimeoutError: 60 s)"),
]  # fmt: skip


def test_every_refusal_kind_is_rendered_and_several_are_joined() -> None:
    assert {r.kind for r, _ in RENDERED} == set(Refused)
    for refusal, text in RENDERED:
        assert render(refusal) == text, refusal.kind
    (a, ta), (b, tb) = RENDERED[:2]
    assert render((a, b)) == f"{ta}; {tb}" and render(()) == ""


def test_every_passed_over_snapshot_is_rendered_and_recorded_as_json_fields() -> None:
    assert {p.kind for p, _ in PASSED} == set(Passed)
    for passed, text in PASSED:
        assert render(passed) == text, passed
        record = passed.record()
        assert json.loads(json.dumps(record)) == record  # the board's record: JSON as it is
        assert (record["step"], record["kind"], record["why"]) == (passed.step, passed.kind.value, text)
    record = PASSED[4][0].record()
    assert (record["lost_nodes"], record["missing"], record["world_size"]) == (["n1"], [0], 3)


def test_the_decisions_cross_processes_as_they_are() -> None:
    """Ray pickles what an actor returns and what the ranks gather: every type comes back equal."""
    for value in [r for r, _ in RENDERED] + [p for p, _ in PASSED] + [SlabLocation("/dev/shm/x", 64, 10)]:
        assert pickle.loads(pickle.dumps(value)) == value
    assert pickle.loads(pickle.dumps(ObjectLocation(b"ref"))).ref == b"ref"


# -- the loop decides on kinds ---------------------------------------------------------------------------------


def _complete(snaps: Any, step: int, *reason: Refusal) -> bool:
    from raytrn.train.snapshots import _Writing

    writing = snaps._writing = _Writing(Progress(step=step), 0.0)
    writing.reason = reason
    writing.done.set()
    return bool(snaps.written())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "raytrn.train.snapshots"]


def test_a_failure_of_the_same_kind_is_warned_once_whatever_its_text(tmp_path: Path, caplog) -> None:
    """The warnings were de-duplicated by their text with the digits masked: another node's name (letters in a
    node id) or another exception's message warned again at every snapshot. Now by the refusals' kinds."""
    snaps = _taking(tmp_path)
    with caplog.at_level(logging.WARNING, logger="raytrn.train.snapshots"):
        assert not _complete(snaps, 3, Refusal(Refused.NO_STORE, 3, 0, nodes=("node-a",)))
        assert not _complete(snaps, 4, Refusal(Refused.NO_STORE, 4, 0, nodes=("node-b",)))
        assert not _complete(snaps, 5, Refusal(Refused.COPIES_FAILED, 5, 0, error="OSError: disk gone"))
        assert not _complete(snaps, 6, Refusal(Refused.COPIES_FAILED, 6, 0, error="GetTimeoutError: slow"))
    warned = _warnings(caplog)
    assert len(warned) == 2, warned
    assert "step 3 skipped: no memory store on node(s) node-a" in warned[0]
    assert "step 5 skipped: snapshot 5: rank 0's copies failed (OSError: disk gone)" in warned[1]
    assert snaps.taking  # a failed snapshot is skipped: the next one is taken


def test_a_stuck_thread_on_any_rank_stops_the_groups_snapshots_by_its_kind(tmp_path, monkeypatch, caplog) -> None:
    """Another rank's thread did not end in time (its refusal gathered here): the group stops taking snapshots, and
    the snapshot is not dropped (that thread may yet seal it)."""
    from raytrn.train import snapshots

    snaps = _taking(tmp_path)
    store = StandInStore()
    snaps.ring = {"n": store}
    late = Refusal(Refused.WRITE_LATE, 5, 1, timeout_s=300.0)
    monkeypatch.setattr(snapshots.agree, "gather", lambda value, **_: [value, (late,)])
    with caplog.at_level(logging.WARNING, logger="raytrn.train.snapshots"):
        assert not _complete(snaps, 5)
    assert not snaps.taking and store.dropped == []
    [warning] = _warnings(caplog)
    assert "stop for this worker group: snapshot 5: not written within 300 s" in warning
    # Any other refusal on another rank: the snapshot is dropped, the group goes on.
    snaps = _taking(tmp_path)
    store = StandInStore()
    snaps.ring = {"n": store}
    other = Refusal(Refused.COPIES_LATE, 6, 1, timeout_s=60.0)
    monkeypatch.setattr(snapshots.agree, "gather", lambda value, **_: [value, (other,)])
    assert not _complete(snaps, 6) and snaps.taking and store.dropped == [6]


def test_the_rewind_answer_carries_the_generation_or_the_refusal(tmp_path: Path) -> None:
    from raytrn.train.snapshots import Rewound

    snaps = _taking(tmp_path)
    snaps.keeper = keeper = StandInKeeper(StoresRewound(3))
    snaps.starting_at(7)
    assert snaps.generation == 3 and snaps.taking and keeper.rewinds == [7]
    refused = Rewound(refused=Refusal(Refused.NOT_REWOUND, 7, error="ConnectionError: x"))
    assert refused.generation == 0 and refused.refused is not None and refused.refused.kind is Refused.NOT_REWOUND


# -- where a file is ---------------------------------------------------------------------------------------------


def test_a_reader_reads_a_slab_in_place_on_its_node_and_an_object_elsewhere(tmp_path, monkeypatch) -> None:
    """fetcher matches on the location's type: its own node's slab read in place, another node's slab exported as an
    object, an object read as it is; a store without the file is passed by."""
    import ray

    from raytrn.checkpoint.memory import fetcher

    slab = tmp_path / "slab"
    slab.write_bytes(b"..slab-bytes..")

    def store(found: Any) -> StandInStore:
        return StandInStore(found, exported=ObjectLocation(np.frombuffer(b"exported", dtype=np.uint8)))

    monkeypatch.setattr(ray, "get", lambda value, **_: value)  # (an object's ref: the array itself here)
    at_slab = SlabLocation(str(slab), 2, 10)
    mine, other = store(at_slab), store(at_slab)
    assert bytes(fetcher({"me": mine}, 1, node="me")("f")) == b"slab-bytes" and mine.exports == []
    assert bytes(fetcher({"other": other}, 1, node="me")("f")) == b"exported" and other.exports == ["f"]
    as_object = ObjectLocation(np.frombuffer(b"object", dtype=np.uint8))
    assert bytes(fetcher({"a": store(None), "b": store(as_object)}, 1, node="me")("f")) == b"object"
    with pytest.raises(FileNotFoundError):
        fetcher({"a": store(None)}, 1, node="me")("f")


def test_a_store_locates_an_object_file_as_an_object() -> None:
    from raytrn.checkpoint.memory import Kept, RayStore

    store = RayStore(1000, None)
    store._files[4] = {0: Kept({"__0_0.raw": 3}, {"__0_0.raw": "ref-0"})}
    assert store.locate(4, "__0_0.raw") == ObjectLocation("ref-0")
    assert store.export(4, "__0_0.raw") == ObjectLocation("ref-0")  # (already an object: as it is)
    assert store.locate(4, "other") is None and store.locate(5, "__0_0.raw") is None
