"""Asynchronous, buffering MLflow writer: training never waits for MLflow, and an outage loses nothing.

The tracking actor (raytrn.tracking.actor) hands metrics to :class:`AsyncLogger`; a background thread sends them
in batches with ``log_batch``. When the server is unreachable the batch stays in the buffer and is retried
with backoff (1 s doubling to 10 s); when it answers again everything buffered arrives, in order. Metric
rows carry the timestamp of when they were recorded, so a retried batch that did reach the server is
de-duplicated by the store rather than logged twice.

MLflow's own asynchronous logging (``synchronous=False``) is not used: a batch that fails there is dropped,
which is exactly the outage case this module exists for.

Every batch of training metrics also sets the tag :data:`LOGGED_STEP_TAG` to the highest step it delivered
(in the same ``log_batch`` request): a worker group restarted from an older checkpoint reads it and does not
log those steps again.

Errors that will never succeed are not retried: when MLflow refuses a batch for good (HTTP 4xx other than
429: a deleted or unknown run, a key over MLflow's length limit...), the refused items are found by splitting
the batch, dropped, counted (:attr:`AsyncLogger.rejected`) and logged once; everything else is delivered. A
deleted run stops all logging into it, with one warning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from raytrn.tracking.client import mlflow_client, redact_uri

log = logging.getLogger(__name__)

LOGGED_STEP_TAG = "raytrn.logged_step"
_MAX_METRICS_PER_BATCH = 900  # MLflow's log_batch takes at most 1000 metrics + params + tags
_MAX_TAGS_PER_BATCH = 90
_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 10.0)
_REMEMBERED = 4096
#: MLflow's limit on a tag value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH in MLflow 3).
MAX_TAG_VALUE = 8000


def _fit(value: str) -> str:
    """A tag value MLflow accepts: cut to :data:`MAX_TAG_VALUE` characters, marked when cut."""
    return value if len(value) <= MAX_TAG_VALUE else value[: MAX_TAG_VALUE - 13] + " [truncated]"


class AsyncLogger:
    """The job's writer into its MLflow run (held by the tracking actor).

    ``run_id`` may be None when MLflow was unreachable at start: ``resolve_run`` is then called (from the
    background thread, between retries) until it returns the run id; metrics are buffered meanwhile.
    """

    def __init__(
        self,
        uri: str,
        run_id: str | None,
        *,
        resolve_run: Callable[[], str | None] | None = None,
        max_buffered: int = 200_000,
        batch_window_s: float = 0.5,
    ) -> None:
        self.client = mlflow_client(uri, fail_fast=True)  # this logger retries on its own, with backoff
        self.uri = redact_uri(uri)  # what its warnings show
        self.target = uri  # for another client of the same server (its credentials included): never shown
        self.run_id = run_id
        self._resolve_run = resolve_run
        self._resolving = threading.Lock()  # the background thread and resolve_now: one run creation at a time
        self._max_buffered = max_buffered
        self._window = batch_window_s
        self._cond = threading.Condition()
        self._metrics: deque[tuple[Any, bool]] = deque()  # (mlflow Metric, is a training metric)
        self._tags: dict[str, str] = {}
        self._rows: dict[tuple[str, int], tuple[int, float]] = {}  # (key, step) -> (timestamp, value), newest ones
        self._in_flight = 0
        self._closing = False
        self._flushers = 0  # callers waiting in flush(): batches go one after another, no window between them
        self._flushes = 0  # flushes begun: a retry's backoff ends at a new one
        self._down_since: float | None = None
        self._dropped = 0
        self.delivered = 0
        self.failures = 0
        #: Metrics and tags MLflow refused for good (not retried), and why the run is gone if it is.
        self.rejected = 0
        self._gone: str | None = None
        self._said: set[tuple[str, str]] = set()
        self._thread = threading.Thread(target=self._run, name="raytrn-mlflow-logger", daemon=True)
        self._thread.start()

    # -- the training side: never blocks on the network ---------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int, *, training: bool = True) -> None:
        """Queue ``metrics`` at ``step``; ``training`` metrics advance :data:`LOGGED_STEP_TAG`."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._queue([Metric(key, float(value), now, step) for key, value in metrics.items()], training)

    def log_metric_objects(self, metrics: list[Any]) -> None:
        """Queue MLflow ``Metric`` objects as they are (a LoggedModel's: ``model_id``, dataset); not training ones."""
        self._queue(metrics, False)

    def row_of(self, key: str, step: int) -> tuple[int, float] | None:
        """The timestamp and value this logger gave ``key`` at ``step`` (not yet delivered, or one of the latest
        :data:`_REMEMBERED` delivered), or None: a row logged again with both (a LoggedModel's link) is the same row
        to MLflow."""
        with self._cond:
            return self._rows.get((key, step))

    def _queue(self, metrics: list[Any], training: bool) -> None:
        with self._cond:
            if self._gone:  # the run was deleted: nothing could be delivered
                self.rejected += len(metrics)
                return
            for metric in metrics:
                self._metrics.append((metric, training))
                self._rows.setdefault((metric.key, metric.step), (metric.timestamp, metric.value))
            # The oldest rows go first, once delivered: every undelivered one stays (an outage's backlog: a
            # checkpoint committed meanwhile links its step's rows when the server is back; the server does not
            # have them to read yet).
            while len(self._rows) > _REMEMBERED + len(self._metrics) + self._in_flight:
                del self._rows[next(iter(self._rows))]
            overflow = len(self._metrics) - self._max_buffered
            if overflow > 0:  # a very long outage: keep the newest, say how many were dropped
                for _ in range(overflow):
                    self._metrics.popleft()
                if self._dropped == 0:
                    log.warning("MLflow buffer full (%d metrics): dropping the oldest", self._max_buffered)
                self._dropped += overflow
            self._cond.notify_all()

    def set_tags(self, tags: dict[str, str]) -> None:
        """Queue tags (the newest value of a key wins; values cut to MLflow's 8,000-character limit)."""
        with self._cond:
            if self._gone:
                self.rejected += len(tags)
                return
            self._tags.update({k: _fit(str(v)) for k, v in tags.items()})
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._metrics) + len(self._tags) + self._in_flight

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for everything queued so far to be delivered; True when it was."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._flushers += 1
            self._flushes += 1
            self._cond.notify_all()
            try:
                while self._metrics or self._tags or self._in_flight:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.2))
            finally:
                self._flushers -= 1
        return True

    def close(self, timeout_s: float = 60.0) -> int:
        """Flush (bounded by ``timeout_s``), stop the thread; returns how many metrics were not delivered."""
        if self._closing:  # closed already: nothing will be sent any more
            return self.pending + self._dropped
        delivered = self.flush(timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=15)  # a batch in flight is delivered or put back first
        with self._cond:  # a batch still in flight (the thread did not stop) counts as not delivered
            left = len(self._metrics) + self._dropped + (self._in_flight if self._thread.is_alive() else 0)
        if self.rejected:
            log.warning("MLflow at %s refused %d metrics/tags for good: dropped, not retried", self.uri, self.rejected)
        if not delivered or left:
            log.warning(
                "MLflow at %s: %d metrics could not be delivered (server unreachable for the last %.0f s)",
                self.uri,
                left,
                time.monotonic() - (self._down_since or time.monotonic()),
            )
        return left

    # -- the background thread -------------------------------------------------------------------
    def _run(self) -> None:
        attempt = 0
        while True:
            with self._cond:
                while not (self._metrics or self._tags or self._closing):
                    self._cond.wait()
                if self._closing:
                    return
                self._gather()
            if self.run_id is None and not self._try_resolve():
                ok = False
            else:
                ok = self._send_one_batch()
            if ok:
                attempt = 0
                continue
            self.failures += 1
            with self._cond:
                self._back_off(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
            attempt += 1

    def _gather(self) -> None:
        """(Holding the lock.) Let a batch gather: one request per window, not one per metric. A full batch queued
        (an outage's backlog, a long run's last metrics) or a caller waiting in :meth:`flush` goes at once: until
        2026-12-04 every batch waited out the window, and a backlog drained at one batch per window and request."""
        deadline = time.monotonic() + self._window
        while (
            len(self._metrics) < _MAX_METRICS_PER_BATCH
            and not self._flushers
            and not self._closing
            and (left := deadline - time.monotonic()) > 0
        ):
            self._cond.wait(left)

    def _back_off(self, seconds: float) -> None:
        """(Holding the lock.) Wait ``seconds`` before retrying, or until :meth:`close`, or a :meth:`flush` begins
        (one retry at once: no more, however many metrics are logged meanwhile)."""
        flushes, deadline = self._flushes, time.monotonic() + seconds
        while not self._closing and self._flushes == flushes and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)

    def resolve_now(self) -> bool:
        """Try once, now, to get the run (MLflow was unreachable, or its creation failed): whether it exists."""
        return self.run_id is not None or self._try_resolve()

    def _try_resolve(self) -> bool:
        if self._resolve_run is None:
            return False
        with self._resolving:
            if self.run_id is not None:  # the other caller made it meanwhile
                return True
            try:
                self.run_id = self._resolve_run()
            except Exception as e:
                log.debug("MLflow run not available yet: %s", e)
            if self.run_id is not None:
                log.warning("MLflow reachable: logging into run %s", self.run_id)
            return self.run_id is not None

    def _send_one_batch(self) -> bool:
        """Send one batch; False when MLflow could not be reached (retry later, nothing lost).

        A permanent refusal (HTTP 4xx other than 429, or the store's equivalent) is never retried: when the
        run itself is gone (deleted, unknown) everything queued and everything after is dropped, once logged;
        otherwise the batch is split until the refused items are alone, and those are dropped and counted.
        """
        with self._cond:
            batch = [self._metrics.popleft() for _ in range(min(len(self._metrics), _MAX_METRICS_PER_BATCH))]
            tag_keys = list(self._tags)[:_MAX_TAGS_PER_BATCH]
            tags = {k: self._tags.pop(k) for k in tag_keys}
            self._in_flight = len(batch) + len(tags)
        items: list[_Item] = [("metric", m, training) for m, training in batch]
        items += [("tag", k, v) for k, v in tags.items()]
        if not items:
            return True
        pending = [items]
        while pending:
            part = pending.pop()
            try:
                self._log(part)
            except Exception as e:
                if not is_permanent(e):
                    self._requeue([i for p in pending for i in p] + part)
                    self._went_down(e)
                    return False
                gone = self._run_gone()
                if gone:
                    self._give_up(gone, [i for p in pending for i in p] + part)
                    break
                if len(part) == 1:
                    self._reject(part[0], e)
                else:  # which item did MLflow refuse? halve until it is alone (the rest is delivered)
                    half = len(part) // 2
                    pending += [part[half:], part[:half]]
                continue
            with self._cond:
                self.delivered += sum(1 for kind, *_ in part if kind == "metric")
        with self._cond:
            self._in_flight = 0
            self._cond.notify_all()
        if self._down_since is not None:
            log.warning(
                "MLflow at %s reachable again after %.0f s: delivering buffered metrics",
                self.uri,
                time.monotonic() - self._down_since,
            )
            self._down_since = None
        return True

    def _log(self, items: list[_Item]) -> None:
        """One ``log_batch`` of ``items``, with :data:`LOGGED_STEP_TAG` at the highest training step among them."""
        from mlflow.entities import RunTag

        metrics = [m for kind, m, training in items if kind == "metric"]
        tags = [RunTag(k, v) for kind, k, v in items if kind == "tag"]
        steps = [m.step for kind, m, training in items if kind == "metric" and training]
        if steps:
            tags.append(RunTag(LOGGED_STEP_TAG, str(max(steps))))
        assert self.run_id is not None
        if self._gone:  # the run is gone: nothing will ever be accepted
            raise _RunGone(self._gone)
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def _requeue(self, items: list[_Item]) -> None:
        """Put undelivered items back, in order, ahead of what arrived meanwhile (newer tag values win)."""
        with self._cond:
            self._metrics.extendleft(reversed([(m, training) for kind, m, training in items if kind == "metric"]))
            self._tags = {**{k: v for kind, k, v in items if kind == "tag"}, **self._tags}
            self._in_flight = 0
            self._cond.notify_all()

    def _went_down(self, e: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("MLflow at %s unreachable (training continues, metrics are buffered): %s", self.uri, e)

    def _run_gone(self) -> str | None:
        """Why the run can no longer be written (deleted or unknown), or None when it can (or we cannot tell)."""
        if self._gone:
            return self._gone
        if self.run_id is None:
            return None
        try:
            run = self.client.get_run(self.run_id)
        except Exception as e:
            return f"run {self.run_id} not found ({e})" if is_permanent(e) else None
        if run.info.lifecycle_stage == "deleted":
            return f"run {self.run_id} was deleted"
        return None

    def _give_up(self, why: str, items: list[_Item]) -> None:
        """The run is gone: drop what is queued and all that comes later, with one warning."""
        with self._cond:
            dropped = len(items) + len(self._metrics) + len(self._tags)
            self._metrics.clear()
            self._tags.clear()
            self.rejected += dropped
            self._gone = why
        log.warning(
            "MLflow at %s: %s: %d queued metrics/tags dropped, and later ones will be too (training continues)",
            self.uri,
            why,
            dropped,
        )

    def _reject(self, item: _Item, e: Exception) -> None:
        """MLflow refused this one item for good: drop and count it; say so once per kind of refusal."""
        kind, key, _ = item
        name = key.key if kind == "metric" else key
        reason = f"{kind} {name!r}: {getattr(e, 'message', e)}"
        with self._cond:
            self.rejected += 1
        signature = (kind, getattr(e, "error_code", type(e).__name__))
        if signature not in self._said:
            self._said.add(signature)
            log.warning("MLflow at %s refused a %s (dropped, not retried): %s", self.uri, kind, reason[:500])


class _RunGone(Exception):
    """Raised instead of calling MLflow once the run is known to be deleted or unknown."""

    error_code = "RESOURCE_DOES_NOT_EXIST"

    def get_http_status_code(self) -> int:
        return 404


#: A queued item: ("metric", Metric, is_training) or ("tag", key, value).
_Item = tuple[str, Any, Any]


def is_permanent(e: BaseException) -> bool:
    """Whether MLflow refused for good: an answer with HTTP status 4xx other than 429 (too many requests), or
    the equivalent error code from a local store. Connection failures (MLflow's INTERNAL_ERROR, 500), 5xx
    and anything else are transient and retried."""
    status = getattr(e, "get_http_status_code", None)
    if not callable(status):
        return False
    try:
        code = int(status())
    except (TypeError, ValueError):
        return False
    return 400 <= code < 500 and code != 429


def logged_step_of(run: Any) -> int:
    """The highest training step delivered to ``run`` (an MLflow ``Run``), from its tag."""
    return int(run.data.tags.get(LOGGED_STEP_TAG, 0))
