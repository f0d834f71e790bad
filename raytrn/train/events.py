"""What the driver hears from Ray Train's controller (run in its process: :func:`raytrn.compat.hosted_trainer`), and
what it does with it: one terminal line per event (what happened, to which rank and node, what raytrn does about
it), and the record of why each worker group ended that the run's goodput ledger books its gaps by
(:mod:`raytrn.tracking.goodput`). Ray's own account of the same events (its controller's log lines, a worker's
traceback) goes to the run's Ray log file (:mod:`raytrn.ray_output`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from raytrn.compat import WorkerPlace
from raytrn.errors import RaytrnError
from raytrn.tracking.goodput import EndCause, GroupEnd, Ledger, close
from raytrn.tracking.roles import BoardReader
from raytrn.tracking.tracker_client import TrackerClient

log = logging.getLogger(__name__)

Print = Callable[[str], None]


def _print(line: str) -> None:
    print(line, flush=True)


class RunEvents:
    """A :class:`raytrn.compat.ControllerListener` for one run (``max_failures``: the job's ``scaling.max_failures``;
    ``quiet``: record only, print nothing, as a sweep's trial; ``live``: ``scaling.recovery: live``, where Ray Train
    replaces a failed worker's replica while the others train on: no group ends)."""

    def __init__(
        self,
        max_failures: int,
        *,
        quiet: bool = False,
        live: bool = False,
        out: Print = _print,
        alive_nodes: Callable[[], set[str] | None] | None = None,
    ) -> None:
        self.max_failures = max_failures
        self.live = live
        self.out: Print | None = None if quiet else out
        #: The ids of the cluster's live nodes (None: not known): a failure names the ranks whose node is gone.
        self.alive_nodes = alive_nodes or _alive_nodes
        self._lock = threading.Lock()
        #: Why each group before the current one ended, with the driver's wall-clock time of the decision.
        self.ends: list[GroupEnd] = []
        #: Where the current group's workers run, by rank (the newest ``group_started``).
        self.places: dict[int, WorkerPlace] = {}
        self.size = 0
        self.failures = 0
        self.groups = 0
        #: Ranks a line already named failed since their place was last started: not named again as lost or silent
        #: by a later line (a live group's lost replica waits for capacity while the others' later failures are told)
        self._told: set[int] = set()
        #: The step of the current group's committed notice checkpoint (None: none): its restart comes at once.
        self._notice_step: int | None = None

    # -- compat.ControllerListener ----------------------------------------------------------------------------
    def group_starting(self, num_workers: int) -> None:
        with self._lock:
            self.size = num_workers

    def group_started(self, places: list[WorkerPlace]) -> None:
        with self._lock:
            self.places = {p.rank: p for p in places}
            self.groups += 1
            self._told = set()
            self._notice_step = None

    def replicas_started(self, places: list[WorkerPlace]) -> None:
        with self._lock:  # a live replacement's place (its rank's old one is gone): named where it runs now
            self.places.update({p.rank: p for p in places})
            self._told -= {p.rank for p in places}

    def failure_decided(
        self, retry: bool, errors: dict[int, BaseException], error: BaseException, preemption: bool
    ) -> None:
        with self._lock:
            if not self.live:  # live: the survivors' group goes on (a replica is replaced), nothing ended
                self.ends.append(GroupEnd(time.time(), EndCause.PREEMPTION if preemption else EndCause.FAILURE))
            if not preemption:
                self.failures += 1
            # a preemption is Ray's wait for a notice's deadline, or (errors) a worker that died with its node
            # preempted (a drained node taken away): Ray charges both to max_preemption_failures, not max_failures
            if not preemption:
                what = self._what_failed(errors, error)
            elif errors:
                what = f"{self._what_failed(errors, error)} (its node preempted after its notice)"
            elif self._notice_step is not None:
                what = f"every rank stopped at the notice's checkpoint (step {self._notice_step})"
            else:
                what = "the preempted node's deadline passed"
            count = (
                "a preemption: not counted against scaling.max_failures"
                if preemption
                else f"failure {self.failures} of scaling.max_failures={self.max_failures}"
            )
            if retry and self.live and (not self.places or set(self.places) - self._told):
                then = f"the other replicas train on; its replica is replaced when capacity allows ({count})"
            elif retry:  # (live: every replica failed; Ray restarts the whole group)
                then = (
                    "restarting the group without the node from that checkpoint, not waiting for its deadline"
                    if preemption and not errors and self._notice_step is not None
                    else "restarting the group without the node from the checkpoint it took"
                    if preemption and not errors
                    else f"restarting the group from the newest state ({count})"
                )
            else:
                then = f"no restarts left (scaling.max_failures={self.max_failures}): the run fails"
            self._say(f"{what}; {then}")

    def resizing(self, num_workers: int) -> None:
        with self._lock:
            self.ends.append(GroupEnd(time.time(), EndCause.RESIZE))
            self._say(
                f"capacity for {num_workers} workers (running {self.size}): restarting the group at {num_workers}"
            )

    def notice_committed(self, step: int) -> None:
        with self._lock:
            self._notice_step = step

    def preempting(self, ranks: list[int], deadline_ms: int | None) -> None:
        with self._lock:
            when = (
                f"its deadline in {max(0.0, deadline_ms / 1000 - time.time()):.0f} s"
                if deadline_ms
                else "no deadline given"
            )
            self._say(
                f"preemption notice for {self._ranks(ranks)} ({when}): checkpointing at the next step, then "
                "restarting without the node"
            )

    # -- rendering ----------------------------------------------------------------------------------------------
    def _say(self, line: str) -> None:
        if self.out is not None:
            self.out(f"raytrn: {line}")

    def _ranks(self, ranks: list[int]) -> str:
        nodes = sorted({self.places[r].node_ip for r in ranks if r in self.places})
        where = f" on {', '.join(nodes)}" if nodes else ""
        return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}{where}"

    def _what_failed(self, errors: dict[int, BaseException], error: BaseException) -> str:
        """The ranks on lost nodes first (Ray may not have said so yet: their survivors' collectives fail first),
        then each reported reason with its ranks, a peer's failed collective last."""
        alive = self.alive_nodes() if self.places else None
        lost = sorted(
            r for r, p in self.places.items() if alive is not None and p.node_id not in alive and r not in self._told
        )
        by_reason: dict[str, list[int]] = {"its node was lost": lost} if lost else {}
        reasons = {rank: describe_error(e) for rank, e in sorted(errors.items()) if rank not in lost}
        silent = sorted(set(self.places) - set(errors) - set(lost) - self._told)
        if self.live:
            # Live, the survivors re-form without a replica they stopped hearing from and train on: they say nothing,
            # and the one left out (its node cut off, its process not yet gone) finds its collective's peers gone
            reasons = {rank: LEFT_BEHIND if reason == PEER_LEFT else reason for rank, reason in reasons.items()}
        elif not lost and silent and reasons and set(reasons.values()) == {PEER_LEFT}:
            # The others' collectives failed because a peer left; the ranks that said nothing are the likely ones
            by_reason["no word from it (its process or node likely gone)"] = silent
        # the causes before the consequence: a peer's collective fails because another rank died first
        for rank, reason in sorted(reasons.items(), key=lambda item: item[1] == PEER_LEFT):
            by_reason.setdefault(reason, []).append(rank)
        if self.live:  # (a restart path's failure ends its group: the next starts with nothing told)
            self._told |= {rank for ranks in by_reason.values() for rank in ranks}
        if not by_reason:
            return f"the worker group of {self.size} failed ({describe_error(error)})"
        return "; ".join(f"{self._ranks(ranks)} failed: {reason}" for reason, ranks in by_reason.items())


