"""The in-memory checkpoint tier's building blocks (issue 29): DCP snapshots held in host memory, where they are
kept, and which one a restart can use.

A snapshot is what a durable DCP checkpoint is (:mod:`raytrn.checkpoint.dcp`: every rank's shard file and rank 0's
``.metadata``), written into a dict of bytes instead of a directory, so it reshards the same way on the way back
(N ranks' files into M ranks): :mod:`raytrn.checkpoint.memfiles` writes and reads those files. Here:

- :class:`SnapshotStore`: what one node keeps (its ranks' files and the copies of other nodes'), bounded in bytes:
  a snapshot that does not fit is refused with the bytes it needed, never an out-of-memory; a newer complete
  snapshot frees the older ones.
- :func:`replica_nodes`: ring placement, so a node's state always lives on ``replicas`` other nodes too.
- :func:`newest_restorable`: the newest snapshot whose every rank's files and manifest are on a live store, with
  why each newer one was passed over.

- :class:`RayStore`, :class:`MemoryTier`, :func:`publish`, :func:`fetcher`: on Ray, a node's store (its files
  in the node's object store), the keeper of the run's stores (one per node, pinned there), a rank's copies to its
  node and the ring's next ones, and the reads back (each file read in place). Every call of these actors goes
  through their typed clients (:mod:`raytrn.checkpoint.memory_clients`).

The loop's side (every N steps, in the background; the restore choice against the durable commit):
:mod:`raytrn.train.snapshots`; the two tiers: docs/elasticity.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from raytrn.checkpoint import slabs
from raytrn.checkpoint.memory_clients import Ensured, KeeperClient, Leased, NodeStore, StoreClient
from raytrn.checkpoint.messages import (
    Choice,
    Holding,
    ObjectLocation,
    Passed,
    PassedOver,
    Refusal,
    Refusals,
    Refused,
    SlabLocation,
    StoresRewound,
    error_text,
)
from raytrn.pending import Pending, wait_all

log = logging.getLogger(__name__)

# -- one node's store ----------------------------------------------------------------------------------------


class SnapshotStore:
    """One node's snapshots of one run: its own ranks' files and the copies it keeps for other nodes.

    Bounded: :meth:`put` refuses (returns the :class:`Refusal`) what would take it past ``capacity_bytes`` after freeing
    snapshots older than the newest complete one; it never holds more. :meth:`seal` marks a snapshot complete
    (every rank's files everywhere they belong, as the caller checked) and frees everything older.

    Every change names the worker group's ``generation`` (:meth:`MemoryTier.rewind` numbers each group's start):
    once a newer group started, what an older one still sends (a put, manifest, seal or drop in flight when it
    died) is refused, so it can never mix into, free or drop the newer group's snapshots."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = self.default_capacity() if capacity_bytes is None else capacity_bytes
        self._files: dict[int, dict[int, Kept]] = {}  # step -> rank -> its files
        self._manifests: dict[int, dict[str, Any]] = {}
        self._sealed: int | None = None
        self._generation = 0  # the newest worker group's (rewind)

    def _stale(self, generation: int, step: int, rank: int | None = None) -> Refusal | None:
        """A refusal when ``generation`` is older than the newest worker group's (``rank`` None: the manifest)."""
        if generation < self._generation:
            return Refusal(Refused.STALE, step, rank, generation=generation, current=self._generation)
        return None

    @staticmethod
    def default_capacity() -> int:
        """A quarter of this node's memory."""
        import psutil

        return int(psutil.virtual_memory().total // 4)

    @property
    def nbytes(self) -> int:
        return sum(kept.nbytes for ranks in self._files.values() for kept in ranks.values())

    def put(self, step: int, rank: int, files: Mapping[str, bytes], generation: int = 0) -> Refusal | None:
        """Keep ``rank``'s files of snapshot ``step``; None when kept, else why not (nothing is kept then). The bound
        counts everything held: the complete snapshot and the one being made (room for two, per node)."""
        sizes = {name: len(b) for name, b in files.items()}
        if reason := self._refused(step, rank, sizes, generation):
            return reason
        self._files.setdefault(step, {})[rank] = Kept(sizes, dict(files))
        return None

    def _refused(self, step: int, rank: int, sizes: Mapping[str, int], generation: int) -> Refusal | None:
        """Why ``rank``'s files of snapshot ``step`` (of ``sizes``) cannot be kept; None: they can."""
        if stale := self._stale(generation, step, rank):
            return stale
        if self._sealed is not None and step <= self._sealed:
            return Refusal(Refused.NOT_NEWER, step, rank, sealed=self._sealed)
        size = sum(sizes.values())
        previous = self._files.get(step, {}).get(rank)
        held = self.nbytes - (previous.nbytes if previous is not None else 0)
        if held + size > self.capacity_bytes:
            return Refusal(Refused.NO_ROOM, step, rank, nbytes=size, held=held, capacity=self.capacity_bytes)
        return None

    def put_manifest(self, step: int, manifest: dict[str, Any], generation: int = 0) -> Refusal | None:
        if stale := self._stale(generation, step):
            return stale
        self._manifests[step] = dict(manifest)
        return None

    def seal(self, step: int, generation: int = 0) -> int | None:
        """Snapshot ``step`` is complete: everything older is freed. Returns the bytes this store holds then (None:
        refused, from an older worker group)."""
        if self._stale(generation, step):
            return None
        self._sealed = sealed = step if self._sealed is None else max(self._sealed, step)
        self._forget(lambda s: s < sealed)
        return self.nbytes

    def _forget(self, which: Callable[[int], bool]) -> None:
        """Free the snapshots whose step ``which`` names (their files and manifests)."""
        for old in [s for s in self._files if which(s)]:
            del self._files[old]
        for old in [s for s in self._manifests if which(s)]:
            del self._manifests[old]

    def rewind(self, step: int, generation: int = 0) -> None:
        """Forget every snapshot newer than ``step`` (a worker group starts at ``step``: what it snapshots next
        replaces them; a rollback: they hold the diverging steps); from now on refuse what a worker group older
        than ``generation`` sends."""
        self._generation = max(self._generation, generation)
        self._forget(lambda s: s > step)
        if self._sealed is not None and self._sealed > step:
            self._sealed = None

    def drop(self, step: int, generation: int = 0) -> None:
        """Free snapshot ``step`` (one that will never complete: a rank failed to write it). A sealed one is kept: it
        was complete when sealed, and the seal freed every older one (only a rewind forgets it)."""
        if self._stale(generation, step) or step == self._sealed:
            return
        self._forget(lambda s: s == step)

    def holdings(self) -> dict[int, Holding]:
        steps = set(self._files) | set(self._manifests)
        return {
            s: Holding(
                ranks=set(self._files.get(s, {})),
                manifest=self._manifests.get(s),
                nbytes=sum(kept.nbytes for kept in self._files.get(s, {}).values()),
                sealed=s == self._sealed,
            )
            for s in steps
        }

    def read(self, step: int, name: str) -> bytes | None:
        """The file ``name`` of snapshot ``step`` (any rank's), None when this store has not got it."""
        kept = self._holder(step, name)
        return kept.payload[name] if kept is not None else None

    def _holder(self, step: int, name: str) -> Kept | None:
        return next((kept for kept in self._files.get(step, {}).values() if name in kept.sizes), None)


@dataclass
class Kept:
    """One rank's files of one snapshot in a store: their sizes, and the files (``{name: bytes}``; on Ray, the
    store's own object holding them, :class:`RayStore`)."""

    sizes: dict[str, int]
    payload: Any

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())


