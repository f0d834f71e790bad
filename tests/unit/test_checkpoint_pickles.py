"""A checkpoint cannot run code when raytrn reads it (issue 46, item 1; SECURITY.md "Checkpoint storage is code").

DCP reads a non-tensor item with ``torch.load(weights_only=False)`` and ``.metadata`` with ``pickle.load``: a
checkpoint whose ``scheduler`` item or ``.metadata`` pickles a ``__reduce__`` would run it on restore. Here such
checkpoints are written for real (DCP's own save of a poisoned state), then read through every raytrn load path —
the local reader, the S3 reader's code (pyarrow's filesystem: the same class reads S3), the memory tier's reader, the
evaluator's export — and each is refused with one error naming the item and the file, and nothing ran (a marker
file the payload would create stays absent). A checkpoint of plain values still loads exactly.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch

from raytrn.backends.cpu import CpuBackend
from raytrn.checkpoint import dcp, memfiles, plain
from raytrn.errors import CheckpointError
from raytrn.train.build import build_training
from tests.unit.test_dcp import job, trained

pytestmark = pytest.mark.unit


class Payload:
    """Pickles as a call of ``os.system`` that creates ``marker``: what a hostile checkpoint would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _poisoned(tmp: Path, item: str = "last_epoch") -> tuple[Any, Path, Path]:
    """A real DCP checkpoint of a trained tiny model whose ``scheduler.<item>`` is a :class:`Payload`."""
    j = job(tmp)
    t = trained(j)
    state = dcp.training_state(t.model, t.optimizer, t.scheduler)
    marker = tmp / "ran"
    state["scheduler"][item] = Payload(marker)
    location = tmp / "ckpt" / "step_2"
    dcp.save(state, str(location))
    assert not marker.exists()  # saving pickles it; nothing has run yet
    return j, location, marker


def _fresh(j: Any) -> Any:
    return build_training(j, CpuBackend(), world_size=1)


def _assert_refused(e: pytest.ExceptionInfo[CheckpointError], marker: Path, file: str) -> None:
    message = str(e.value)
    assert "'scheduler.last_epoch'" in message and file in message and "not plain data" in message, message
    assert "system" in message and "nothing of it was run" in message, message
    assert "\n" not in message
    assert not marker.exists()


def test_a_poisoned_item_is_refused_by_the_local_reader(tmp_path: Path) -> None:
    j, location, marker = _poisoned(tmp_path)
    fresh = _fresh(j)
    with pytest.raises(CheckpointError) as e:
        dcp.load(str(location), fresh.model, fresh.optimizer, fresh.scheduler, source="job.yaml")
    _assert_refused(e, marker, "__0_0.distcp")
    assert str(location) in str(e.value)


def test_a_poisoned_item_is_refused_by_the_s3_reader(tmp_path: Path) -> None:
    """The reader ``storage_reader`` gives for ``s3://`` (pyarrow's S3 filesystem), on pyarrow's local one."""
    j, location, marker = _poisoned(tmp_path)
    fresh = _fresh(j)
    reader = dcp._ArrowReader(pafs.LocalFileSystem(), str(location))
    with pytest.raises(CheckpointError) as e:
        dcp.load_state(reader, fresh.model, fresh.optimizer, fresh.scheduler)
    _assert_refused(e, marker, "__0_0.distcp")


def test_a_poisoned_item_is_refused_by_the_memory_tier(tmp_path: Path) -> None:
    j, location, marker = _poisoned(tmp_path)
    fresh = _fresh(j)
    with pytest.raises(CheckpointError) as e:
        memfiles.load_from_memory(lambda name: (location / name).read_bytes(), fresh.model, fresh.optimizer,
                                  fresh.scheduler)  # fmt: skip
    _assert_refused(e, marker, "__0_0.distcp")
    assert "in-memory snapshot" in str(e.value)


