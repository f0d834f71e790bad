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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

LOGGED_STEP_TAG = "raytrn.logged_step"
_MAX_METRICS_PER_BATCH = 900  # MLflow's log_batch takes at most 1000 metrics + params + tags
_MAX_TAGS_PER_BATCH = 90
_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 10.0)


def quiet_http_retries(timeout_s: int = 10) -> None:
    """Make each MLflow REST call fail fast (this process): the logger retries on its own, without blocking
    for MLflow's default ~2 minutes of in-request retries. Values the user set win."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))


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
        from mlflow.tracking import MlflowClient

        if uri.startswith(("http://", "https://")):
            quiet_http_retries()
        self.client = MlflowClient(uri)
        self.uri = uri
        self.run_id = run_id
        self._resolve_run = resolve_run
        self._max_buffered = max_buffered
        self._window = batch_window_s
        self._cond = threading.Condition()
        self._metrics: deque[tuple[Any, bool]] = deque()  # (mlflow Metric, is a training metric)
        self._tags: dict[str, str] = {}
        self._in_flight = 0
        self._closing = False
        self._down_since: float | None = None
        self._dropped = 0
        self.delivered = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="raytrn-mlflow-logger", daemon=True)
        self._thread.start()

    # -- the training side: never blocks on the network ---------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int, *, training: bool = True) -> None:
        """Queue ``metrics`` at ``step``; ``training`` metrics advance :data:`LOGGED_STEP_TAG`."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with self._cond:
            for key, value in metrics.items():
                self._metrics.append((Metric(key, float(value), now, step), training))
            overflow = len(self._metrics) - self._max_buffered
            if overflow > 0:  # a very long outage: keep the newest, say how many were dropped
                for _ in range(overflow):
                    self._metrics.popleft()
                if self._dropped == 0:
                    log.warning("MLflow buffer full (%d metrics): dropping the oldest", self._max_buffered)
                self._dropped += overflow
            self._cond.notify()

    def set_tags(self, tags: dict[str, str]) -> None:
        """Queue tags (the newest value of a key wins)."""
        with self._cond:
            self._tags.update({k: str(v) for k, v in tags.items()})
            self._cond.notify()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._metrics) + len(self._tags) + self._in_flight

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for everything queued so far to be delivered; True when it was."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._cond.notify()
            while self._metrics or self._tags or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.2))
        return True

    def close(self, timeout_s: float = 60.0) -> int:
        """Flush (bounded by ``timeout_s``), stop the thread; returns how many metrics were not delivered."""
        if self._closing:  # closed already: nothing will be sent any more
            return self.pending + self._dropped
        delivered = self.flush(timeout_s)
        with self._cond:
            self._closing = True
            left = len(self._metrics) + self._dropped
            self._cond.notify()
        self._thread.join(timeout=15)
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
            time.sleep(self._window)  # gather a batch: one request per window, not one per metric
            if self.run_id is None and not self._try_resolve():
                ok = False
            else:
                ok = self._send_one_batch()
            if ok:
                attempt = 0
                continue
            self.failures += 1
            with self._cond:  # wait before retrying; close() and flush() wake us early
                if not self._closing:
                    self._cond.wait(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
            attempt += 1

    def _try_resolve(self) -> bool:
        if self._resolve_run is None:
            return False
        try:
            self.run_id = self._resolve_run()
        except Exception as e:
            log.debug("MLflow run not available yet: %s", e)
        if self.run_id is not None:
            log.warning("MLflow reachable: logging into run %s", self.run_id)
        return self.run_id is not None

    def _send_one_batch(self) -> bool:
        from mlflow.entities import RunTag

        with self._cond:
            batch = [self._metrics.popleft() for _ in range(min(len(self._metrics), _MAX_METRICS_PER_BATCH))]
            tag_keys = list(self._tags)[:_MAX_TAGS_PER_BATCH]
            tags = {k: self._tags.pop(k) for k in tag_keys}
            self._in_flight = len(batch) + len(tags)
        if not batch and not tags:
            return True
        steps = [m.step for m, training in batch if training]
        if steps:
            tags[LOGGED_STEP_TAG] = str(max(steps))
        try:
            assert self.run_id is not None
            self.client.log_batch(
                self.run_id, metrics=[m for m, _ in batch], tags=[RunTag(k, v) for k, v in tags.items()]
            )
        except Exception as e:
            with self._cond:  # put everything back, in order, ahead of what arrived meanwhile
                self._metrics.extendleft(reversed(batch))
                tags.pop(LOGGED_STEP_TAG, None)
                self._tags = {**tags, **self._tags}
                self._in_flight = 0
                self._cond.notify_all()
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("MLflow at %s unreachable (training continues, metrics are buffered): %s", self.uri, e)
            return False
        with self._cond:
            self._in_flight = 0
            self.delivered += len(batch)
            self._cond.notify_all()
        if self._down_since is not None:
            log.warning(
                "MLflow at %s reachable again after %.0f s: delivering buffered metrics",
                self.uri,
                time.monotonic() - self._down_since,
            )
            self._down_since = None
        return True


def logged_step_of(run: Any) -> int:
    """The highest training step delivered to ``run`` (an MLflow ``Run``), from its tag."""
    return int(run.data.tags.get(LOGGED_STEP_TAG, 0))
