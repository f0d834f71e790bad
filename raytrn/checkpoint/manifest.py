"""Checkpoints you can trust: a sharded checkpoint counts only once its commit manifest exists.

Every rank writes its shards into ``<checkpoint.storage>/<run>/dcp/step_<N>`` (:mod:`raytrn.checkpoint.dcp`); while
that directory has no ``commit.json`` it is staging: never resumed, and deleted by the next save's retention once
a newer checkpoint is committed. When every rank's write is done, rank 0 gathers what each wrote (name, size,
sha256, computed while the bytes went out) and writes the manifest last, with the step, the world size, the
layout and the counters a resume needs. On object storage a rename is a copy, so the commit is this one small
write, not a move of the shards.

Resuming (:mod:`raytrn.checkpoint.finder`) takes the newest committed checkpoint whose files match their manifest:
sizes on the driver (a listing), sizes and sha256 on the workers before they load (each rank hashes a share of the
files); a checkpoint that fails is skipped with a warning naming the file, and the one before it is tried.
Retention (``checkpoint.keep_last``) keeps the newest committed ones, so the newest committed checkpoint is never
deleted (``checkpoint.keep_best``: nor the one of the lowest validation loss, which its manifest records); after a run, Ray Train's pointers to checkpoints retention deleted are tidied (:func:`tidy_pointers`).
Paths: :mod:`raytrn.checkpoint.rundir`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow.fs as pafs

from raytrn import jsonfile, storage
from raytrn.checkpoint.pins import pinned
from raytrn.checkpoint.progress import Progress, read_meta
from raytrn.checkpoint.rundir import RunDir
from raytrn.errors import CheckpointError, RaytrnError

log = logging.getLogger(__name__)

COMMIT_FILE = "commit.json"
FORMAT = "raytrn.checkpoint/1"


@dataclass(kw_only=True)
class Commit:
    """What ``commit.json`` says about a complete checkpoint."""

    step: int
    world_size: int
    #: ``data_parallel`` (ddp|fsdp), ``tensor_parallel_size``, ``data_parallel_size``: how it was written (DCP
    #: reshards on load, so any layout resumes it).
    layout: dict[str, Any]
    #: ``{file name: {"size": bytes, "sha256": hex}}``, every file of the checkpoint.
    files: dict[str, dict[str, Any]]
    progress: Progress
    schedule: dict[str, Any] | None = None
    written_at: float = field(default_factory=time.time)
    #: The validation loss evaluated at this step, if one was (``checkpoint.keep_best`` keeps the lowest).
    val_loss: float | None = None

    def to_json(self) -> str:
        data = {"format": FORMAT, **asdict(self)}
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Commit:
        """Parse a manifest; ValueError naming what is wrong with it."""
        data = jsonfile.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
        files = data.get("files")
        if not isinstance(files, dict) or not files:
            raise ValueError("it lists no files")
        for name, entry in files.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or not entry.get("sha256"):
                raise ValueError(f"file {name!r} has no size and sha256")
        try:
            return cls(
                step=int(data["step"]),
                world_size=int(data["world_size"]),
                layout=dict(data.get("layout") or {}),
                files=files,
                progress=Progress.from_dict(data.get("progress") or {}),
                schedule=data.get("schedule") if isinstance(data.get("schedule"), dict) else None,
                written_at=float(data.get("written_at", 0.0)),
                val_loss=None if data.get("val_loss") is None else float(data["val_loss"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad field ({e})") from None


class RetentionSkipped(CheckpointError):
    """Retention deleted nothing: a listing or a read it needs to know what to keep failed (the next save tries
    again)."""


@dataclass(frozen=True)
class Candidate:
    """A committed checkpoint: where it is and its manifest."""

    location: str
    commit: Commit


def write_commit(location: str, commit: Commit) -> None:
    """Commit the checkpoint at ``location`` (retried while the storage is briefly unavailable)."""
    storage.retrying(
        lambda: storage.write_text(storage.join(location, COMMIT_FILE), commit.to_json()), f"commit {location}"
    )


def is_committed(location: str) -> bool:
    fs, path = storage.filesystem(storage.join(location, COMMIT_FILE))
    return bool(fs.get_file_info(path).type == pafs.FileType.File)


def read_commit(location: str) -> Commit | None:
    """The manifest at ``location``: None when there is none (staging); ValueError when it is unreadable."""
    text = storage.read_text(storage.join(location, COMMIT_FILE))
    if text is None:
        return None
    return Commit.from_json(text)


def size_problems(location: str, commit: Commit) -> list[str]:
    """``'name: ...'`` for every file of the manifest that is missing or not its recorded size."""
    fs, path = storage.filesystem(location)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    sizes = {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}
    problems = []
    for name, entry in sorted(commit.files.items()):
        if name not in sizes:
            problems.append(f"{name}: missing")
        elif sizes[name] != entry["size"]:
            problems.append(f"{name}: {sizes[name]} bytes, the manifest says {entry['size']}")
    return problems


def digest_problems(location: str, commit: Commit, names: list[str]) -> list[str]:
    """``'name: ...'`` for each of ``names`` whose bytes are not the manifest's size and sha256 (read whole)."""
    fs, path = storage.filesystem(location)
    problems = []
    for name in names:
        entry = commit.files[name]
        sha, size = hashlib.sha256(), 0
        try:
            with fs.open_input_file(f"{path}/{name}") as f:
                while chunk := f.read(8 << 20):
                    sha.update(chunk)
                    size += len(chunk)
        except OSError as e:
            problems.append(f"{name}: unreadable ({e})")
            continue
        if size != entry["size"] or sha.hexdigest() != entry["sha256"]:
            problems.append(f"{name}: sha256 {sha.hexdigest()[:12]}..., the manifest says {entry['sha256'][:12]}...")
    return problems


