"""raytrn.checkpoint.inplace: a tensor read in place from one ``torch.save`` (as DCP writes each item) equals what
``torch.load`` gives, shares the buffer's memory, and anything else is left to ``torch.load``; a restore through
the in-place reader reads every tensor item in place."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from raytrn.checkpoint import inplace, memfiles
from raytrn.checkpoint.inplace import tensor_in_place

pytestmark = pytest.mark.unit


def _saved(obj: object) -> memoryview:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    array = np.frombuffer(buffer.getvalue(), dtype=np.uint8)  # read-only, as Ray's object store hands files back
    return memoryview(array)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(5, 7),
        torch.randn(4, 6).to(torch.bfloat16),
        torch.arange(11, dtype=torch.int64),
        torch.tensor(3.5),  # 0-d: a scheduler's or optimizer's step
        torch.randn(6, 8).t(),  # another stride
        torch.randn(10)[3:7].clone(),
        torch.tensor([True, False, True]),
    ],
    ids=["f32", "bf16", "i64", "scalar", "transposed", "slice", "bool"],
)
def test_a_tensor_read_in_place_equals_torch_load_and_copies_nothing(tensor: torch.Tensor) -> None:
    blob = _saved(tensor)
    expected = torch.load(io.BytesIO(blob.tobytes()), weights_only=True)
    got = tensor_in_place(blob)
    assert got is not None
    assert got.dtype == expected.dtype and got.shape == expected.shape and got.stride() == expected.stride()
    assert torch.equal(got, expected)
    start = np.frombuffer(blob, dtype=np.uint8).ctypes.data
    assert start <= got.untyped_storage().data_ptr() < start + len(blob)  # a view of the buffer, not a copy


def test_what_is_not_one_plain_tensor_is_left_to_torch_load() -> None:
    assert tensor_in_place(_saved(torch.empty(0))) is None  # nothing to view
    assert tensor_in_place(_saved({"a": torch.ones(2)})) is None  # not a tensor
    assert tensor_in_place(_saved([1, 2])) is None
    assert tensor_in_place(memoryview(b"not a zip archive")) is None
    assert tensor_in_place(memoryview(pickle.dumps(torch.ones(2)))) is None  # the legacy, non-zip format


def test_a_restore_from_memory_reads_every_tensor_in_place(tmp_path: Path, monkeypatch) -> None:
    """The snapshot's tensor items are raw bytes, all read in place (none falls back to torch.load), and the
    restore is exact: the memory tier's restore tests cover the weights, moments, schedule and RNG."""
    from raytrn.backends.cpu import CpuBackend
    from raytrn.train.build import build_training
    from tests.unit.test_dcp import job, trained
    from tests.unit.test_memory_tier import snapshot_files

    j = job(tmp_path)
    t = trained(j)
    files = snapshot_files(t)
    in_place: list[torch.Tensor] = []

    assert files and all(name.endswith(inplace.RAW_SUFFIX) for name in files if name != ".metadata"), sorted(files)
    raw = inplace.InPlaceReader._raw

    def counted(self: inplace.InPlaceReader, req: object, blob: memoryview) -> torch.Tensor:
        got = raw(self, req, blob)
        assert got.untyped_storage().data_ptr() == torch.frombuffer(blob, dtype=torch.uint8).data_ptr()  # a view
        in_place.append(got)
        return got

    monkeypatch.setattr(inplace.InPlaceReader, "_raw", counted)
    loads: list[object] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    fresh = build_training(j, CpuBackend(), world_size=1)
    memfiles.load_from_memory(lambda name: files[name], fresh.model, fresh.optimizer, fresh.scheduler)
    assert len(in_place) >= 2 * len(list(t.model.parameters()))  # weights and both moments
    assert all(isinstance(a[0], io.BytesIO) for a in loads)  # torch.load saw only the byte items (schedule, RNG)
    for (name, a), b in zip(t.model.named_parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_restore_from_local_disk_reads_every_tensor_in_place_from_the_mapped_files(
    tmp_path: Path, monkeypatch
) -> None:
    """The durable reader of a local directory maps each file and reads its tensors in place too, exactly, and
    unmaps the file once read."""
    from raytrn.backends.cpu import CpuBackend
    from raytrn.checkpoint import dcp
    from raytrn.train.build import build_training
    from tests.unit.test_dcp import job, trained

    j = job(tmp_path)
    t = trained(j)
    location = str(tmp_path / "ckpt")
    dcp.save(dcp.training_state(t.model, t.optimizer, t.scheduler), location)
    in_place: list[torch.Tensor] = []
    monkeypatch.setattr(inplace, "tensor_in_place", lambda blob: in_place.append(tensor_in_place(blob)) or in_place[-1])
    reader = dcp.storage_reader(location)
    fresh = build_training(j, CpuBackend(), world_size=1)
    dcp.load_state(reader, fresh.model, fresh.optimizer, fresh.scheduler)
    assert len(in_place) >= 2 * len(list(t.model.parameters())) and all(x is not None for x in in_place)
    assert not reader._maps  # every mapping released
    for (name, a), b in zip(t.model.named_parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    moments = [s["exp_avg_sq"] for s in t.optimizer.state.values()]
    back = [s["exp_avg_sq"] for s in fresh.optimizer.state.values()]
    assert len(moments) == len(back) > 0 and all(torch.equal(a, b) for a, b in zip(moments, back, strict=True))


def test_a_tensor_with_its_conjugate_bit_set_is_left_to_torch_load_and_restores_conjugated(tmp_path: Path) -> None:
    """torch.save keeps a conjugate view's bit in its metadata, not in the bytes: read in place it would come back
    unconjugated. It goes through torch.load, and a DCP round trip through the local reader restores it exactly."""
    import torch.distributed.checkpoint as torch_dcp

    from raytrn.checkpoint import dcp

    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1).conj()
    assert z.is_conj()
    assert tensor_in_place(_saved(z)) is None
    dcp.save({"w": z}, str(tmp_path / "c"))
    back = {"w": torch.zeros(4, dtype=torch.complex64)}
    torch_dcp.load(back, storage_reader=dcp.storage_reader(str(tmp_path / "c")), no_dist=True)
    assert torch.equal(back["w"], z.resolve_conj())


def test_a_record_not_where_the_directory_says_is_left_to_torch_load() -> None:
    blob = bytearray(_saved(torch.arange(6.0)).tobytes())
    info = [i for i in zipfile.ZipFile(io.BytesIO(bytes(blob))).infolist() if i.filename.endswith("/0")][0]
    blob[info.header_offset : info.header_offset + 4] = b"XXXX"  # the storage record's local header, broken
    assert tensor_in_place(memoryview(bytes(blob))) is None


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(5, 7),
        torch.randn(4, 6).to(torch.bfloat16),
        torch.arange(11, dtype=torch.int64),
        torch.tensor(3.5),
        torch.randn(6, 8).t(),  # not contiguous: copied in row-major order
        torch.randn(10)[3:7],  # a view at an offset of a larger storage: its own elements only
        torch.tensor([True, False, True]),
        torch.randn(3, 2, dtype=torch.complex64).conj(),  # the conjugate bit resolved into the bytes
        torch.empty(0, 4),
    ],
    ids=["f32", "bf16", "i64", "scalar", "transposed", "view", "bool", "conj", "empty"],
)
def test_a_raw_snapshot_item_round_trips_exactly_as_a_view(tensor: torch.Tensor) -> None:
    """The memory tier's raw items: a tensor's elements in row-major order, read back by the chunk's dtype and size
    (from the checkpoint's metadata) as a view of the stored bytes."""
    from types import SimpleNamespace

    stored = inplace.raw_tensor(tensor).numpy().tobytes()
    assert len(stored) == tensor.numel() * tensor.element_size()
    blob = memoryview(np.frombuffer(stored, dtype=np.uint8))  # read-only, as Ray's object store hands files back
    reader = inplace.InPlaceReader("unused")
    reader._chunks = {("w", (0,) * tensor.dim()): (tensor.dtype, tensor.size())}
    req = SimpleNamespace(storage_index=SimpleNamespace(fqn="w", offset=torch.Size((0,) * tensor.dim())))
    got = reader._raw(req, blob)
    assert got.dtype == tensor.dtype and got.size() == tensor.size()
    assert torch.equal(got, tensor.resolve_conj()) and not got.is_conj()
    if tensor.numel():
        assert got.data_ptr() == torch.frombuffer(blob, dtype=torch.uint8).data_ptr()  # a view, nothing copied
    with pytest.raises(ValueError, match="bytes stored"):
        reader._raw(req, memoryview(np.frombuffer(stored + b"\0" * 8, dtype=np.uint8)))


def test_every_raw_item_of_a_snapshot_file_starts_64_byte_aligned(tmp_path: Path) -> None:
    from tests.unit.test_dcp import job, trained
    from tests.unit.test_memory_tier import snapshot_files

    files = snapshot_files(trained(job(tmp_path)))
    reader = memfiles._MemoryReader(memfiles.MemoryFileSystem(fetch=lambda name: files[name]))
    metadata = reader.read_metadata()
    raw = [info for info in metadata.storage_data.values() if info.relative_path.endswith(inplace.RAW_SUFFIX)]
    assert raw and all(info.offset % 64 == 0 for info in raw)