class RayStore(SnapshotStore):
    """A node's store as a Ray actor. A rank on the same node copies its files into a slab the store leases it
    (:mod:`raytrn.checkpoint.slabs`: shared memory the store keeps and reuses; :meth:`lease`, :meth:`put_slab`).
    A rank on another node (this store keeps a replica), or any rank when shared memory has no room, sends each file
    as an object of its own (a uint8 array, :func:`publish`) with the files' sizes; the store checks the bound before
    it pulls anything, then keeps its own copy of each file in its node's Ray object store, put by the store (so
    owned here: it outlives the rank that sent it). A reader asks where a file is (:meth:`locate`) and reads it in
    place: a slab or an object in shared memory on the same node, one transfer of that file from another node
    (a slab's file as an object then, :meth:`export`); never a copy through this actor's heap.

    The bound (``checkpoint.memory_store_gib``; default :meth:`default_capacity`) counts what the store keeps; the
    ranks' own objects and the copies readers pull sit in the same object store for a while, hence the margin."""

    def __init__(self, capacity_bytes: int | None = None, token: str | None = None) -> None:
        usable = token is not None and slabs.usable()
        store = _object_store_bytes() if capacity_bytes is None or usable else 0  # (one look at the cluster)
        super().__init__(self.default_capacity(store) if capacity_bytes is None else capacity_bytes)
        self._slabs = None
        if token is not None and usable:  # (Ray's object store may be in /dev/shm too: its size stays free)
            self._slabs = slabs.SlabPool(token, keep_free=store)

    @staticmethod
    def default_capacity(object_store_bytes: int = 0) -> int:
        """A quarter of this node's memory or a third of its Ray object store (``object_store_bytes``), the smaller
        (past the object store's size Ray would spill snapshots to disk)."""
        quarter = SnapshotStore.default_capacity()
        return int(min(quarter, object_store_bytes // 3)) if object_store_bytes else quarter

    def put(  # type: ignore[override]
        self, step: int, rank: int, files: Any, generation: int, sizes: Mapping[str, int]
    ) -> Refusal | None:
        """``files``: ``[{name: ref}]``, the rank's objects (in a list: Ray hands the references, not the values);
        ``sizes``: their bytes, checked against the bound before any is pulled here."""
        import ray

        if reason := self._refused(step, rank, sizes, generation):
            return reason
        (refs,) = files
        names = list(refs)
        try:  # in place on this node; one transfer per file from another
            arrays = ray.get([refs[n] for n in names], timeout=PUBLISH_TIMEOUT_S)
        except Exception as e:  # the rank's node gone mid-copy, or too slow: this snapshot fails here
            return Refusal(Refused.NOT_ARRIVED, step, rank, error=type(e).__name__)
        own = {n: ray.put(a) for n, a in zip(names, arrays, strict=True)}
        self._files.setdefault(step, {})[rank] = Kept(dict(sizes), own)
        return None

    def lease(self, step: int, rank: int, sizes: Mapping[str, int], generation: int) -> Leased:
        """A same-node rank's first call: why its files of snapshot ``step`` cannot be kept (``refused``), or a
        :class:`slabs.Lease` to copy them into, or neither when this store has no slab for them (no shared memory
        here, or no room: the rank sends them as objects, :meth:`put`)."""
        if reason := self._refused(step, rank, sizes, generation):
            return Leased(refused=reason)
        return Leased(lease=self._slabs.lease(step, rank, sizes) if self._slabs is not None else None)

    def put_slab(self, step: int, rank: int, lease: slabs.Lease, generation: int) -> Refusal | None:
        """The rank copied its files into ``lease``: keep them (None), or why not (its slab is freed then)."""
        if self._slabs is None or not self._slabs.holds(lease, step, rank):  # freed, or re-leased by a newer group
            return Refusal(Refused.SLAB_FREED, step, rank)
        if reason := self._refused(step, rank, lease.sizes, generation):
            self._slabs.release(lambda s, r: (s, r) == (step, rank))  # (its slab: holds() said so)
            return reason
        self._files.setdefault(step, {})[rank] = Kept(dict(lease.sizes), lease)
        return None

    def _forget(self, which: Callable[[int], bool]) -> None:
        super()._forget(which)
        if self._slabs is not None:  # (also a lease whose put never came: its rank died mid-copy)
            self._slabs.release(lambda s, _: which(s))

    def rewind(self, step: int, generation: int = 0) -> None:
        super().rewind(step, generation)
        if self._slabs is not None and generation == self._generation:  # a new worker group: the free slabs go
            self._slabs.trim()

    def locate(self, step: int, name: str) -> SlabLocation | ObjectLocation | None:
        """Where file ``name`` of snapshot ``step`` is: an object (a uint8 array), or a slab (read it in place on this
        node, or :meth:`export` it); None when this store has not got it."""
        kept = self._holder(step, name)
        if kept is None:
            return None
        if isinstance(kept.payload, slabs.Lease):
            return SlabLocation(kept.payload.path, kept.payload.offsets[name], kept.sizes[name])
        return ObjectLocation(kept.payload[name])

    def export(self, step: int, name: str) -> ObjectLocation | None:
        """File ``name`` of snapshot ``step`` as an object (for a reader on another node), None when this store has
        not got it."""
        import ray

        match self.locate(step, name):
            case SlabLocation(path, offset, size):
                view = slabs.read_slab(path, offset, size)
                return ObjectLocation(ray.put(np.frombuffer(view, dtype=np.uint8)))
            case found:
                return found

    def close(self) -> None:
        """Remove this store's slabs (the run is over)."""
        self._files.clear()
        if self._slabs is not None:
            self._slabs.close()


def _object_store_bytes() -> int:
    """This node's Ray object store's size (0 when Ray does not say)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    return int(next((n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n.get("NodeID") == node), 0))


# -- placement and choice ------------------------------------------------------------------------------------


def replica_nodes(nodes: Iterable[str], node: str, replicas: int) -> list[str]:
    """The ``replicas`` nodes that keep copies of ``node``'s snapshot: the next ones on the ring of ``nodes``
    (sorted, so every rank computes the same ring), never ``node`` itself; fewer when there are fewer others."""
    ring = sorted(set(nodes) | {node})
    i = ring.index(node)
    others = ring[i + 1 :] + ring[:i]
    return others[: max(0, replicas)]


def newest_restorable(holdings: Mapping[str, Mapping[int, Holding]], alive: Iterable[str]) -> Choice:
    """The newest snapshot whose manifest and every rank's files (0 .. the manifest's ``world_size`` - 1) are on
    a store of a live node. ``holdings``: each node's :meth:`SnapshotStore.holdings` (a lost node's: when last
    asked). A lost node's snapshot older than one a live store sealed since is not named: that seal freed it."""
    live = {n: h for n, h in holdings.items() if n in set(alive)}
    floor = max((s for h in live.values() for s, held in h.items() if held.sealed), default=-1)
    steps = sorted({s for h in holdings.values() for s in h}, reverse=True)
    steps = [s for s in steps if s >= floor or any(s in h for h in live.values())]
    skipped: list[PassedOver] = []
    for step in steps:
        manifest = next((h[step].manifest for h in live.values() if step in h and h[step].manifest), None)
        if manifest is None:
            # Sealed on a live store: it was complete, so its manifest was kept on nodes that are gone now.
            lost = sorted(n for n, h in holdings.items() if n not in live and step in h and h[step].manifest)
            complete = any(h[step].sealed for h in live.values() if step in h)
            skipped.append(PassedOver(step, Passed.NO_MANIFEST, complete=complete, lost_nodes=tuple(lost)))
            continue
        world = int(manifest["world_size"])
        have = set().union(*(h[step].ranks for h in live.values() if step in h))
        missing = sorted(set(range(world)) - have)
        if missing:
            lost = sorted(
                n for n, h in holdings.items() if n not in live and step in h and set(missing) & h[step].ranks
            )
            # The group's nodes whose stores no longer answer (their holdings were last asked before this snapshot).
            gone = sorted(set(manifest.get("nodes") or holdings) - set(live))
            skipped.append(
                PassedOver(step, Passed.RANKS_MISSING, lost_nodes=tuple(lost), gone_nodes=tuple(gone),
                           missing=tuple(missing), world_size=world)
            )  # fmt: skip
            continue
        return Choice(step, manifest, tuple(skipped))
    return Choice(None, None, tuple(skipped))


