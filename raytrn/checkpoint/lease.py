"""One job per run at a time: a lease on the run's directory, held by the driver from start to end.

Two jobs with the same run name and ``checkpoint.storage`` at once damage each other (one's staging cleanup deletes
the other's committed step, each prunes the other's checkpoints, both attach to one MLflow run). The driver takes
``<run>/raytrn-lease.json`` before it reads or writes anything of the run: created only if absent (``O_EXCL``
locally, a conditional put ``If-None-Match: *`` on S3), renewed every :data:`HEARTBEAT_S` by a background thread
(only while it is still ours: its token locally, ``If-Match`` its ETag on S3), deleted at the end. A second job is
refused (exit 2) naming the holder.

Stale or gone:

- **Stale**: not renewed for :data:`STALE_AFTER_S`, judged by the store's own clock, never by comparing this
  machine's clock with the holder's: the lease file's modification time against that of a probe file written next
  to it just now (S3's ``LastModified`` on S3). ``--take-over`` replaces a stale lease.
- **Gone**: a holder on this very machine (the same host name, boot and process namespace: not merely a host of the
  same name, such as another container) whose process has ended (a driver killed by SIGKILL): replaced at once.
  Anything else with a fresh heartbeat is held, whatever its pid looks like from here.

Taking over is atomic: locally the taker holds ``raytrn-lease.json.takeover`` (created with ``O_EXCL``) while it
checks that the lease is still the stale one it read and replaces it; on S3 the replacement is a put ``If-Match``
the stale lease's ETag. Of several jobs taking over one stale lease, one wins; the others are refused.

A holder whose lease was taken over (it was frozen or cut off for longer than :data:`STALE_AFTER_S`) learns it within
:data:`CHECK_S` (it reads its lease between heartbeats; :meth:`Lease.watch`): its run stops at the next step, FAILED, naming the new holder, and writes
nothing more (:class:`LeaseLost`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from raytrn import jsonfile, storage
from raytrn.checkpoint.rundir import LEASE_FILE, RunDir
from raytrn.errors import RaytrnError, RunStopped

log = logging.getLogger(__name__)

__all__ = ["LEASE_FILE", "Lease", "LeaseError", "LeaseLost", "acquire"]
#: How often the holder renews its lease, and how long after the last renewal it is stale (by the store's clock).
HEARTBEAT_S = 30.0
STALE_AFTER_S = 180.0
#: How often the holder reads its lease between heartbeats, to learn of a take-over (a read: a stat and a small file
#: locally, one GET on S3): a job whose lease was taken over trains on (never logs or saves) at most this long.
CHECK_S = 5.0
#: A take-over's lock older than this (by the store's clock) was left by a taker that died while taking over.
TAKEOVER_LOCK_STALE_S = 60.0


class LeaseError(RaytrnError):
    """Another job holds the run, or the lease cannot be read or written."""


class LeaseLost(RunStopped):
    """This job's lease was taken over by another job: the run stops, FAILED, writing nothing more."""


def machine_id() -> str:
    """This machine as a lease names it: the host name, the boot id and the process namespace (two containers of
    one host name differ in the last two; a pid means something only where all three match)."""
    parts = [socket.gethostname()]
    for read in (
        lambda: open("/proc/sys/kernel/random/boot_id").read().strip(),
        lambda: str(os.stat("/proc/self/ns/pid").st_ino),
    ):
        try:
            parts.append(read())
        except OSError:
            parts.append("?")
    return "/".join(parts)


