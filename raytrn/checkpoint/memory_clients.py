"""Typed clients of the in-memory tier's actors (:mod:`raytrn.checkpoint.memory`): the run's keeper
(:class:`~raytrn.checkpoint.memory.MemoryTier`, one actor on the driver's node) and each node's store
(:class:`~raytrn.checkpoint.memory.RayStore`).

Each role is a Protocol, what the loop (:mod:`raytrn.train.snapshots`), the keeper and a rank's copies and reads
depend on, and a client here that calls the actor through its Ray handle (picklable: the worker plan carries the
keeper's, the keeper hands out the stores'). A stand-in (a test's, the bench's) implements the protocol, so mypy (or a
test's ``isinstance``: the protocols are runtime-checkable) catches a drift. Every call of these actors goes through
here (``tests/unit/test_memory_clients.py`` fails on one made elsewhere).

Each call blocks or not as its caller needs: the keeper's calls wait, bounded by the caller's ``timeout_s``; a store's
answers are :class:`~raytrn.pending.Pending`, so that a rank's copies to several stores, the seals and the keeper's
questions to every store go out together and are waited for at once (:func:`raytrn.pending.wait_all`); a drop is
fire-and-forget.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from raytrn.checkpoint.messages import Choice, Holding, ObjectLocation, Refusal, SlabLocation, StoresRewound
from raytrn.checkpoint.slabs import Lease
from raytrn.pending import Pending, RayPending

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Leased:
    """A store's answer to a same-node rank's first call (:meth:`NodeStore.lease`): why its files cannot be kept
    (``refused``), or the slab to copy them into (``lease``; None: no slab here, the rank sends them as objects)."""

    refused: Refusal | None = None
    lease: Lease | None = None


@runtime_checkable
class NodeStore(Protocol):
    """One node's store, as a rank's copies and reads and the keeper use it (each call names the worker group's
    ``generation``: the store refuses an older group's)."""

    def lease(self, step: int, rank: int, sizes: Mapping[str, int], generation: int) -> Pending[Leased]: ...
    def put_slab(self, step: int, rank: int, lease: Lease, generation: int) -> Pending[Refusal | None]: ...
    def put(
        self, step: int, rank: int, refs: Mapping[str, Any], generation: int, sizes: Mapping[str, int]
    ) -> Pending[Refusal | None]: ...
    def put_manifest(self, step: int, manifest: dict[str, Any], generation: int) -> Pending[Refusal | None]: ...
    def seal(self, step: int, generation: int) -> Pending[int | None]: ...
    def drop(self, step: int, generation: int) -> None: ...
    def holdings(self) -> Pending[dict[int, Holding]]: ...
    def rewind(self, step: int, generation: int) -> Pending[None]: ...
    def locate(self, step: int, name: str) -> Pending[SlabLocation | ObjectLocation | None]: ...
    def export(self, step: int, name: str) -> Pending[ObjectLocation | None]: ...
    def close(self) -> Pending[None]: ...


@dataclass(frozen=True)
class Ensured:
    """The keeper's answer to an ensure (:meth:`~raytrn.checkpoint.memory.MemoryTier.ensure`): every store the run
    has, by node, and the number of this call (``asked``: the keeper counts them), which the caller's later retire
    sends, so that a store someone asked for after it (a newer group's, a live rank 0's regroup) stays."""

    stores: dict[str, NodeStore]
    asked: int


@runtime_checkable
class SnapshotKeeper(Protocol):
    """The run's keeper, as a worker group uses it: every node's store, the choice at a restart, the rewinds (rank 0
    asks; each call waits up to ``timeout_s``, raising what the call raised or Ray's timeout)."""

    def ensure(self, nodes: Sequence[str], *, timeout_s: float) -> Ensured: ...
    def choose(self, *, timeout_s: float) -> Choice: ...
    def rewind(self, step: int, *, timeout_s: float) -> StoresRewound: ...
    def forget_rollback(self, first: int, *, timeout_s: float) -> None: ...
    def retire(self, nodes: Sequence[str], step: int, generation: int, asked: int) -> None: ...


class StoreClient:
    """Typed calls on a store actor's Ray handle (:class:`~raytrn.checkpoint.memory.RayStore`)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def lease(self, step: int, rank: int, sizes: Mapping[str, int], generation: int) -> Pending[Leased]:
        """A slab for ``rank``'s files of snapshot ``step`` on this store's node, or why they cannot be kept."""
        return RayPending(self.handle.lease.remote(step, rank, dict(sizes), generation))

    def put_slab(self, step: int, rank: int, lease: Lease, generation: int) -> Pending[Refusal | None]:
        """Keep the files the rank copied into ``lease`` (None), or why not."""
        return RayPending(self.handle.put_slab.remote(step, rank, lease, generation))

    def put(
        self, step: int, rank: int, refs: Mapping[str, Any], generation: int, sizes: Mapping[str, int]
    ) -> Pending[Refusal | None]:
        """Keep a copy of ``rank``'s files, ``refs`` (``{name: ObjectRef}``, of ``sizes`` bytes), or why not."""
        # (in a list: Ray hands the store the references, not the values; it pulls them once the bound allows)
        return RayPending(self.handle.put.remote(step, rank, [dict(refs)], generation, dict(sizes)))

    def put_manifest(self, step: int, manifest: dict[str, Any], generation: int) -> Pending[Refusal | None]:
        return RayPending(self.handle.put_manifest.remote(step, manifest, generation))

    def seal(self, step: int, generation: int) -> Pending[int | None]:
        """Snapshot ``step`` is complete (the older ones are freed): the bytes the store holds then, None: refused."""
        return RayPending(self.handle.seal.remote(step, generation))

    def drop(self, step: int, generation: int) -> None:
        """Free snapshot ``step``, one that will never complete (fire-and-forget)."""
        self.handle.drop.remote(step, generation)

    def holdings(self) -> Pending[dict[int, Holding]]:
        return RayPending(self.handle.holdings.remote())

    def rewind(self, step: int, generation: int) -> Pending[None]:
        """Forget the snapshots newer than ``step``; refuse what a worker group older than ``generation`` sends."""
        return RayPending(self.handle.rewind.remote(step, generation))

    def locate(self, step: int, name: str) -> Pending[SlabLocation | ObjectLocation | None]:
        """Where file ``name`` of snapshot ``step`` is (None: not here)."""
        return RayPending(self.handle.locate.remote(step, name))

    def export(self, step: int, name: str) -> Pending[ObjectLocation | None]:
        """File ``name`` of snapshot ``step`` as an object, for a reader on another node (None: not here)."""
        return RayPending(self.handle.export.remote(step, name))

    def close(self) -> Pending[None]:
        """Remove the store's slabs (the run is over)."""
        return RayPending(self.handle.close.remote())

    def kill(self) -> None:
        import ray

        ray.kill(self.handle, no_restart=True)


class KeeperClient:
    """Typed calls on the keeper actor's Ray handle (:class:`~raytrn.checkpoint.memory.MemoryTier`,
    :func:`~raytrn.checkpoint.memory.start_keeper`); the driver, which owns it, also ends it."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def ensure(self, nodes: Sequence[str], *, timeout_s: float) -> Ensured:
        """A store on each of ``nodes`` (created when missing): every store the run has, by node, and this call's
        number."""
        ensured = self._get(self.handle.ensure.remote(list(nodes)), timeout_s)
        assert isinstance(ensured, Ensured), ensured
        return ensured

    def choose(self, *, timeout_s: float) -> Choice:
        """The newest snapshot complete on the stores that answer, and why each newer one was passed over."""
        choice = self._get(self.handle.choose.remote(), timeout_s)
        assert isinstance(choice, Choice), choice
        return choice

    def rewind(self, step: int, *, timeout_s: float) -> StoresRewound:
        """Every store forgets its snapshots newer than ``step``: the new worker group's generation."""
        rewound = self._get(self.handle.rewind.remote(step), timeout_s)
        assert isinstance(rewound, StoresRewound), rewound
        return rewound

    def forget_rollback(self, first: int, *, timeout_s: float) -> None:
        """The snapshots of a rollback's steps, from ``first`` on, are never used (once per rollback)."""
        self._get(self.handle.forget_rollback.remote(first), timeout_s)

    def retire(self, nodes: Sequence[str], step: int, generation: int, asked: int) -> None:
        """The stores on ``nodes``, off the ring of worker group ``generation`` that sealed ``step``, go, but for
        those someone asked for after the caller's ensure number ``asked`` (not waited for: the keeper bounds the
        closes of a lost node's store). Never raises: a store left is removed at the run's end; its caller (a
        committed checkpoint, a sealed snapshot) must not fail for it."""
        try:
            self.handle.retire.remote(list(nodes), step, generation, asked)
        except Exception as e:  # (Ray disconnected, the keeper gone: the driver ends the run's stores)
            log.debug("in-memory snapshots: the stores on %s not retired: %r", ", ".join(nodes), e)

    def shutdown(self, *, timeout_s: float) -> None:
        """Every store removes its slabs and goes."""
        self._get(self.handle.shutdown.remote(), timeout_s)

    def kill(self) -> None:
        import ray

        ray.kill(self.handle, no_restart=True)

    @staticmethod
    def _get(ref: Any, timeout_s: float) -> Any:
        return RayPending[Any](ref).result(timeout_s)
