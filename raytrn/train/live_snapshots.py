"""The memory tier under ``scaling.recovery: live`` (:mod:`raytrn.train.live_loop`; the tier:
:mod:`raytrn.train.snapshots`, :mod:`raytrn.checkpoint.memory`).

A lost replica costs the live group nothing that a snapshot could give back: the survivors hold the state and a
newcomer takes it from them. What the tier is for under live recovery is the fallback: every replica lost at once
(their processes killed, a crash on every replica), after which Ray Train restarts the whole group. That restart
resumes, as the restart path's does, from the newest complete in-memory snapshot when it is at least as new as the
newest committed checkpoint: at most one step trained again with a snapshot every step, nothing read from storage.

Every replica holds the whole state, so one writes it: the live group's rank 0, *alone* (no collective: a lost
member can never break a snapshot, and nothing waits for one), at every checkpoint step (the fallback then reads
that step's state from memory, not storage) and every ``checkpoint.memory_every_n_steps`` when set (N: at most N - 1
steps trained again), never the group's final step. Auto is the checkpoint steps only: every step (the restart
path's auto) slowed the live bench's node loss and return on a 2-core rig (2.9 -> 4.6 s, 9.4 -> 13.9 s, medians of 3)
for a fallback that only a loss of every replica at once needs. Its copies go to its own node's store and to the
next ``checkpoint.memory_replicas`` nodes of the ring over the live members' nodes (each member posts its node in
the live store). The founders of a full start restore through the tier (a collective over the founders, as the
restart path's group does), which rewinds the stores to the step they start at; the live store keeps the stores'
generation, and whoever is rank 0 writes in it. A member that becomes rank 0 (its predecessor lost or gone) takes
over in the same generation: every snapshot, whichever rank 0 wrote it, is of a step the live group committed, so a
lingering predecessor's late copies hold the same state (and a seal never moves a store back). After a member is
lost, rank 0 leaves its snapshot in flight (which may wait on the lost node's store until Ray marks the node dead)
and goes on with a new writer. Rank 0 waits at most 2 s for a snapshot still being written and copied (the step
after a slow write); past that the next due one is not taken. A non-finite rollback in place rewinds the stores to
the step it went back to (a new generation: the diverging steps' snapshots are forgotten; the rollback marked done
with the keeper), in a thread of rank 0's.

Cost: rank 0 stages its whole replica's state to host memory at each snapshot step (the restart path's ranks each
stage their shard), and the others wait for that copy at the next all-reduce; the DCP write and the copies run in
rank 0's snapshot thread beside the next step. The tier is on by the restart path's rule (null: on a cluster of more
than one node; 0: off).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from raytrn.checkpoint.memory_clients import SnapshotKeeper
from raytrn.checkpoint.progress import Progress
from raytrn.config import JobSpec
from raytrn.tracking.roles import RollbackRegistry
from raytrn.train.live.group import LiveGroup
from raytrn.train.snapshots import MemorySnapshots

log = logging.getLogger(__name__)

#: The live store's key of a member's node (a Ray node id), read by the rank 0 that snapshots.
NODE_KEY = "node/"
#: The longest rank 0 waits at a step's end for its snapshot in flight (the others wait for it at the next
#: all-reduce); past it the step takes none (a store's node lost: its copy hangs until Ray marks the node dead).
WAIT_S = 2.0
#: The live store's key of the stores' generation rank 0 writes in (set by the founding rank 0, and at a rollback).
GENERATION_KEY = "memory/generation"


class LiveSnapshots:
    """One live replica's side of the memory tier (a no-op without the run's keeper)."""

    def __init__(
        self, job: JobSpec, keeper: SnapshotKeeper | None, group: LiveGroup, node: str,
        rollbacks: RollbackRegistry | None = None,
    ) -> None:  # fmt: skip
        self.job, self.keeper, self.group, self.rollbacks, self.node = job, keeper, group, rollbacks, node
        self.on = keeper is not None and job.checkpoint.memory_every_n_steps != 0
        #: This member's writer while it is the live rank 0 (None otherwise).
        self.writer: MemorySnapshots | None = None
        self._members: tuple[str, ...] = ()  # the members the writer's ring is over
        self._restorer: MemorySnapshots | None = None
        self._rewind: tuple[int, int] | None = None  # a rollback's (first, step) rank 0 rewinds the stores for
        self._rewinding: threading.Thread | None = None
        if self.on:
            group.store.set(NODE_KEY + group.member, node)

    def restorer(self) -> MemorySnapshots | None:
        """The founders' side of the tier for their restore (every founder: a collective over them), which takes
        no snapshots; its ``starting_at`` (the restore's) rewinds the stores, and rank 0's writer goes on from there."""
        if not self.on:
            return None
        group = self.group
        restorer = MemorySnapshots(
            self.job, self.keeper, rank=group.rank, world_size=group.size, rollbacks=self.rollbacks, takes=False,
            node=self.node,
        )  # fmt: skip
        self._restorer = restorer
        return restorer

    def started(self) -> None:
        """After the founders' restore: the stores' generation it rewound them to, in the live store (rank 0)."""
        if self._restorer is not None and self._restorer.generation and self.group.rank == 0:
            self.group.store.set(GENERATION_KEY, str(self._restorer.generation))

    def step_done(self, t: Any, progress: Progress, *, final: bool, checkpoint: bool) -> None:
        """After a committed step (its evaluation and checkpoint done): rank 0 completes the snapshot in flight and,
        when due, takes this step's. It waits at most :data:`WAIT_S` for a snapshot in flight (a write slower than a
        step), and not for a rollback's rewind: while either goes on, this step's is not taken. Any other member has
        no writer."""
        if not self.on:
            return
        if self.group.rank != 0:
            self.close()
            self._rewind = None  # (the rank 0 of the rollback's step rewinds)
            return
        members = self._live_members()
        if self.writer is not None and not set(self._members) <= set(members):
            self.close()  # a member lost: its node's store may hold up the snapshot in flight (left to finish alone)
        if self.writer is not None and self.writer.in_flight(WAIT_S):
            return
        if self._rewinding is not None and self._rewinding.is_alive():
            return
        if self._rewind is not None:  # a rollback: the stores forget its snapshots, in a thread of their own
            self._start_rewind(*self._rewind)
            self._rewind = None
            return
        if not t.optimizer.state:  # (a state dict would create the optimizer's state on this replica alone)
            return
        try:
            writer = self._writer(progress.step, members)
        except Exception as e:  # the keeper or a store did not answer: the tier is an optimisation, training goes on
            log.warning("in-memory snapshots stop on this replica: %s; the durable checkpoints stay", e)
            self.on = False
            self.close()
            return
        writer.written()  # (done: no wait)
        if writer.due(progress.step, final=final, checkpoint=checkpoint):
            writer.save(t, progress)

    def rewound(self, first: int, step: int) -> None:
        """A rollback in place of the steps from ``first`` on, to ``step``: the stores forget every snapshot after
        ``step`` (the diverging ones, and the ones after it that the retrained steps replace) and the rollback is
        marked done with the keeper (a later full start keeps what is snapshotted after it). Rank 0 does it at its
        next step, in a thread (a lost node's store may hold up a rewind until Ray marks the node dead)."""
        self.close()
        self._rewind = (first, step)

    def close(self) -> None:
        """This member no longer writes (no longer rank 0, or leaving). Its snapshot in flight is left to finish on
        its own (a step the group committed: whenever it lands, it holds that step's state)."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()

    def _start_rewind(self, first: int, step: int) -> None:
        keeper, store = self.keeper, self.group.store

        def rewind() -> None:
            assert keeper is not None
            try:
                keeper.forget_rollback(first, timeout_s=120)
                rewound = keeper.rewind(step, timeout_s=120)
                store.set(GENERATION_KEY, str(rewound.generation))
            except Exception as e:  # the keeper gone: no snapshot after the rollback is taken (refused, stale)
                log.warning("in-memory snapshots: the rollback's rewind failed (%s); the durable checkpoints stay", e)

        self._rewinding = threading.Thread(target=rewind, name="raytrn-snapshot-rewind", daemon=True)
        self._rewinding.start()

    def metrics(self) -> dict[str, float]:
        """Rank 0's at a log step: the restart path's tier metrics (``memory_snapshot_blocked_s``,
        ``memory_checkpoint_bytes`` and per node)."""
        return self.writer.metrics() if self.writer is not None else {}

    def _writer(self, step: int, members: tuple[str, ...]) -> MemorySnapshots:
        """This rank 0's writer, its ring over the live members' nodes (``members``): made after a loss, a rollback or a
        takeover (in the group's generation, from the live store), its ring widened when newcomers joined."""
        if self.writer is not None and members == self._members:
            return self.writer
        store = self.group.store
        nodes = [
            store.get(NODE_KEY + m).decode() for m in members if m != self.group.member and store.check([NODE_KEY + m])
        ]
        if self.writer is None:
            self.writer = MemorySnapshots(
                self.job, self.keeper, rank=0, world_size=1, rollbacks=self.rollbacks, alone_on=nodes, node=self.node
            )
            if store.check([GENERATION_KEY]):  # the group's: whoever wrote before, it was a committed step's state
                self.writer.generation = int(store.get(GENERATION_KEY))
            else:  # (the founders' restore could not rewind the stores: this rank 0 asks)
                self.writer.starting_at(step)
                if self.writer.generation:
                    store.set(GENERATION_KEY, str(self.writer.generation))
        elif members != self._members:
            self.writer.regroup(nodes)
        self._members = members
        return self.writer

    def _live_members(self) -> tuple[str, ...]:
        return tuple(self.group.generation.members) if self.group.generation is not None else ()
