"""Checkpoints kept from retention while something reads them off the training loop (an evaluation's export).

A pin is ``<run>/pins/step_<N>.json`` with the time it lapses: :func:`raytrn.checkpoint.manifest.prune` keeps a
pinned step (a lapsed pin, of a reader that died, is ignored: the checkpoint goes at the next save). Rank 0 pins a
checkpoint as it commits it, when the job evaluates off the loop (before any later save can prune it); the evaluator
unpins it when its work is done, skipped, or not wanted; only these pin files, by name, are removed.
"""

from __future__ import annotations

import json
import logging
import re
import time

from raytrn import jsonfile, storage
from raytrn.checkpoint.rundir import STEP_NUMBER, RunDir
from raytrn.config import JobSpec
from raytrn.errors import CheckpointError

log = logging.getLogger(__name__)

_PIN = re.compile(rf"^step_{STEP_NUMBER}\.json$")


def pin_ttl_s(job: JobSpec) -> float:
    """How long a checkpoint waits pinned for its evaluation at most: two evaluations' time and an hour (an MLflow
    outage delays the evaluator's cue)."""
    return 2 * job.eval.timeout_s + 3600


def pin(run: RunDir, step: int, *, ttl_s: float) -> None:
    """Keep the checkpoint of ``step`` for ``ttl_s`` seconds (or until :func:`unpin`)."""
    storage.write_text(_path(run, step), json.dumps({"step": step, "until": time.time() + ttl_s}))


def unpin(run: RunDir, step: int) -> None:
    """Remove the pin of ``step`` (the one file this module wrote; nothing when absent)."""
    fs, path = storage.filesystem(_path(run, step))
    try:
        fs.delete_file(path)
    except (OSError, FileNotFoundError) as e:  # absent, or the storage is down: it lapses anyway
        log.debug("pin of step %d not removed: %s", step, e)


def pinned(run: RunDir) -> set[int]:
    """The steps pinned now (lapsed pins and files that are not pins are not). CheckpointError when the pins cannot
    be listed or one cannot be read: retention must then keep everything (a pin it missed would lose a checkpoint
    an evaluation is reading)."""
    fs, root = storage.filesystem(run.pins)
    from pyarrow import fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError as e:
        raise _unreadable(run.pins, e) from None
    out, now = set(), time.time()
    for info in infos:
        name = info.path.rsplit("/", 1)[-1]
        match = _PIN.match(name)
        if not match:
            continue
        path = storage.join(run.pins, name)
        try:
            text = storage.read_text(path)
        except OSError as e:
            raise _unreadable(path, e) from None
        try:
            if jsonfile.loads(text or "{}").get("until", 0) > now:
                out.add(int(match.group(1)))
        except (ValueError, AttributeError):  # not a pin raytrn wrote
            continue
    return out


def _unreadable(path: str, error: OSError) -> CheckpointError:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return CheckpointError(
        f"cannot read the checkpoint pins ({path}: {first}), so which checkpoints are pinned is not known"
    )


def _path(run: RunDir, step: int) -> str:
    return storage.join(run.pins, f"{RunDir.step_name(step)}.json")