@dataclass(frozen=True)
class Holder:
    """Who holds a run: the driver's host and pid, when it started, its last heartbeat (its own clock: shown, never
    compared), a token of its own, and the machine it runs on (:func:`machine_id`)."""

    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    token: str
    job: str = ""  # the Ray job submission id or a sweep's trial, when there is one
    machine: str = ""
    beats: int = 0  # heartbeats written so far

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            data = jsonfile.loads(text)
            return cls(
                host=str(data["host"]),
                pid=int(data["pid"]),
                started_at=float(data["started_at"]),
                heartbeat_at=float(data["heartbeat_at"]),
                token=str(data["token"]),
                job=str(data.get("job", "")),
                machine=str(data.get("machine", "")),
                beats=int(data.get("beats", 0)),
            )
        except (ValueError, KeyError, TypeError, RecursionError):
            return None

    def describe(self, age_s: float | None = None) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        job = f", job {self.job}" if self.job else ""
        beat = f", last heartbeat {age_s:.0f} s ago" if age_s is not None else ""
        return f"host {self.host}, pid {self.pid}{job}, started {started}{beat}"

    def gone(self) -> bool:
        """A driver of this very machine whose process is gone: certainly not training."""
        return bool(self.machine) and self.machine == machine_id() and not _pid_alive(self.pid)


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
        #: Set once the lease was found taken over by another job: this job must stop.
        self.lost: LeaseLost | None = None
        self._on_lost: list[Callable[[LeaseLost], Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="raytrn-lease", daemon=True)
        self._thread.start()

    def watch(self, on_lost: Callable[[LeaseLost], Any]) -> None:
        """Call ``on_lost`` (in the heartbeat's thread) when the lease is found taken over; at once if it was."""
        with self._lock:
            lost = self.lost
            if lost is None:
                self._on_lost.append(on_lost)
        if lost is not None:
            on_lost(lost)

    def _beat(self) -> None:
        renewed = time.monotonic()
        while not self._stop.wait(min(CHECK_S, HEARTBEAT_S)):
            try:
                if time.monotonic() - renewed >= HEARTBEAT_S:
                    self.renew()
                    renewed = time.monotonic()
                else:
                    self.check()
            except LeaseLost as e:
                log.error("%s", e)
                with self._lock:
                    self.lost, callbacks = e, list(self._on_lost)
                for call in callbacks:
                    try:
                        call(e)
                    except Exception as err:  # (the board gone: the run is ending anyway)
                        log.warning("run lease %s: could not stop the run: %s", self.path, err)
                return
            except Exception as e:  # a missed heartbeat is a warning; the lease goes stale only after several
                log.warning("run lease %s: heartbeat failed: %s", self.path, e)

    def renew(self) -> None:
        """Write a new heartbeat, only while the lease is still this driver's; LeaseLost naming the new holder when
        another job took it over."""
        holder = Holder(**{**asdict(self.holder), "heartbeat_at": time.time(), "beats": self.holder.beats + 1})
        if storage.is_remote(self.path):
            try:
                self._etag = _s3_put(self.path, holder, if_match=self._etag)
            except _Precondition:
                raise self._taken_over(Holder.parse(_read(self.path) or "")) from None
        else:
            with _locked(self.path, holder):  # (a take-over in the same moment: one of the two, not both)
                current = Holder.parse(_read(self.path) or "")
                if current is None or current.token != self.holder.token:
                    raise self._taken_over(current)
                _local_replace(self.path, holder)
        self.holder = holder

    def check(self) -> None:
        """LeaseLost naming the new holder when the lease is no longer this driver's (a read, no write)."""
        current = Holder.parse(_read(self.path) or "")
        if current is None or current.token != self.holder.token:
            raise self._taken_over(current)

    def _taken_over(self, by: Holder | None) -> LeaseLost:
        who = f"by another job ({by.describe()})" if by is not None else "(the lease is gone or unreadable)"
        return LeaseLost(
            f"run '{self.run.run}' under {self.run.storage}: this job's lease was taken over {who}: the run is that "
            "job's now, so this one stops without saving (FAILED). Run it again once the other job ended, or give it "
            "another tracking.run_name"
        )

    def release(self) -> None:
        """Stop the heartbeat and delete the lease (only if it is still this driver's)."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            with contextlib.nullcontext() if storage.is_remote(self.path) else _locked(self.path, self.holder):
                current = Holder.parse(_read(self.path) or "")
                if current is not None and current.token == self.holder.token:
                    fs, inner = storage.filesystem(self.path)
                    fs.delete_file(inner)
        except (OSError, LeaseError) as e:  # it goes stale on its own
            log.warning("run lease %s: not released (%s); it goes stale in %.0f s", self.path, e, STALE_AFTER_S)
        for d in self.created_dirs:
            try:
                os.rmdir(d)  # only if empty: the run wrote nothing else
            except OSError:
                break


def acquire(run: RunDir, *, take_over: bool = False, job: str = "", replaces_job: bool = False) -> Lease:
    """Take the lease on ``run``; LeaseError (exit 2) naming the holder when another job has it (a stale one only
    with ``take_over``). ``replaces_job``: a holder of the same ``job`` (a sweep's trial, which Ray Tune runs once at a
    time: its earlier attempt is over) is replaced as one that is gone."""
    path = run.lease
    now = time.time()
    mine = Holder(
        host=socket.gethostname(), pid=os.getpid(), started_at=now, heartbeat_at=now, token=uuid.uuid4().hex,
        job=job, machine=machine_id(),
    )  # fmt: skip
    missing = _missing_dirs(path)
    created = _create(path, mine)
    if created is not None:
        return Lease(run, mine, created or None, created_dirs=missing)
    text = _read(path) or ""
    held = Holder.parse(text)
    age = _age(path)
    gone = held is not None and (held.gone() or (replaces_job and bool(job) and held.job == job))
    if held is not None and not gone and (age is None or age <= STALE_AFTER_S):
        raise LeaseError(
            f"run '{run.run}' under {run.storage} is in use by another job ({held.describe(age)}): two jobs on one "
            "run delete each other's checkpoints. Wait for it to end, or give this job another tracking.run_name"
        )
    if not take_over and not gone:
        what = f"its holder is silent ({held.describe(age)})" if held else "it is unreadable"
        raise LeaseError(
            f"run '{run.run}' under {run.storage} has a stale lease ({path}): {what}. If no job is training this run, "
            "run again with --take-over"
        )
    _take_over(path, mine, text)
    log.warning("run lease %s: taken over from %s", path, held.describe(age) if held else "an unreadable lease")
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
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    except OSError as e:
        raise LeaseError(f"run lease {path}: cannot create it ({e}); check checkpoint.storage") from None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(holder)))
    return ""


def _read(path: str) -> str | None:
    """The lease's text (None: none); LeaseError when the store cannot be read."""
    if storage.is_remote(path):
        return _s3_read(path)
    try:
        return storage.read_text(path)
    except (OSError, UnicodeDecodeError) as e:
        raise LeaseError(f"run lease {path}: cannot read it ({e}); check checkpoint.storage") from None


def _age(path: str) -> float | None:
    """Seconds since the lease was last written, by the store's clock: its modification time against a probe
    written next to it now (None: no lease, or the store gives no times)."""
    if storage.is_remote(path):
        return _s3_age(path)
    probe = f"{path}.probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            now = os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            os.unlink(probe)
        return max(0.0, now - os.stat(path).st_mtime)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise LeaseError(f"run lease {path}: cannot write next to it ({e}); check checkpoint.storage") from None


def _take_over(path: str, holder: Holder, seen: str) -> None:
    """Replace the stale lease read as ``seen``; LeaseError if another job took it (or is taking it) first."""
    first = f"{path}: another job took the run over first"
    if storage.is_remote(path):
        try:
            _s3_put(path, holder, if_match=_s3_etag(path, expect=seen))
        except _Precondition:
            raise LeaseError(first) from None
        return
    with _locked(path, holder):
        if (_read(path) or "") != seen:
            raise LeaseError(first)
        _local_replace(path, holder)


@contextlib.contextmanager
def _locked(path: str, holder: Holder) -> Iterator[None]:
    """Hold ``<lease>.takeover`` (created with ``O_EXCL``) while the lease is compared and replaced: a take-over
    and a renewal, or two take-overs, one after the other. LeaseError when another job holds it."""
    lock = f"{path}.takeover"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        age = _age(lock)
        if age is not None and age > TAKEOVER_LOCK_STALE_S:
            raise LeaseError(
                f"{lock} is {age:.0f} s old: a job died while taking this run over. If no job is taking it over now, "
                "delete that file and run again with --take-over"
            ) from None
        raise LeaseError(f"{path}: another job is taking the run over") from None
    try:
        os.write(fd, json.dumps(asdict(holder)).encode())
        os.close(fd)
        yield
    finally:
        os.unlink(lock)


def _local_replace(path: str, holder: Holder) -> None:
    tmp = f"{path}.{holder.token}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(asdict(holder)))
    os.replace(tmp, path)


# -- S3: conditional writes (boto3; pyarrow has none) ----------------------------------------------------------


class _Precondition(Exception):
    """S3 answered 412: the condition of a conditional put failed."""


#: Bounds on one S3 request of the lease: an unreachable endpoint answers within ~10 s, as one line.
S3_CONNECT_TIMEOUT_S = 3
S3_READ_TIMEOUT_S = 10


def _s3_client() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        config=Config(
            retries={"mode": "standard", "total_max_attempts": 2},
            connect_timeout=S3_CONNECT_TIMEOUT_S,
            read_timeout=S3_READ_TIMEOUT_S,
        ),
    )


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path[len("s3://") :].partition("/")
    return bucket, key


