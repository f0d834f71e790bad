"""Sharded, reshardable checkpoints through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards of model and optimizer (``get_state_dict``: no gather to rank 0) into one
directory per checkpoint (:meth:`raytrn.checkpoint.rundir.RunDir.dcp_step`), a local path or ``s3://``. DCP
records every tensor's global shape and which piece each file holds, so a checkpoint written by N workers in
one layout (DDP, FSDP, tensor parallel) loads into M workers in another: each rank reads the pieces its new
shards need. Ray Train records a small directory per checkpoint whose ``meta.json`` points here.

S3 goes through a DCP ``FileSystemBase`` of raytrn's own: listing, metadata and reads through pyarrow's S3
filesystem (as raytrn's data and Ray's storage), writes as boto3 multipart uploads whose parts go up while DCP
is still serializing (:class:`raytrn.storage.S3Upload`). Reading, each file (mapped from local disk, or read
whole from S3) has its tensors read in place (:mod:`raytrn.checkpoint.inplace`). Why, measured:
``docs/performance.md``.
"""

from __future__ import annotations

import io
import logging
import mmap
import os
from collections.abc import Generator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter

from raytrn import storage
from raytrn.checkpoint import plain
from raytrn.checkpoint.inplace import InPlaceReader
from raytrn.errors import CheckpointError
from raytrn.models import build_model
from raytrn.models.lora import apply_lora
from raytrn.one_process import no_dist

if TYPE_CHECKING:
    from raytrn.checkpoint.staging import Staging
    from raytrn.config import JobSpec

log = logging.getLogger(__name__)

METADATA = ".metadata"


# -- storage ---------------------------------------------------------------------------------------