def candidates(run: RunDir) -> Iterator[Candidate]:
    """The committed checkpoints of ``run``, newest first, whose files are all there at their recorded sizes.

    A checkpoint without a manifest (a save that never finished) is passed over quietly if it is the newest
    (the usual crash during a save) and with a warning otherwise; one whose manifest is unreadable or does not
    match its files, with a warning naming the file."""
    for step in reversed(run.dcp_steps()):
        location = run.dcp_step(step)
        try:
            commit = read_commit(location)
        except (ValueError, OSError) as e:
            log.warning("checkpoint %s: skipped: its %s is unreadable (%s)", location, COMMIT_FILE, e)
            continue
        if commit is None:
            log.info("checkpoint %s: never committed (its save did not finish): not resumed", location)
            continue
        problems = size_problems(location, commit)
        if problems:
            log.warning(
                "checkpoint %s: skipped: its files do not match its manifest (%s)", location, "; ".join(problems)
            )
            continue
        yield Candidate(location, commit)


def has_commits(run: RunDir) -> bool:
    """Whether any checkpoint of ``run`` was ever committed (a run older than manifests has none)."""
    return any(is_committed(run.dcp_step(step)) for step in run.dcp_steps())


def prune(run: RunDir, *, keep_last: int | None, keep_best: bool = False, keep: Collection[int] = ()) -> list[int]:
    """Retention after a commit: keep the newest ``keep_last`` committed checkpoints (all when None), with
    ``keep_best`` the one of the lowest ``val_loss`` too (:func:`best_step`), those pinned
    (:mod:`raytrn.checkpoint.pins`: an evaluation reads them), the steps ``keep`` (saves in flight the caller knows
    of), and anything newer than the newest committed one (a save in flight); delete older committed ones and
    uncommitted leftovers older than the newest committed one. Only raytrn's ``step_<N>`` directories, strictly
    inside ``run.dcp``. Returns the steps deleted.

    What to keep is settled before anything is deleted: when a listing or a read it needs fails, nothing is deleted
    this time (:class:`RetentionSkipped`; a checkpoint that could not be read may be one to keep)."""
    try:
        steps = run.dcp_steps()
        committed = [s for s in steps if is_committed(run.dcp_step(s))]
        if not committed:
            return []
        kept = set(committed if keep_last is None else committed[-keep_last:])
        kept |= pinned(run) if keep_last is not None else set()  # an evaluation off the loop is reading them
        best = best_step(run, committed) if keep_best and keep_last is not None else None
    except (OSError, CheckpointError) as e:
        raise RetentionSkipped(f"checkpoint retention under {run.dcp} deleted nothing this time: {e}") from None
    kept.update(keep)
    if best is not None:
        kept.add(best)
    deleted = []
    for step in steps:
        if step in kept or step > committed[-1]:
            continue
        _delete(run, step)
        deleted.append(step)
    return deleted


