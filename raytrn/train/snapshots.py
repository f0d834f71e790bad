"""The loop's in-memory snapshots (``checkpoint.memory_every_n_steps``; the tier: :mod:`raytrn.checkpoint.memory`).

Every N steps each rank stages its state to host memory (the step waits for that copy only) and its snapshot thread
writes its DCP shards into bytes and puts them on its node's store and on ``checkpoint.memory_replicas`` other
nodes' (ring placement); the threads then agree that every rank's copies are kept (on a process group of their
own), rank 0's adds the manifest (step, world size, the counters) next to its files and seals it, and the stores
free the older snapshots. After the next step, before it is logged, each rank waits for its thread (only when it
took longer than that step) and the ranks agree on the outcome (one collective). A restart
(:meth:`raytrn.train.checkpointer.Checkpointer.find`) resumes from the newest complete snapshot still held on live
nodes when it is newer than the newest committed checkpoint: no read from the checkpoint storage, at most one
step trained again with a snapshot every step, resharded like a durable checkpoint to whatever size the group
restarts at.

A snapshot that cannot be kept (a store full, a node gone mid-copy) is skipped with one warning naming why; training
goes on, the previous complete snapshot and the durable checkpoints stay.

A rank may also snapshot *alone* (``alone_on``): the live group's rank 0 (:mod:`raytrn.train.live_snapshots`), whose
state is a whole replica's, writes it as one process does, with no collective and no agreement, and seals it itself.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

import torch.distributed as dist

from raytrn.checkpoint import agree
from raytrn.checkpoint.memfiles import Snapshotter, load_from_memory
from raytrn.checkpoint.memory import fetcher, publish
from raytrn.checkpoint.memory_clients import NodeStore, SnapshotKeeper
from raytrn.checkpoint.messages import Passed, PassedOver, Refusal, Refusals, Refused, error_text, render
from raytrn.checkpoint.progress import Progress
from raytrn.checkpoint.slabs import SlabWriter
from raytrn.config import JobSpec
from raytrn.pending import Pending, wait_all
from raytrn.tracking.roles import RollbackRegistry
from raytrn.tracking.system import node_label

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Snapshot:
    """A complete in-memory snapshot a group can start from."""

    step: int
    progress: Progress
    world_size: int
    nodes: tuple[str, ...] = ()  # the nodes whose stores answered when it was chosen


@dataclass
class _Writing:
    """A snapshot this rank's background thread is writing and putting on the stores."""

    progress: Progress
    started: float
    generation: int = 0  # the worker group's (MemorySnapshots.generation), sent with every change to the stores
    done: threading.Event = field(default_factory=threading.Event)
    reason: Refusals = ()  # why this snapshot is not complete: the threads' agreement (set by the thread only)
    held: dict[str, int] = field(default_factory=dict)  # rank 0: what each store holds once it is sealed
    staged_s: float = 0.0  # how long the step waited for its staging (and the agreement that every rank staged)


@dataclass(frozen=True)
class Rewound:
    """Rank 0's answer to a new worker group's rewind of the stores (broadcast): the group's ``generation``, or why
    the stores were not rewound (``refused``; the group then takes no snapshots)."""

    generation: int = 0
    refused: Refusal | None = None


class SnapshotUnreadable(RuntimeError):
    """A chosen snapshot could not be read on some rank: the group fails and restarts from the checkpoint."""