def _s3_call(path: str, call: Callable[[Any], Any]) -> Any:
    """``call(client)``: a 412 as :class:`_Precondition`, a missing key as None, anything else the store answered
    or failed with (an unreachable endpoint, a missing bucket, no credentials) as one LeaseError."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return call(_s3_client())
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
            raise _Precondition() from None
        if code in ("NoSuchKey", "404", "NotFound"):
            return None
        message = str(e.response.get("Error", {}).get("Message", "")) or code
        raise LeaseError(
            f"run lease {path}: S3 refused it ({code}: {message}); check checkpoint.storage's bucket and this "
            "machine's AWS credentials"
        ) from None
    except BotoCoreError as e:  # no endpoint, a timeout, no credentials
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        where = f" (AWS_ENDPOINT_URL={endpoint})" if endpoint else ""
        raise LeaseError(
            f"run lease {path}: cannot reach S3{where}: {e}; check the endpoint, the network and the credentials"
        ) from None


def _s3_put(path: str, holder: Holder, *, if_none_match: bool = False, if_match: str | None = None) -> str:
    bucket, key = _split(path)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Body": json.dumps(asdict(holder)).encode()}
    if if_none_match:
        kwargs["IfNoneMatch"] = "*"
    if if_match:
        kwargs["IfMatch"] = if_match
    return str(_s3_call(path, lambda c: c.put_object(**kwargs))["ETag"])


def _s3_read(path: str) -> str | None:
    bucket, key = _split(path)
    got = _s3_call(path, lambda c: c.get_object(Bucket=bucket, Key=key))
    return None if got is None else got["Body"].read().decode(errors="replace")


def _s3_age(path: str) -> float | None:
    """Seconds since the lease object was written, by S3's clock: its LastModified against a probe's."""
    bucket, key = _split(path)
    probe = f"{key}.probe-{uuid.uuid4().hex}"
    _s3_call(path, lambda c: c.put_object(Bucket=bucket, Key=probe, Body=b""))
    try:
        now = _s3_call(path, lambda c: c.head_object(Bucket=bucket, Key=probe))
        lease = _s3_call(path, lambda c: c.head_object(Bucket=bucket, Key=key))
    finally:
        _s3_call(path, lambda c: c.delete_object(Bucket=bucket, Key=probe))
    if now is None or lease is None:
        return None
    return max(0.0, (now["LastModified"] - lease["LastModified"]).total_seconds())


def _s3_etag(path: str, expect: str | None = None) -> str:
    """The lease object's ETag (LeaseError when its body is no longer ``expect``)."""
    bucket, key = _split(path)
    got = _s3_call(path, lambda c: c.get_object(Bucket=bucket, Key=key))
    if got is None or (expect is not None and got["Body"].read().decode(errors="replace") != expect):
        raise LeaseError(f"{path}: another job took the run over first")
    return str(got["ETag"])