def _delete(run: RunDir, step: int) -> None:
    """Delete ``step``'s checkpoint, its manifest first: stopped half way (a kill, a storage error), what is left is
    never a committed checkpoint with files missing, only an uncommitted leftover (deleted by a later prune)."""
    location = run.dcp_step(step)
    commit = storage.join(location, COMMIT_FILE)
    cfs, cpath = storage.filesystem(commit)
    if cfs.get_file_info(cpath).type == pafs.FileType.File:
        cfs.delete_file(cpath)
    storage.remove_tree(location, run.dcp)


def best_step(run: RunDir, committed: list[int]) -> int | None:
    """Of the ``committed`` steps, the one whose manifest records the lowest ``val_loss`` (the earliest of equal
    ones); None when none records one. A manifest that is not a commit manifest (no resume takes its checkpoint
    either) records none; CheckpointError when one cannot be read: it may be the best."""
    best: tuple[float, int] | None = None
    for step in committed:
        location = run.dcp_step(step)
        try:
            commit = read_commit(location)
        except ValueError:
            continue
        except OSError as e:
            raise CheckpointError(
                f"checkpoint.keep_best: cannot read {storage.join(location, COMMIT_FILE)} ({_first_line(e)}), so the "
                "best checkpoint is not known"
            ) from None
        if commit is not None and commit.val_loss is not None and (best is None or commit.val_loss < best[0]):
            best = (commit.val_loss, step)
    return best[1] if best else None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def clear_staging(run: RunDir, step: int) -> None:
    """Remove what an earlier, unfinished save left in ``step``'s directory before saving there again (a restart
    from an older checkpoint repeats the step; the new world size may write other file names). Its manifest, if
    any, goes first: a resume from an older checkpoint means this one was not usable."""
    location = run.dcp_step(step)
    fs, path = storage.filesystem(location)
    files = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    if not [f for f in files if f.type == pafs.FileType.File]:
        return  # nothing, or only the directory (every rank creates it as its save begins)
    log.warning("checkpoint %s: replacing what an earlier, unfinished or unusable save left there", location)
    _delete(run, step)


def tidy_pointers(run: RunDir) -> list[str]:
    """After a run, delete Ray Train's checkpoint directories (``checkpoint_<N>``, raytrn's ``meta.json`` pointer)
    whose sharded checkpoint is gone: a group that failed right after a save leaves a pointer Ray never registered,
    which Ray's retention never deletes, while raytrn's retention (:func:`prune`) has deleted what it pointed at.
    Done by the driver once ``fit()`` returned (Ray Train holds none of them any more); pointers to committed
    checkpoints are kept. Returns the directories deleted."""
    deleted: list[str] = []
    try:
        steps = run.pointer_steps()
    except CheckpointError as e:  # tidying never fails a run
        log.warning("checkpoints of %s: not tidied: %s", run.root, e)
        return deleted
    for step in steps:
        location = run.pointer(step)
        try:
            meta = read_meta(location)
            target = meta.extra.get("dcp") if meta else None
            if isinstance(target, str) and not is_committed(run.own_dcp(target)):
                storage.remove_tree(location, run.root)
                deleted.append(location)
        except (OSError, ValueError, RaytrnError) as e:  # tidying never fails a run
            log.warning("checkpoint %s: not tidied: %s", location, e)
    return deleted


def describe(candidate: Candidate) -> str:
    c = candidate.commit
    return f"{candidate.location} (step {c.step}, {c.world_size} workers, {len(c.files)} files)"


def corrupt_error(run: RunDir, rejected: list[str]) -> CheckpointError:
    return CheckpointError(
        f"every committed checkpoint under {run.dcp} failed its check ({'; '.join(rejected)}); raytrn will not silently "
        "start over. Restore the files, or move the run's checkpoints away (or set tracking.run_name) to start a new "
        "run"
    )