class ArrowFileSystem(FileSystemBase):
    """DCP's file operations on a pyarrow filesystem (S3 here; any pyarrow filesystem works).

    On S3 two file-system rituals are dropped, each a request or more per save: there are no directories to make,
    and the metadata DCP writes as ``.metadata.tmp`` and renames (a copy and a delete on S3) is written straight
    under its name, which is as atomic there: an object appears only once its upload completed, after every data
    file. To DCP the ``.tmp`` file still exists until its rename (a no-op).
    """

    def __init__(self, fs: pafs.FileSystem) -> None:
        self.fs = fs
        self.s3 = isinstance(fs, pafs.S3FileSystem)
        self._renamed: set[str] = set()  # final names of the .tmp files written straight under them (S3)
        self._kept: dict[str, bytes] = {}  # files read whole and kept while a reader needs them (read_whole)

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        path = os.fspath(path)
        if "w" in mode:
            if self.s3:
                tmp = path.endswith(".tmp")
                path = path.removesuffix(".tmp")
                # DCP serializes item by item into the stream; parts go up in background threads meanwhile
                # (storage.S3Upload: boto3's multipart upload; nothing is left behind on an error).
                upload = storage.S3Upload(path)
                try:
                    yield upload
                except BaseException:
                    upload.abort()
                    raise
                upload.finish()
                if tmp:
                    self._renamed.add(path)
            else:
                with self.fs.open_output_stream(path) as stream:
                    yield stream
            return
        # Reading: the whole file in one request. DCP then reads each stored item through torch.load in many
        # small reads, each of which would be a ranged request (measured on the moto server, 136 MB: 23 s that
        # way, about 1 s like this). A rank reads the files holding the pieces it needs: its own after a
        # restart at the same layout, one or two per tensor after a resize. (open_input_file, not
        # open_input_stream: pyarrow 25's stream read() of a whole S3 object took 62 s for the same bytes.)
        yield io.BytesIO(self.read_whole(path))

    def read_whole(self, path: str, *, keep: bool = False) -> bytes:
        """The file at ``path`` in one request (or as kept); ``keep``: kept until :meth:`forget`."""
        data = self._kept.get(path)
        if data is None:
            with self.fs.open_input_file(path) as stream:
                data = stream.read()
            if keep:
                self._kept[path] = data
        return data

    def forget(self, path: str) -> None:
        self._kept.pop(path, None)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        path, new_path = os.fspath(path), os.fspath(new_path)
        if new_path in self._renamed and path == f"{new_path}.tmp":
            self._renamed.discard(new_path)  # written there already
            return
        self.fs.move(path, new_path)

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return os.fspath(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        if not self.s3:
            self.fs.create_dir(os.fspath(path), recursive=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        path = os.fspath(path)
        if path in self._renamed:
            return False  # not renamed yet, as far as DCP knows
        return bool(self.fs.get_file_info(path).type != pafs.FileType.NotFound)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.fs.delete_file(os.fspath(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return [i.path for i in self.fs.get_file_info(pafs.FileSelector(os.fspath(path)))]


class DigestingFileSystem(FileSystemBase):
    """DCP's file operations on ``inner``, keeping the size and sha256 of every file written (by its name in the
    checkpoint directory, after DCP's rename of ``.metadata.tmp``): what the commit manifest records."""

    def __init__(self, inner: FileSystemBase) -> None:
        self.inner = inner
        self.digests: dict[str, tuple[int, str]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        with self.inner.create_stream(path, mode) as stream:
            # An S3 upload hashes its parts off this thread by itself; anything else is hashed as it is written.
            digest = stream if isinstance(stream, storage.S3Upload) else storage.DigestStream(stream)
            yield digest
        self.digests[os.path.basename(os.fspath(path))] = (digest.size, digest.hexdigest())  # complete only

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self.inner.rename(path, new_path)
        digest = self.digests.pop(os.path.basename(os.fspath(path)), None)
        if digest is not None:
            self.digests[os.path.basename(os.fspath(new_path))] = digest

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        return self.inner.concat_path(path, suffix)

    def init_path(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        return self.inner.init_path(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return bool(self.inner.exists(path))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.inner.rm_file(path)

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return list(self.inner.ls(path))  # type: ignore[attr-defined]


class _LocalWriter(FileSystemWriter):
    def __init__(self, path: str, *, thread_count: int) -> None:
        super().__init__(path, thread_count=thread_count)
        self.fs = DigestingFileSystem(self.fs)  # type: ignore[assignment]

    @property
    def digests(self) -> dict[str, tuple[int, str]]:
        return self.fs.digests  # type: ignore[attr-defined,no-any-return]


class _ArrowWriter(FileSystemWriter):
    def __init__(self, fs: pafs.FileSystem, path: str, *, thread_count: int) -> None:
        # sync_files: fsync has no meaning on S3 (an object exists once its upload completed)
        super().__init__(path, thread_count=thread_count, sync_files=False)
        self.fs = DigestingFileSystem(ArrowFileSystem(fs))  # type: ignore[assignment]  # as DCP's FsspecWriter
        self.path = path

    @property
    def digests(self) -> dict[str, tuple[int, str]]:
        return self.fs.digests  # type: ignore[attr-defined,no-any-return]


class _ArrowReader(InPlaceReader):
    """DCP's reader on a pyarrow filesystem (S3): each file read whole in one request, its tensors in place."""

    def __init__(self, fs: pafs.FileSystem, path: str) -> None:
        super().__init__(path)
        self.arrow = ArrowFileSystem(fs)
        self.fs = self.arrow  # type: ignore[assignment]  # (torch types it as its local one; FsspecWriter does the same)
        self.path = path

    def buffer(self, name: str) -> memoryview:
        return memoryview(self.arrow.read_whole(str(self.arrow.concat_path(self.path, name)), keep=True))

    def release(self, name: str) -> None:
        self.arrow.forget(str(self.arrow.concat_path(self.path, name)))


class _LocalReader(InPlaceReader):
    """DCP's reader of a local directory: each file mapped read-only (from the page cache, nothing copied), its
    tensors read in place."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._maps: dict[str, mmap.mmap] = {}

    def buffer(self, name: str) -> memoryview | None:
        with open(os.path.join(self.path, name), "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return None
            try:
                self._maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError:  # a filesystem that cannot map files: DCP reads it
                return None
        return memoryview(self._maps[name])

    def release(self, name: str) -> None:
        mapped = self._maps.pop(name, None)
        if mapped is not None:
            try:
                mapped.close()
            except BufferError:  # a view of it is still alive somewhere: unmapped once that is collected
                pass


def storage_writer(location: str, *, thread_count: int = 1) -> _LocalWriter | _ArrowWriter:
    """The DCP writer for a local path or ``s3://`` URI: one file per rank (plus DCP's ``.metadata``); its
    ``digests`` are the files this rank wrote, ``{name: (size, sha256)}``, once the save is done."""
    if storage.is_remote(location):
        fs, path = storage.filesystem(location)
        return _ArrowWriter(fs, path, thread_count=thread_count)
    return _LocalWriter(storage.filesystem(location)[1], thread_count=thread_count)


def storage_reader(location: str) -> FileSystemReader:
    if storage.is_remote(location):
        fs, path = storage.filesystem(location)
        return _ArrowReader(fs, path)
    return _LocalReader(storage.filesystem(location)[1])


# -- the state -------------------------------------------------------------------------------------


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """What a checkpoint holds, in this rank's layout: model and optimizer state by parameter name (sharded
    tensors as DTensors), the scheduler's counters and the torch RNG state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # Frozen parameters (the base model under LoRA) come from model.init_from at every start: not checkpointed.
    model_state, optim_state = get_state_dict(model, optimizer, options=state_dict_options(model))
    return {
        "model": model_state,
        "optim": optim_state,
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
    }


class LiveState:
    """:func:`training_state` for repeated saves of one training (in-memory snapshots, as often as every step): the
    state dict is built once and kept while the model's and the optimizer's tensors stay the same tensors in the same
    storage (a step updates them in place); each call then refreshes only its plain values (the optimizer's
    hyperparameters, the schedule, the RNG). Tensors replaced (a restore, the optimizer's state created, a parameter
    reassigned) build it again. ``get_state_dict`` walks the module tree for names on every call (~9 ms for the tiny
    model here)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self._state: dict[str, Any] | None = None
        self._built_for: tuple[Any, ...] | None = None
        self.builds = 0  # how often the state dict was built (a test's and a profile's count)

    def __call__(self) -> dict[str, Any]:
        key = self._tensors()
        if self._state is None or key != self._built_for:
            self._state, self._built_for = training_state(self.model, self.optimizer, self.scheduler), key
            self.builds += 1
            return self._state
        mine = self._state["optim"].get("param_groups", [])
        for kept, group in zip(mine, self.optimizer.param_groups, strict=True):  # (their count is in the key)
            kept.update((k, v) for k, v in group.items() if k != "params")  # "params" names them: unchanged
        self._state["scheduler"] = self.scheduler.state_dict()
        self._state["rng"] = torch.get_rng_state()
        return self._state

    def _tensors(self) -> tuple[Any, ...]:
        """What the kept state dict depends on: every parameter's and buffer's identity, storage and shape and
        which are frozen, the optimizer's state tensors', its groups' sizes and their values' types."""
        model = tuple(_where(t) for t in (*self.model.parameters(), *self.model.buffers()))
        optim = tuple(
            (id(p), tuple((k, _where(v)) for k, v in s.items() if isinstance(v, torch.Tensor)))
            for p, s in self.optimizer.state.items()
        )
        # Each group's size and its values' types: a value that becomes a tensor (a tensor learning rate set
        # mid-run) would be passed through staging, not copied, into buffers kept for a plain value.
        groups = tuple(
            (len(g["params"]), tuple((k, type(v)) for k, v in g.items() if k != "params"))
            for g in self.optimizer.param_groups
        )
        return model, id(self.optimizer.state), optim, groups


def _where(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], bool]:
    """A tensor's identity, storage, shape (a DTensor's local shard's) and whether it is trained (frozen parameters
    are not in the state dict)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return id(t), local.data_ptr(), tuple(local.shape), t.requires_grad


def state_dict_options(model: torch.nn.Module) -> Any:
    """State-dict options: frozen parameters left out (and not expected back) when the model has any."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=False) if frozen else None


def save(state: dict[str, Any], location: str) -> dict[str, tuple[int, str]]:
    """Write ``state`` (every rank its shards); the files this rank wrote, ``{name: (size, sha256)}``."""
    writer = storage_writer(location)
    save_state(state, writer)
    return dict(writer.digests)


def save_state(state: dict[str, Any], writer: Any, *, process_group: Any = None, alone: bool = False) -> None:
    """Write ``state`` through any DCP storage writer (a directory's, or memory's: :mod:`raytrn.checkpoint.memfiles`),
    its collectives on ``process_group`` (the default group when None); ``alone``: as one process writes it (the
    whole state, no collective), whatever process group exists."""
    dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=no_dist(alone))


def async_save(
    state: dict[str, Any], location: str, *, process_group: Any, staging: Staging | None = None
) -> tuple[Any, Any, Future[Any] | None]:
    """Write ``state`` in a background thread from a copy in host memory: the write's future, the writer (whose
    ``digests`` are this rank's files once the future is done) and the copy's future. Without ``staging`` the copy is
    made before this returns (None); with it (:class:`raytrn.checkpoint.staging.Staging`) by its thread: nothing may
    change ``state``'s tensors before the copy's future is done."""
    writer = storage_writer(location)
    write, copy = async_save_state(state, writer, process_group=process_group, staging=staging)
    return write, writer, copy


def async_save_state(
    state: dict[str, Any], writer: Any, *, process_group: Any, staging: Staging | None = None
) -> tuple[Any, Future[Any] | None]:
    """:func:`save_state` in the background through ``writer``: the write's future and the copy's (None: ``state``
    was copied to host memory before this returned; with ``staging``, by its thread).

    ``process_group``: a gloo group of its own, so the background thread's collectives never interleave with
    the training step's on the default group.
    """
    stager = None if staging is None else staging.stager
    response = dcp.async_save(
        state, storage_writer=writer, process_group=process_group, no_dist=no_dist(), async_stager=stager
    )
    if isinstance(response, Future):
        return response, None
    return response.upload_completion, response.staging_completion


def load(
    location: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *, source: str
) -> None:
    """Restore a checkpoint written in any layout into this rank's (resharding as needed).

    Refused with one CheckpointError, before anything is read, when a shard file is missing or short, or a
    model tensor's shape differs from the job's model (naming the first such tensor).
    """
    metadata = check_complete(location)
    state = training_state(model, optimizer, scheduler)
    check_shapes(metadata, state["model"], location=location, source=source)
    load_state(storage_reader(location), model, optimizer, scheduler, state=state)


def load_state(
    reader: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *, state: Any = None
) -> None:
    """Read a checkpoint through any DCP storage reader into this rank's model, optimizer, scheduler and RNG
    (resharding as needed). ``state``: this rank's :func:`training_state`, when the caller has it already."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = training_state(model, optimizer, scheduler) if state is None else state
    plain.load(state, reader, no_dist=no_dist())
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=state_dict_options(model),
    )
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])


def read_metadata(location: str) -> Any:
    """DCP's ``.metadata`` of the checkpoint at ``location``; CheckpointError when there is none."""
    try:
        return storage_reader(location).read_metadata()
    except (FileNotFoundError, OSError) as e:
        raise CheckpointError(
            f"checkpoint {location}: no readable {METADATA} ({e}); DCP writes it last, so the save that made this "
            "checkpoint did not finish. Resume from an earlier checkpoint (delete or move this one)"
        ) from None


def check_complete(location: str) -> Any:
    """The checkpoint's metadata, after checking that every file it names exists and is long enough."""
    metadata = read_metadata(location)
    fs, path = storage.filesystem(location)
    sizes = {i.base_name: i.size for i in fs.get_file_info(pafs.FileSelector(path)) if i.type == pafs.FileType.File}
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name in needed if name not in sizes)
    short = sorted(name for name, end in needed.items() if name in sizes and sizes[name] < end)
    if missing or short:
        what = []
        if missing:
            what.append(f"missing {', '.join(missing)}")
        if short:
            what.append(f"truncated {', '.join(short)}")
        raise CheckpointError(
            f"checkpoint {location} is incomplete ({'; '.join(what)} of {len(needed)} shard file(s)); it cannot "
            "be resumed. Restore the files, or resume from an earlier checkpoint (delete or move this one)"
        )
    return metadata


def check_shapes(metadata: Any, model_state: dict[str, Any], *, location: str, source: str) -> None:
    """CheckpointError naming the first model tensor whose saved global shape differs from the job's model."""
    saved = metadata.state_dict_metadata
    for name, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            continue
        key = f"model.{name}"
        entry = saved.get(key)
        shape = tuple(value.shape)  # a DTensor's shape is the global one
        if entry is None or not hasattr(entry, "size"):
            raise CheckpointError(
                f"{source}: checkpoint {location} has no tensor {name!r} that the job's model has; it was written "
                "for another model. Use the job that wrote it, or a new run (tracking.run_name)"
            )
        if tuple(entry.size) != shape:
            raise CheckpointError(
                f"{source}: checkpoint {location}: tensor {name!r} has shape {tuple(entry.size)} but the job's model "
                f"has {shape}; the model section differs from the one the checkpoint was written with. Use that "
                "model's sizes, or start a new run (tracking.run_name)"
            )


def check_resumable(job: JobSpec, location: str) -> None:
    """On the driver, before any worker starts: the checkpoint at ``location`` is complete and was written for
    the job's model (shapes from a model built on the meta device: no memory, no init)."""
    metadata = check_complete(location)
    with torch.device("meta"):
        model = build_model(job.model, seed=0, device="meta")
        if job.model.lora is not None:
            apply_lora(model, job.model.lora, seed=0)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    state = {n: v for n, v in model.state_dict().items() if n in trained}  # LoRA: the adapters only
    check_shapes(metadata, state, location=location, source=job.source)
