"""One job per run at a time: a lease on the run's directory, held by the driver from start to end.

Two jobs with the same run name and ``checkpoint.storage`` at once damage each other (one's staging cleanup deletes
the other's committed step, each prunes the other's checkpoints, both attach to one MLflow run). The driver takes
``<run>/raytrn-lease.json`` before it reads or writes anything of the run: created only if absent (``O_EXCL``
locally, a conditional put ``If-None-Match: *`` on S3), renewed every :data:`HEARTBEAT_S` by a background thread
(only while it is still ours: ``If-Match`` its ETag on S3), deleted at the end. A second job is refused (exit 2)
naming the holder. A holder whose process on this very machine is gone (a driver killed by SIGKILL) is replaced at
once; one whose heartbeat stopped :data:`STALE_AFTER_S` ago (another machine: a lost laptop, a head node gone) is
stale, and ``--take-over`` replaces it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from raytrn import storage
from raytrn.checkpoint.rundir import LEASE_FILE, RunDir
from raytrn.errors import RaytrnError

log = logging.getLogger(__name__)

__all__ = ["LEASE_FILE", "Lease", "LeaseError", "acquire"]
#: How often the holder renews its lease, and how long after the last renewal it is stale.
HEARTBEAT_S = 30.0
STALE_AFTER_S = 180.0


class LeaseError(RaytrnError):
    """Another job holds the run."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run: the driver's host and pid, when it started, its last heartbeat, and a token of its own."""

    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    token: str
    job: str = ""  # the Ray job submission id, when there is one

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(
                host=str(data["host"]),
                pid=int(data["pid"]),
                started_at=float(data["started_at"]),
                heartbeat_at=float(data["heartbeat_at"]),
                token=str(data["token"]),
                job=str(data.get("job", "")),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self, now: float) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        job = f", job {self.job}" if self.job else ""
        return f"host {self.host}, pid {self.pid}{job}, started {started}, last heartbeat {now - self.heartbeat_at:.0f} s ago"

    def gone(self) -> bool:
        """A driver of this machine whose process is gone: certainly not training."""
        return self.host == socket.gethostname() and not _pid_alive(self.pid)

    def stale(self, now: float) -> bool:
        """No heartbeat for :data:`STALE_AFTER_S`, or :meth:`gone`."""
        return now - self.heartbeat_at > STALE_AFTER_S or self.gone()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class Lease:
    """The lease this driver holds on ``run`` (:func:`acquire`); :meth:`release` ends it."""

    def __init__(self, run: RunDir, holder: Holder, etag: str | None, created_dirs: list[str] | None = None) -> None:
        self.run, self.holder, self._etag = run, holder, etag
        self.path = run.lease
        #: Local directories made for the lease file, deepest first: removed again at release if still empty (a
        #: job refused before it wrote anything leaves nothing behind).
        self.created_dirs = list(created_dirs or [])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="raytrn-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.renew()
            except Exception as e:  # a missed heartbeat is a warning; the lease goes stale only after several
                log.warning("run lease %s: heartbeat failed: %s", self.path, e)

    def renew(self) -> None:
        """Write a new heartbeat, only while the lease is still this driver's."""
        holder = Holder(**{**asdict(self.holder), "heartbeat_at": time.time()})
        if storage.is_remote(self.path):
            self._etag = _s3_put(self.path, holder, if_match=self._etag)
        else:
            current = Holder.parse(storage.read_text(self.path) or "")
            if current is None or current.token != self.holder.token:
                raise LeaseError(f"{self.path}: the lease was taken over by another job ({current})")
            _local_replace(self.path, holder)
        self.holder = holder

    def release(self) -> None:
        """Stop the heartbeat and delete the lease (only if it is still this driver's)."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            current = Holder.parse(storage.read_text(self.path) or "")
            if current is not None and current.token == self.holder.token:
                fs, inner = storage.filesystem(self.path)
                fs.delete_file(inner)
        except OSError as e:  # it goes stale on its own
            log.warning("run lease %s: not released (%s); it goes stale in %.0f s", self.path, e, STALE_AFTER_S)
        for d in self.created_dirs:
            try:
                os.rmdir(d)  # only if empty: the run wrote nothing else
            except OSError:
                break


def acquire(run: RunDir, *, take_over: bool = False, job: str = "") -> Lease:
    """Take the lease on ``run``; LeaseError (exit 2) naming the holder when another job has it (a stale one only
    with ``take_over``)."""
    path = run.lease
    now = time.time()
    mine = Holder(
        host=socket.gethostname(), pid=os.getpid(), started_at=now, heartbeat_at=now, token=uuid.uuid4().hex, job=job
    )
    missing = _missing_dirs(path)
    created = _create(path, mine)
    if created is not None:
        return Lease(run, mine, created or None, created_dirs=missing)
    text = storage.read_text(path) or ""
    held = Holder.parse(text)
    if held is not None and not held.stale(now):
        raise LeaseError(
            f"run '{run.run}' under {run.storage} is in use by another job ({held.describe(now)}): two jobs on one run "
            "delete each other's checkpoints. Wait for it to end, or give this job another tracking.run_name"
        )
    if not take_over and not (held is not None and held.gone()):  # a dead process of this machine: taken over
        what = f"its holder is gone ({held.describe(now)})" if held else "it is unreadable"
        raise LeaseError(
            f"run '{run.run}' under {run.storage} has a stale lease ({path}): {what}. If no job is training this run, "
            "run again with --take-over"
        )
    _take_over(path, mine, text)
    log.warning("run lease %s: taken over from %s", path, held.describe(now) if held else "an unreadable lease")
    return Lease(run, mine, _s3_etag(path) if storage.is_remote(path) else None)


def _missing_dirs(path: str) -> list[str]:
    """The local directories above ``path`` that do not exist yet, deepest first (none on S3)."""
    if storage.is_remote(path):
        return []
    out, d = [], os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(d):
        out.append(d)
        d = os.path.dirname(d)
    return out


def _create(path: str, holder: Holder) -> str | None:
    """Create the lease file if it does not exist: its ETag on S3 ("" locally), None when it exists."""
    if storage.is_remote(path):
        try:
            return _s3_put(path, holder, if_none_match=True)
        except _Precondition:
            return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(holder)))
    return ""


def _take_over(path: str, holder: Holder, seen: str) -> None:
    """Replace the stale lease read as ``seen``; LeaseError if it changed meanwhile (another job took it)."""
    if storage.is_remote(path):
        try:
            _s3_put(path, holder, if_match=_s3_etag(path, expect=seen))
        except _Precondition:
            raise LeaseError(f"{path}: another job took the run over first") from None
        return
    if (storage.read_text(path) or "") != seen:
        raise LeaseError(f"{path}: another job took the run over first")
    _local_replace(path, holder)


def _local_replace(path: str, holder: Holder) -> None:
    tmp = f"{path}.{holder.token}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(asdict(holder)))
    os.replace(tmp, path)


# -- S3: conditional writes (boto3; pyarrow has none) ----------------------------------------------------------


class _Precondition(Exception):
    """S3 answered 412: the condition of a conditional put failed."""


def _s3_client() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(retries={"mode": "standard", "total_max_attempts": 3}))


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path[len("s3://") :].partition("/")
    return bucket, key


def _s3_put(path: str, holder: Holder, *, if_none_match: bool = False, if_match: str | None = None) -> str:
    from botocore.exceptions import ClientError

    bucket, key = _split(path)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Body": json.dumps(asdict(holder)).encode()}
    if if_none_match:
        kwargs["IfNoneMatch"] = "*"
    if if_match:
        kwargs["IfMatch"] = if_match
    try:
        return str(_s3_client().put_object(**kwargs)["ETag"])
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
            raise _Precondition() from None
        raise


def _s3_etag(path: str, expect: str | None = None) -> str:
    """The lease object's ETag (LeaseError when its body is no longer ``expect``)."""
    bucket, key = _split(path)
    got = _s3_client().get_object(Bucket=bucket, Key=key)
    if expect is not None and got["Body"].read().decode() != expect:
        raise LeaseError(f"{path}: another job took the run over first")
    return str(got["ETag"])