def _alive_nodes() -> set[str] | None:
    """The ids of the live nodes of the Ray this process is connected to (None when Ray does not answer)."""
    try:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:
        return None


#: What Ray's GCS says of a dead actor (its C++ messages, in the ActorDiedError's text) and raytrn's words for it.
ACTOR_DEATHS = (
    ("because its node has died", "its node was lost"),
    ("because its worker process has died", "its process died (killed, out of memory, or exited)"),
    ("killed by `ray.kill`", "it was stopped (ray.kill)"),
)


#: A collective's error when a peer's process is gone (gloo's transport; NCCL's and Neuron's words alike).
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "remote process exited or there was a network error",
    "Broken pipe",
)
PEER_LEFT = "a peer left its collective (another worker's process or node went away)"
#: The same error from a live replica's rank: the other replicas stopped hearing from it and went on without it.
LEFT_BEHIND = "the other replicas went on without it (they stopped hearing from it: its node or network went away)"


def describe_error(error: BaseException) -> str:
    """A failed worker's error in a few words: raytrn's own message, what Ray says happened to the process, or the
    exception's type and first line (the whole traceback is in the run's Ray log)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RaytrnError):
            return str(e).splitlines()[0]
        name = type(e).__name__
        if name in ("ActorDiedError", "RayActorError", "ActorUnavailableError"):
            for words, said in ACTOR_DEATHS:
                if words in str(e):
                    return said
            return "its process died (killed, out of memory, or its node lost)"
        if name == "WorkerHealthCheckTimeoutError":
            return "it stopped answering Ray's health checks (a frozen process: killed)"
        if any(words in str(e) for words in PEER_LOST):
            return PEER_LEFT
        nested = getattr(e, "health_check_failure", None) or getattr(e, "cause", None) or e.__cause__
        if nested is None:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            return f"{name}: {first}" if first else name
        e = nested
    return type(error).__name__


def close_ledger(board: BoardReader, ends: list[GroupEnd], *, started_at: float, tracker: Any = None) -> Ledger | None:
    """The run's goodput ledger, closed now (:func:`raytrn.tracking.goodput.close`: the groups' own times from the
    ``board``, ``ends`` from :class:`RunEvents`), logged to MLflow through ``tracker`` (added to what an earlier
    invocation of the run logged). None when the board does not answer (the ledger is not worth failing a run)."""
    try:
        snap = board.snapshot()
    except Exception as e:
        log.warning("goodput ledger: the progress board did not answer (%s)", e)
        return None
    ledger = close(started_at, time.time(), list(snap.times), ends)
    if tracker is not None:
        step = int((snap.last or {}).get("step") or 0)
        TrackerClient(tracker).log_goodput(ledger.metrics(), step)
    return ledger
