"""The one finder of the checkpoint a run resumes from, used by the driver and by the workers.

:func:`newest_committed` is the rule: the newest committed checkpoint of the run whose files are there at their
recorded sizes (and pass a further check, if any); a checkpoint that fails is skipped with a warning naming the
file and the one before it is tried; CheckpointError when the run has committed checkpoints and every one fails
(nothing is silently started over); None when it has none.

- The driver (:func:`latest_checkpoint`) applies it with sizes only (a listing), before any worker starts, to
  say where the run resumes and pin its schedule; for a run without commit manifests (an older raytrn) it falls
  back to Ray Train's newest recorded checkpoint (:func:`newest_pointer`, the frozen XLA path's only rule).
- The workers (:func:`resume_point`, a collective) apply it to the candidates rank 0 lists, one at a time (only
  as far as the one resumed: a restart does not read every checkpoint's manifest), with ``checkpoint.verify:
  sha256`` each rank hashing a share of a candidate's files.

Which of these a backend's checkpoints use, and what the workers do with the answer: :mod:`raytrn.checkpoint.resume`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from raytrn.checkpoint import manifest
from raytrn.checkpoint.manifest import Candidate
from raytrn.checkpoint.progress import Meta, read_meta
from raytrn.checkpoint.rundir import RunDir

if TYPE_CHECKING:
    from raytrn.config import JobSpec

log = logging.getLogger(__name__)


def newest_committed(
    run: RunDir,
    *,
    candidates: Iterable[Candidate] | None = None,
    check: Callable[[Candidate], list[str]] | None = None,
    has_commits: Callable[[], bool] | None = None,
    report: bool = True,
) -> Candidate | None:
    """The newest committed checkpoint of ``run`` whose files are there at their sizes and pass ``check`` (its
    problems, ``'name: ...'``; None: sizes only), or None when the run has none committed.

    ``candidates`` and ``has_commits``: what a listing of ``run`` already found (default: list it now, lazily, so
    the sizes of older checkpoints are read only when a newer one fails); ``report``: warn of the skipped ones
    (rank 0 only, when every rank runs this). CheckpointError when every committed checkpoint fails."""
    rejected: list[str] = []
    for candidate in manifest.candidates(run) if candidates is None else candidates:
        problems = check(candidate) if check is not None else []
        if not problems:
            return candidate
        if report:
            log.warning(
                "checkpoint %s: skipped: its files do not match its manifest (%s); trying the one before",
                candidate.location,
                "; ".join(problems),
            )
        rejected.append(f"{candidate.location}: {problems[0]}")
    if manifest.has_commits(run) if has_commits is None else has_commits():
        raise manifest.corrupt_error(run, rejected or ["no committed checkpoint has all its files (see the warnings)"])
    return None


def latest_checkpoint(job: JobSpec) -> tuple[Meta | None, str | None]:
    """The driver's answer: what the checkpoint this run resumes from says (counters, schedule) and where it is,
    or (None, None). The newest committed one whose files are there (the workers check their bytes too), else, for
    a run without commit manifests (an older raytrn's), Ray Train's newest recorded one."""
    run = RunDir.of(job)
    found = newest_committed(run)
    if found is not None:
        c = found.commit
        meta = Meta(progress=replace(c.progress), schedule=c.schedule, extra={"dcp": found.location})
        return meta, found.location
    return newest_pointer(run)


def newest_pointer(run: RunDir) -> tuple[Meta | None, str | None]:
    """Ray Train's newest recorded checkpoint of ``run`` with a readable ``meta.json``, and where it is."""
    for step in reversed(run.pointer_steps()):
        location = run.pointer(step)
        try:
            meta = read_meta(location)
        except ValueError as e:  # a damaged meta.json: the one before it
            log.warning("checkpoint %s: unreadable meta.json (%s)", location, e)
            continue
        if meta is not None:
            return meta, location
    return None, None


def resume_point(job: JobSpec, *, rank: int, world_size: int, snapshot: int | None = None) -> Candidate | None:
    """The workers' answer: the committed checkpoint this worker group resumes from, or None when the run has none
    (a new run, one whose first save never finished, or one older than commit manifests: Ray Train's own
    checkpoint is then the one). A collective: every rank calls it, at the start.

    Rank 0 lists the committed checkpoints whose files are there at their sizes, newest first, and hands them to
    every rank one at a time; with ``checkpoint.verify: sha256`` every rank then hashes a share of each candidate's
    files, until one passes (:func:`newest_committed`). The listing stops at the one resumed: the manifests of
    older checkpoints are read only when a newer one fails.

    ``snapshot``: the step of a state the group restores instead when the newest committed checkpoint is not newer
    (an in-memory snapshot: the same state at the same step, read from memory). Then the storage is listed and that
    checkpoint's manifest read, none of its files (it is returned unchecked, to be named; a restart that does need
    it finds it again and checks it). With no
    committed checkpoint that passes the size check, the full rule applies: CheckpointError when the run has
    committed ones (the snapshot may be older than them)."""
    from raytrn.checkpoint import agree  # torch.distributed: the driver imports this module and never needs torch

    run = RunDir.of(job)
    listing: list[Any] = [None, False, False]
    listed: Iterator[Candidate] = iter(())
    if rank == 0:
        listed = manifest.candidates(run)  # lazily: read only as far as the one resumed
        newest = next(listed, None)
        older = newest is not None and snapshot is not None and newest.commit.step <= snapshot
        listing = [newest, newest is not None or manifest.has_commits(run), older]
    newest, any_commits, older = agree.broadcast(listing)
    if older:
        return newest  # type: ignore[no-any-return]

    def one_at_a_time() -> Iterator[Candidate]:
        """Rank 0's candidates on every rank, in step (a broadcast each: every rank iterates as far as the others,
        since the checks' outcomes are agreed). None at all: CheckpointError below when the run has commits."""
        candidate = newest
        while candidate is not None:
            yield candidate
            (candidate,) = agree.broadcast([next(listed, None)])

    def sha256(candidate: Candidate) -> list[str]:
        names = sorted(candidate.commit.files)[rank::world_size]
        mine = manifest.digest_problems(candidate.location, candidate.commit, names)
        return [p for problems in agree.gather(mine) for p in problems]

    check = sha256 if job.checkpoint.verify == "sha256" else None
    candidates = one_at_a_time()
    return newest_committed(run, candidates=candidates, check=check, has_commits=lambda: any_commits, report=rank == 0)