class MemorySnapshots:
    """One rank's side of the memory tier (a no-op when it is off for this group)."""

    def __init__(
        self,
        job: JobSpec,
        keeper: SnapshotKeeper | None,
        *,
        rank: int,
        world_size: int,
        rollbacks: RollbackRegistry | None = None,
        takes: bool = True,
        alone_on: Sequence[str] | None = None,
        node: str | None = None,
    ) -> None:
        """``takes`` False: this group only restores (the live group's founders, whose rank 0 then snapshots alone).
        ``alone_on``: this rank snapshots by itself, with no collective (the live group's rank 0: every replica holds
        the whole state), its copies on the ring over these nodes (the live members'); auto then means at every
        checkpoint step only.
        ``node``: this rank's node (Ray's node id when None)."""
        import ray

        self.job, self.keeper, self.rank, self.world_size = job, keeper, rank, world_size
        self.alone = alone_on is not None
        self._agree: Any = _Alone if self.alone else agree
        self.rollbacks = rollbacks  # the job's progress board's rollbacks (raytrn.train.guard)
        self.every = job.checkpoint.memory_every_n_steps
        self.stores: dict[str, NodeStore] = {}
        self._warned: set[tuple[Refused, ...]] = set()  # the kinds of failure warned about (once each)
        #: Whether a restart may resume from a snapshot (the tier is on for the job: a group on one node still
        #: restores what a larger one snapshotted), and whether this group takes snapshots.
        self.restorable = keeper is not None and self.every != 0
        self.taking = False
        self._takes = False
        self._started_at = 0  # the step this group started at (starting_at)
        self._asked = 0  # the number of this rank's last ensure (MemoryTier.retire)
        #: This worker group's number (:meth:`MemoryTier.rewind`), sent with every change to the stores.
        self.generation = 0
        #: Rank 0: the bytes each node's store held after the last complete snapshot (``memory_checkpoint_bytes``).
        self.held: dict[str, int] = {}
        #: Rank 0, after :meth:`newest`: why each newer snapshot was passed over (the restart's record keeps them).
        self.passed_over: tuple[PassedOver, ...] = ()
        self._writing: _Writing | None = None
        #: The training's wait for the last completed snapshot: its staging and its completion
        #: (``memory_snapshot_blocked_s``; the write and the copies run beside the next step).
        self.blocked_s = 0.0
        self._snapshotter: Snapshotter | None = None  # what one snapshot leaves for the next to reuse
        self._slabs = SlabWriter()  # this rank's slabs on its node's store, kept mapped
        self._thread: threading.Thread | None = None  # this rank's snapshot thread (started at the first snapshot)
        self._queue: queue.SimpleQueue[tuple[_Writing | None, Any]] = queue.SimpleQueue()
        if not self.restorable:
            return
        self.node = node or ray.get_runtime_context().get_node_id()
        # a collective: every rank's node (alone: the nodes given)
        nodes = [self.node, *alone_on] if alone_on is not None else agree.gather(self.node)
        # auto: every step while the group spans more than one node; alone (the live rank 0, whose snapshots only a
        # restart after every replica was lost reads): at the checkpoint steps only (``every`` 0)
        auto_alone = self.every is None and self.alone
        if self.every is None:
            self.every = 0 if self.alone else 1 if len(set(nodes)) > 1 else 0
        self.taking = takes and (self.every > 0 or auto_alone)
        #: A group that would take snapshots on more than one node (a restorer of the live group's founders never does)
        self._takes = takes and not self.alone
        # The background writes' collectives get a gloo group of their own, created by every rank at this point.
        distributed = self.taking and not self.alone and dist.is_available() and dist.is_initialized()
        self._group = dist.new_group(backend="gloo") if distributed else None
        assert keeper is not None
        #: Where this group's snapshots go: the ring over the group's own nodes (never a lost node's store).
        self.ring: dict[str, NodeStore] = self._ensure(keeper, nodes)

    def regroup(self, nodes: Sequence[str]) -> None:
        """Alone: the ring over these nodes from the next snapshot on (the live members' after a re-formation: a
        returning node's store is made, a lost one's left out)."""
        if self.keeper is None or not self.restorable:
            return
        self.ring = self._ensure(self.keeper, [self.node, *nodes])

    def _ensure(self, keeper: SnapshotKeeper, nodes: Sequence[str]) -> dict[str, NodeStore]:
        """A store on each of ``nodes`` (made when missing): keeps every store the run has and this ensure's number
        (what this rank's retirements send: :meth:`MemoryTier.retire`); returns the ring over ``nodes``."""
        here = sorted(set(nodes))
        ensured = keeper.ensure(here, timeout_s=120)
        self.stores, self._asked = ensured.stores, ensured.asked
        return {n: self.stores[n] for n in here}

    def _retire(self, off: Sequence[str], step: int, generation: int) -> None:
        """Rank 0: the stores on ``off`` (nodes off the ring) go (:meth:`MemoryTier.retire`, not waited for); this
        rank keeps only the ring's."""
        assert self.keeper is not None
        self.keeper.retire(off, step, generation, self._asked)
        self.stores = {n: s for n, s in self.stores.items() if n in self.ring}

    # -- start -----------------------------------------------------------------------------------------------
    def newest(self) -> Snapshot | None:
        """The newest complete snapshot on live nodes (a collective: rank 0 asks the keeper, every rank gets its
        answer). Its skipped newer snapshots are warned about once, by rank 0."""
        answer: list[Any] = [None]
        if self.rank == 0 and self.keeper is not None:
            try:
                rollbacks = self.rollbacks.rollbacks() if self.rollbacks is not None else []
                for first, _ in rollbacks:  # no snapshot of a rollback's diverging steps is ever used (once each)
                    self.keeper.forget_rollback(int(first), timeout_s=120)
                choice = self.keeper.choose(timeout_s=60)
            except Exception as e:  # the tier never stops a restart: the durable checkpoint is there
                self.passed_over = (PassedOver(None, Passed.UNASKED, error=error_text(e)),)
                log.warning("in-memory snapshots: %s; resuming from storage", render(self.passed_over[0]))
            else:
                self.passed_over = choice.skipped
                for skipped in choice.skipped:
                    log.warning("in-memory snapshots: %s; trying the one before", render(skipped))
                if choice.step is not None and choice.manifest is not None:
                    m = choice.manifest
                    progress = Progress.from_dict(m["progress"])
                    answer = [Snapshot(choice.step, progress, int(m["world_size"]), choice.alive)]
        if self.keeper is None:
            return None
        (found,) = self._agree.broadcast(answer)
        return found  # type: ignore[no-any-return]

    def starting_at(self, step: int) -> None:
        """The group starts at ``step`` (from a snapshot, a checkpoint, or 0; a collective): the stores forget
        newer snapshots, so the ones this group makes replace them, and from now on refuse what an older group
        still sends (rank 0 asks, before the first step; every rank gets the group's generation)."""
        answer = Rewound()
        if self.rank == 0 and self.keeper is not None:
            try:
                rewound = self.keeper.rewind(step, timeout_s=120)
            except Exception as e:  # training does not wait on the tier: this group takes no snapshots (below)
                answer = Rewound(refused=Refusal(Refused.NOT_REWOUND, step, error=error_text(e)))
            else:
                answer = Rewound(int(rewound.generation))
                if rewound.late:
                    log.warning(
                        "in-memory snapshots: the stores on %s did not answer the rewind", ", ".join(rewound.late)
                    )
        (answer,) = self._agree.broadcast([answer])
        self._started_at = step
        if answer.refused is None:
            self.generation = answer.generation
        elif self.taking:  # the stores would refuse this group's snapshots (or keep newer ones it would mix with)
            self._stop((answer.refused,))

    def load(self, t: Any, snapshot: Snapshot) -> Progress:
        """Restore ``snapshot`` into ``t`` (a collective: every rank reads the files holding its shards from the
        stores that answered the choice, its own node's first). When any rank cannot, the snapshot is forgotten and
        the group fails at once (:class:`SnapshotUnreadable`): its restart resumes from the checkpoint."""
        live = {n: h for n, h in self.stores.items() if n in snapshot.nodes}
        ordered = dict(sorted(live.items(), key=lambda item: item[0] != self.node))  # this node's first
        error: Exception | None = None
        try:
            load_from_memory(fetcher(ordered, snapshot.step, node=self.node), t.model, t.optimizer, t.scheduler)
        except Exception as e:
            error = e
        if self._agree.all_true(error is None):
            return snapshot.progress
        if self.rank == 0 and self.keeper is not None:
            with contextlib.suppress(Exception):
                self.keeper.rewind(snapshot.step - 1, timeout_s=120)
        raise SnapshotUnreadable(
            f"the in-memory snapshot of step {snapshot.step} could not be read ({error or 'on another rank'}); it is "
            "forgotten and the group restarts from the newest checkpoint"
        )

    def committed(self, step: int) -> None:
        """Rank 0: a durable checkpoint of ``step`` was committed. The stores of nodes this group does not run on hold
        only snapshots from before its start (they were rewound to it), which a restart no longer prefers to this
        checkpoint: those stores go (:meth:`MemoryTier.retire`), so that the nodes the group left can go idle. (A
        group on one node takes no snapshots: this is how its off-group stores go; one on several retires them at a
        seal, often before this.)"""
        if not self._takes or self.rank != 0 or self.keeper is None or not self.generation:
            return
        off = sorted(set(self.stores) - set(self.ring))
        if off and step > self._started_at:
            self._retire(off, step, self.generation)

    def metrics(self) -> dict[str, float]:
        """Rank 0's at a log step, while this group takes snapshots: how long the step waited for the last snapshot
        (``memory_snapshot_blocked_s``: its staging copy and its completion), the bytes each node's store holds
        (``memory_checkpoint_bytes/node-…``, as of the last complete snapshot) and the most any one holds
        (``memory_checkpoint_bytes``: under half of the per-node bound, ``checkpoint.memory_store_gib``, or the next
        snapshot does not fit beside it)."""
        if not (self.taking and self.held):
            return {}
        return {
            "memory_snapshot_blocked_s": self.blocked_s,
            "memory_checkpoint_bytes": float(max(self.held.values())),
            **{f"memory_checkpoint_bytes/{node_label(n)}": float(b) for n, b in sorted(self.held.items())},
        }

    # -- saving ----------------------------------------------------------------------------------------------
    def due(self, step: int, *, final: bool, checkpoint: bool = False) -> bool:
        """A snapshot step: every ``memory_every_n_steps``, and every ``checkpoint`` step while snapshots are taken
        (a restart prefers a snapshot at the newest checkpoint's step: the same state, read from memory), except the
        group's ``final`` step (the run's end, a preemption notice: its checkpoint is synchronous, and no snapshot
        outlives the group)."""
        every = self.every or 0
        return self.taking and not final and (checkpoint or (every > 0 and step % every == 0))

    def in_flight(self, wait_s: float = 0.0) -> bool:
        """Whether a snapshot's write is still going on in this rank's thread after waiting up to ``wait_s`` for it
        (alone: the caller then takes none this step rather than wait longer)."""
        return self._writing is not None and not self._writing.done.wait(wait_s)

    def close(self) -> None:
        """No more snapshots by this object: its thread ends after the write in flight (which finishes on its own),
        and with it what the thread holds (the staging and file buffers)."""
        self.taking = False
        if self._thread is not None:
            self._queue.put((None, None))

    def written(self, timeout_s: float = 300.0) -> bool:
        """After every step, before it is logged: the snapshot being written (the previous step's, when there is
        one every step) is waited for and completed (a collective), so the step before any logged step is always
        restorable. The step waits only when the write is slower than the step was. True when it is complete."""
        writing = self._writing
        if writing is None:
            return False
        waited = time.perf_counter()
        stuck = not writing.done.wait(timeout_s)  # its thread may still be in the group's collectives: the last one
        complete = self._complete(stuck, timeout_s)
        self.blocked_s = writing.staged_s + time.perf_counter() - waited
        return complete

    def save(self, t: Any, progress: Progress) -> None:
        """Start this step's snapshot: staged to host memory now (the step waits for that copy only), then written,
        copied to the stores and completed by this rank's background thread while the next step trains."""
        self.written()  # (none in flight: the loop completed it before logging this step)
        if not self.taking:  # (its write never ended: its buffers may still be read, and no more are taken)
            return
        started = time.perf_counter()
        writing = _Writing(replace(progress), started, self.generation)  # (as of this step: the loop moves on)
        failed: Refusals = ()
        try:
            if self._snapshotter is None:  # (the group's training: built once, before its first snapshot)
                self._snapshotter = Snapshotter(t.model, t.optimizer, t.scheduler)
            staged = self._snapshotter.stage()
        except Exception as e:  # host memory: no rank's thread may start this snapshot's collectives
            failed = (Refusal(Refused.NOT_STAGED, progress.step, self.rank, error=error_text(e)),)
        if any(why := self._agree.gather(failed)):  # a collective: whether every rank's write can go on
            self._stop(next(w for w in why if w))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._background, name="raytrn-snapshot", daemon=True)
            self._thread.start()
        self._writing = writing
        writing.staged_s = time.perf_counter() - started
        self._queue.put((writing, staged))

    def _background(self) -> None:
        """This rank's snapshot thread: for each staged snapshot, its DCP write into memory, its copies on the stores
        and the group's agreement on it (its collectives on the group's snapshot group, never the step's): rank 0
        then adds the manifest and the stores free the older snapshots."""
        while True:
            writing, staged = self._queue.get()
            if writing is None:  # (close)
                return
            step = writing.progress.step
            try:
                assert self._snapshotter is not None
                files = self._snapshotter.write(staged, process_group=self._group, alone=self.alone)
                writing.reason = publish(
                    self.ring, self.node, step, self.rank, files, replicas=self.job.checkpoint.memory_replicas,
                    generation=writing.generation, writer=self._slabs,
                )  # fmt: skip
            except Exception as e:  # a failed write or copy fails this snapshot, never the step
                writing.reason = (Refusal(Refused.NOT_WRITTEN, step, self.rank, error=error_text(e)),)
            try:
                reasons = self._agree.gather(writing.reason, group=self._group)  # every rank's copies kept?
                if self.rank == 0 and not any(reasons):
                    reasons = [self._seal(writing)]
                (writing.reason,) = self._agree.broadcast([next((r for r in reasons if r), ())], group=self._group)
            except Exception as e:  # a rank gone mid-agreement: the restart decides
                writing.reason = writing.reason or (Refusal(Refused.NOT_AGREED, step, error=error_text(e)),)
            del staged  # (its buffers are the writer's; nothing of this snapshot is held while the thread waits)
            writing.done.set()

    def _seal(self, writing: _Writing) -> Refusals:
        """Rank 0, once every rank's copies are kept: the manifest on the ring's stores, then the seal, which frees
        the older snapshots; the stores of the run's other nodes (no longer in the group: theirs are older) then go
        (:meth:`MemoryTier.retire`), so that an unused node is idle. Empty when both are done, else why not."""
        progress, gen = writing.progress, writing.generation
        manifest = {
            "step": progress.step,
            "world_size": self.world_size,
            "progress": asdict(progress),
            "nodes": sorted(self.ring),  # where the copies went: a warning names those lost
        }
        replicas = self.job.checkpoint.memory_replicas
        reason = publish(
            self.ring, self.node, progress.step, 0, None, replicas=replicas, manifest=manifest, generation=gen
        )
        if reason:
            return reason
        held = _answers({node: store.seal(progress.step, gen) for node, store in self.ring.items()}, timeout_s=60)
        if held is None or None in held.values():  # (None: refused, a newer group started)
            return (Refusal(Refused.SEAL_UNANSWERED, progress.step),)
        writing.held = {node: nbytes for node, nbytes in held.items() if nbytes is not None}
        off_ring = sorted(set(self.stores) - set(self.ring))
        if off_ring and self.taking and self.keeper is not None:  # (a closed writer's late seal retires nothing)
            self._retire(off_ring, progress.step, gen)
        return ()

    def _stop(self, why: Refusals) -> None:
        """No more snapshots in this worker group (every rank): a background write on its group never ended (another
        write there would mix with its collectives), or the stores were not rewound for the group (they would refuse
        its snapshots). Restores, the newest complete snapshot and the durable checkpoints are unaffected."""
        self.taking, self._writing = False, None
        if self.rank == 0:
            log.warning(
                "in-memory snapshots stop for this worker group: %s; the newest complete snapshot and the durable "
                "checkpoints stay, and the group's next restart takes snapshots again", render(why),
            )  # fmt: skip

    def _complete(self, stuck: bool, timeout_s: float) -> bool:
        """Agree on the written snapshot (a collective): complete when every rank's thread ended saying so (the
        manifest and the seal are done then). A thread that has not ended (``stuck``) stops the group's snapshots;
        one that ended without agreement drops the snapshot (never sealed then), with one warning per kind of
        failure."""
        writing, self._writing = self._writing, None
        if writing is None:
            return False
        progress = writing.progress
        late = (Refusal(Refused.WRITE_LATE, progress.step, self.rank, timeout_s=timeout_s),)
        reasons: list[Refusals] = self._agree.gather(
            late if stuck else writing.reason
        )  # (a thread may change its reason)
        if not any(reasons):
            if self.rank == 0:
                self.held = writing.held
                log.debug(
                    "in-memory snapshot of step %d in %.2f s", progress.step, time.perf_counter() - writing.started
                )
            return True
        why = next(r for r in reasons if r)
        if any(r.kind is Refused.WRITE_LATE for rs in reasons for r in rs):  # a thread still going: it may yet seal
            self._stop(why)  # it (then complete and usable, so not dropped)
            return False
        for store in self.ring.values():
            store.drop(progress.step, writing.generation)
        kind = tuple(r.kind for r in why)  # one warning per kind of failure, not per step
        if self.rank == 0 and kind not in self._warned:
            self._warned.add(kind)
            log.warning(
                "in-memory snapshot of step %d skipped: %s; training goes on (the same failure again is not "
                "warned about; checkpoint_failures counts durable saves only)", progress.step, render(why),
            )  # fmt: skip
        return False


class _Alone:
    """The agreements of a rank that snapshots by itself (``MemorySnapshots(alone_on=...)``): its own value, no
    collective."""

    @staticmethod
    def gather(value: Any, *, group: Any = None) -> list[Any]:
        return [value]

    @staticmethod
    def broadcast(value: list[Any], *, group: Any = None) -> list[Any]:
        return value

    @staticmethod
    def all_true(value: bool, *, group: Any = None) -> bool:
        return bool(value)


def _answers(pending: dict[str, Pending[T]], *, timeout_s: float) -> dict[str, T] | None:
    """Each answer by key (waited for together); None when one does not come in time or fails (its store's node is
    gone)."""
    if not all(wait_all(list(pending.values()), timeout_s)):
        return None
    try:
        return {key: answer.result() for key, answer in pending.items()}
    except Exception:
        return None