# -- the stores on Ray ---------------------------------------------------------------------------------------

#: How long a rank waits for its files to reach every store they belong on before the snapshot counts as failed.
PUBLISH_TIMEOUT_S = 60.0


class MemoryTier:
    """The driver's side: one :class:`RayStore` actor per node (zero CPUs, pinned to its node, owned by the keeper,
    so it outlives every worker group of the run), the holdings of the live ones, and the choice.

    A store keeps its own copy of what a rank sends (objects it owns, in its node's object store), so a snapshot
    does not die with the worker that made it, only with its node."""

    def __init__(self, run: str, *, capacity_bytes: int | None) -> None:
        import uuid

        self.run = run
        self.capacity_bytes = capacity_bytes
        #: Names this tier's slabs (:mod:`raytrn.checkpoint.slabs`), so that :meth:`shutdown` removes all of them.
        self.token = uuid.uuid4().hex[:12]
        self.stores: dict[str, StoreClient] = {}
        self._seen: dict[str, dict[int, Holding]] = {}  # each store's last answer: why a lost one's snapshot is gone
        self._rolled_back: set[int] = set()
        self._answered: set[str] = set()  # the stores that answered the last holdings()
        self._retiring: list[threading.Thread] = []  # the retired stores' closes (retire)
        self._asks = 0  # numbers the ensure calls
        #: Each node's last ensure: a retire whose caller's ensure came before it leaves that node's store.
        self._asked: dict[str, int] = {}
        #: Numbers the rewinds (each worker group's start): the stores refuse an older group's late sends.
        self.generation = 0

    def ensure(self, nodes: Iterable[str], *, pin: bool = True) -> Ensured:
        """A store on each of ``nodes`` (Ray node ids; ``pin=False``: any labels, all on this node, for tests):
        every store the run has, by node, and this call's number (what the caller's :meth:`retire` sends)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(RayStore)
        self._asks += 1
        nodes = list(nodes)
        self._asked.update(dict.fromkeys(nodes, self._asks))
        for node in nodes:
            if node in self.stores:
                continue
            options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
            if pin:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            handle = actor.options(**options).remote(self.capacity_bytes, self.token)  # type: ignore[attr-defined]
            self.stores[node] = StoreClient(handle)
        return Ensured(dict(self.stores), self._asks)

    def holdings(self, timeout_s: float = 10.0) -> dict[str, dict[int, Holding]]:
        """Each answering store's holdings; a store that does not answer in time (its node lost) is left out."""
        import ray

        asked = {node: store.holdings() for node, store in self.stores.items()}
        done = wait_all(list(asked.values()), timeout_s)
        out: dict[str, dict[int, Holding]] = {}
        for (node, answer), answered in zip(asked.items(), done, strict=True):
            if answered:
                try:
                    out[node] = answer.result()
                except ray.exceptions.RayActorError:  # its node (or the actor) is gone
                    continue
        self._seen.update(out)
        self._answered = set(out)
        return out

    def choose(self, timeout_s: float = 10.0) -> Choice:
        """The newest snapshot whose files are all on stores that answer (what a store that no longer answers held
        when last asked names why a newer snapshot was passed over); ``alive``: those stores."""
        alive = tuple(sorted(self.holdings(timeout_s)))
        return replace(newest_restorable(self._seen, alive), alive=alive)

    def rewind(self, step: int, timeout_s: float = 60.0) -> StoresRewound:
        """Every store forgets its snapshots newer than ``step`` (:meth:`SnapshotStore.rewind`) and from now on
        refuses what older worker groups send; waits for the stores that answered the last :meth:`holdings` (a lost
        node's would hang until Ray marks it dead). Returns the new generation (what the group starting at ``step``
        sends with its changes) and the nodes whose store did not answer in time."""
        self.generation += 1
        rewinds = {node: store.rewind(step, self.generation) for node, store in self.stores.items()}
        awaited: dict[str, Pending[None]] = {n: r for n, r in rewinds.items() if n in self._answered}
        done = wait_all(list(awaited.values()), timeout_s)
        late = sorted(node for node, answered in zip(awaited, done, strict=True) if not answered)
        return StoresRewound(self.generation, tuple(late))

    def forget_rollback(self, first: int) -> None:
        """A rollback of the steps from ``first`` on (:mod:`raytrn.train.guard`): the snapshots of those steps are
        never used. Once per rollback (a later restart keeps what the groups after the rollback snapshotted)."""
        if first in self._rolled_back:
            return
        self._rolled_back.add(first)
        self.rewind(first - 1)

    def retire(
        self, nodes: Iterable[str], step: int, generation: int, asked: int, timeout_s: float = 10.0
    ) -> tuple[str, ...]:
        """The stores on ``nodes`` go (their slabs removed): worker group ``generation``, which no longer runs there
        (a drained node, one a shrunk group left), sealed its snapshot of ``step`` on its own nodes' stores, so theirs
        hold nothing a restart could want (that seal freed their older snapshots). A node with no actor of the run
        left on it is idle, and an autoscaler can take it away; a group that comes back to the node gets a new store
        (:meth:`ensure`). Ignored when a newer group has started since (``generation`` is not the current one: its
        group's nodes are not the caller's), and for a node someone asked for after the caller's ensure number
        ``asked`` (a newer group's ensure before its rewind, a live rank 0's regroup after a late seal: the store is
        theirs). Returns the nodes whose store went: at once from this keeper's stores; their closes and ends in a
        thread of their own, so that a lost node's store, which does not answer until Ray marks the node dead
        (bounded by ``timeout_s``), holds up none of the keeper's other calls."""
        if generation != self.generation:
            return ()
        mine = [n for n in sorted(set(nodes)) if n in self.stores and self._asked.get(n, 0) <= asked]
        going = {node: self.stores.pop(node) for node in mine}
        for node in going:
            self._seen.pop(node, None)
            self._answered.discard(node)
        if going:
            ending = threading.Thread(
                target=_close_and_kill, args=(list(going.values()), timeout_s), name="raytrn-retire", daemon=True
            )
            ending.start()
            self._retiring = [*(t for t in self._retiring if t.is_alive()), ending]
            log.info(
                "in-memory snapshots: the stores on %s are removed (not in the worker group, whose snapshot of step %d "
                "is complete without them)", ", ".join(n[:12] for n in going), step,
            )  # fmt: skip
        return tuple(going)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Every store removes its slabs and goes (a retired one's end is waited for); what a store that did not
        answer left on this node is removed here (on a lost node's machine, the next store started there removes it:
        :func:`slabs.sweep`)."""
        _close_and_kill(list(self.stores.values()), timeout_s)
        self.stores.clear()
        for ending in self._retiring:
            ending.join(timeout_s)
        slabs.sweep(token=self.token)


def _close_and_kill(stores: list[StoreClient], timeout_s: float) -> None:
    """Each store removes its slabs (waited for together, up to ``timeout_s``: a lost node's does not answer), then
    goes."""
    closing = [store.close() for store in stores]
    with contextlib.suppress(Exception):
        wait_all(closing, timeout_s)
    for store in stores:
        store.kill()


def publish(
    stores: Mapping[str, NodeStore], node: str, step: int, rank: int, files: Mapping[str, bytes] | None, *,
    replicas: int, manifest: dict[str, Any] | None = None, generation: int = 0, timeout_s: float = PUBLISH_TIMEOUT_S,
    writer: slabs.SlabWriter | None = None,
) -> Refusals:  # fmt: skip
    """A rank's side: put its ``files`` of snapshot ``step`` (and rank 0 the ``manifest``, once every rank's files
    are kept; ``files`` None then) on its node's store and on the ``replicas`` next nodes of the ring, as worker
    group ``generation``. Empty once every one kept them; else why not (then the snapshot must not be used: the
    caller drops it). Its node's store gets them in a slab (copied by ``writer``, which keeps the rank's slabs
    mapped) when it has one; the other stores (and that one when it has none) as objects."""
    import ray

    targets = [node, *replica_nodes(stores.keys(), node, replicas)]
    missing = [t for t in targets if t not in stores]
    if missing:
        return (Refusal(Refused.NO_STORE, step, rank, nodes=tuple(missing)),)
    puts: list[Pending[Refusal | None]] = []
    try:
        if files is not None:
            sizes = {name: len(b) for name, b in files.items()}
            leased = stores[node].lease(step, rank, sizes, generation).result(timeout_s)
            if leased.refused is not None:
                return (leased.refused,)
            lease = leased.lease
            as_objects = targets
            if lease is not None:  # this node's copy: into the store's slab, no object
                try:
                    (writer or slabs.SlabWriter()).write(lease, files)
                except OSError:  # (the slab cannot be mapped here: as objects, and the next seal frees it)
                    lease = None
                else:
                    puts.append(stores[node].put_slab(step, rank, lease, generation))
                    as_objects = targets[1:]
            if as_objects:  # each file once in the object store, read in place by every one of them
                refs = {name: ray.put(np.frombuffer(b, dtype=np.uint8)) for name, b in files.items()}
                puts += [stores[t].put(step, rank, refs, generation, sizes) for t in as_objects]
        if manifest is not None:
            puts += [stores[t].put_manifest(step, manifest, generation) for t in targets]
    except Exception as e:
        return (Refusal(Refused.COPIES_FAILED, step, rank, error=error_text(e)),)
    try:
        if not all(wait_all(puts, timeout_s)):
            return (Refusal(Refused.COPIES_LATE, step, rank, timeout_s=timeout_s),)
        return tuple(r for r in (put.result() for put in puts) if r is not None)
    except Exception as e:  # a store's node gone mid-copy, the object store full: this snapshot fails, not the step
        return (Refusal(Refused.COPIES_FAILED, step, rank, error=error_text(e)),)


def fetcher(
    stores: Mapping[str, NodeStore], step: int, timeout_s: float = PUBLISH_TIMEOUT_S, *, node: str | None = None
) -> Callable[[str], bytes | memoryview]:
    """``fetch(name)`` for :func:`load_from_memory`: the file from the first store that has it (this node's
    first, when the caller puts it first), read in place (a read-only view): from the object store, or from the
    slab of ``node``'s store (the caller's node); another node's slab is sent as an object."""
    import ray

    def fetch(name: str) -> memoryview:
        for at, store in stores.items():
            try:
                found = store.locate(step, name).result(timeout_s)
                if isinstance(found, SlabLocation):
                    if at == node:
                        with contextlib.suppress(OSError):  # (else sent as an object, below)
                            return slabs.read_slab(found.path, found.offset, found.size)
                    found = store.export(step, name).result(timeout_s)
                if isinstance(found, ObjectLocation):
                    return memoryview(ray.get(found.ref, timeout=timeout_s))
            except Exception:  # that node is gone (or the copy lost): another copy
                continue
        raise FileNotFoundError(name)

    return fetch


def start_keeper(run: str, capacity_bytes: int | None) -> KeeperClient:
    """The driver's :class:`MemoryTier` as a zero-CPU actor on the driver's node: it creates (and so owns) every
    node's store, which then lives as long as the run's driver, across worker groups; the workers ask it for the
    stores and for the choice at a restart."""
    import ray

    from raytrn.runtime import on_this_node

    keeper = ray.remote(MemoryTier).options(num_cpus=0, max_restarts=0, **on_this_node())  # type: ignore[attr-defined]
    return KeeperClient(keeper.remote(run, capacity_bytes=capacity_bytes))