def test_a_poisoned_item_is_refused_by_the_evaluators_export(tmp_path: Path, monkeypatch) -> None:
    """The evaluator exports a committed checkpoint's model (its non-tensor items too, were it asked for any): a
    poisoned ``.metadata`` there is refused before a tensor is read."""
    from raytrn.checkpoint.rundir import RunDir
    from raytrn.evals.export import export_checkpoint

    j = job(tmp_path)
    t = trained(j)
    location = Path(RunDir.of(j).dcp_step(2))
    dcp.save(dcp.training_state(t.model, t.optimizer, t.scheduler), str(location))
    marker = tmp_path / "ran"
    (location / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"item '\.metadata' in \.metadata is not plain data .*system"):
        export_checkpoint(j, 2, str(tmp_path / "out"))
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_poisoned_metadata_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    j = job(tmp_path)
    t = trained(j)
    location = tmp_path / "ckpt"
    dcp.save(dcp.training_state(t.model, t.optimizer, t.scheduler), str(location))
    marker = tmp_path / "ran"
    real = (location / ".metadata").read_bytes()
    (location / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    for read in (dcp.read_metadata, dcp.check_complete):
        with pytest.raises(CheckpointError, match=r"not plain data \(it names posix\.system\)"):
            read(str(location))
    fresh = _fresh(j)
    with pytest.raises(CheckpointError):
        memfiles.load_from_memory(lambda name: (location / name).read_bytes(), fresh.model, fresh.optimizer,
                                  fresh.scheduler)  # fmt: skip
    assert not marker.exists()
    # A pickle of plain data that is not DCP's metadata: refused too (one line), not an AttributeError later.
    (location / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointError, match=r"\.metadata holds a dict, not DCP's metadata"):
        dcp.read_metadata(str(location))
    (location / ".metadata").write_bytes(real)
    dcp.load(str(location), fresh.model, fresh.optimizer, fresh.scheduler, source="job.yaml")  # the real one loads
    for (name, a), b in zip(t.model.named_parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert fresh.scheduler.state_dict() == t.scheduler.state_dict()


def test_a_raytrn_reader_refuses_to_hand_non_tensor_items_to_dcps_default_planner(tmp_path: Path) -> None:
    """A load that bypasses raytrn.checkpoint.plain.load (DCP's default planner: torch.load(weights_only=False)) is
    a programming error raytrn's readers catch before reading any item."""
    import torch.distributed.checkpoint as tdcp

    j, location, marker = _poisoned(tmp_path)
    fresh = _fresh(j)
    state = dcp.training_state(fresh.model, fresh.optimizer, fresh.scheduler)
    with pytest.raises(BaseException, match="PlainLoadPlanner") as e:  # (DCP's CheckpointException is one)
        tdcp.load(state, storage_reader=dcp.storage_reader(str(location)), no_dist=True)
    assert not marker.exists(), e.value


def test_plain_values_load_as_before() -> None:
    """What raytrn writes as non-tensor items (numbers, strings, None, tuples, lists, dicts) passes the planner."""
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    values = {"a": 3, "b": 0.5, "c": "x", "d": None, "e": (0.9, 0.95), "f": [1, "p"], "g": {"k": True}}
    planner = plain.PlainLoadPlanner()
    planner.set_up_planner({k: object() for k in values}, metadata=None, is_coordinator=True)
    for key, value in values.items():
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        index = MetadataIndex(key)
        item = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))
        planner.load_bytes(item, buffer)
    assert planner.original_state_dict == values
    # What torch's weights-only reader cannot read (a 5,000-digit int: an opcode it does not take) is refused too,
    # saying what it refused.
    buffer = io.BytesIO()
    torch.save(10**5000, buffer)
    buffer.seek(0)
    with pytest.raises(plain.UnsafeItem, match=r"big: torch's weights-only reader refused it: Unsupported operand"):
        planner.load_bytes(ReadItem(LoadItemType.BYTE_IO, MetadataIndex("big"), torch.Size([0]), MetadataIndex("big"),
                                    torch.Size([0]), torch.Size([0])), buffer)  # fmt: skip
