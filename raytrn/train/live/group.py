"""Live recovery's process group: torch.distributed's default group, re-formed among the live replicas.

A *member* is one replica's process (``parallel.data_parallel: hsdp`` with one worker a replica group: one node's
worker); it is named by a string that stays its own for its life (``ip:pid``). The members of the job share one
c10d store (a ``TCPStore`` served by a process that outlives the replicas: the driver under Ray, the test's own
process without it) and, at any time, one *generation*: a numbered, ordered member list. A member's rank is its
index in the list; the default process group of generation ``n`` is rendezvoused under the store prefix
``live/g{n}/pg/``, so every collective raytrn issues (the gradients' all-reduce, the step protocol's) runs over the
live members only, whatever code issues it.

What re-forms a group:

* **A member is lost.** A collective fails: gloo raises at once when a peer's process died (its connections
  close), and after ``timeout_s`` when a peer is frozen (SIGSTOP, a hung host). The survivors each call
  :meth:`LiveGroup.reform`: they mark their arrival at generation ``n + 1`` and wait for every other member of ``n``
  that is alive: each member's thread bumps a heartbeat counter in the store every :data:`HEARTBEAT_S`, and one whose
  counter stands still for ``dead_after_s`` is gone (a killed process, a frozen one, a lost node: a member whose
  parent process dies, under Ray its node's raylet, stops beating); a slow survivor is waited for (up to
  ``timeout_s``). The first to stop waiting writes the member list with the store's
  compare-and-set: one decision, read by all. A member that arrives after it anyway finds itself left out and joins
  as a newcomer (below), so a late survivor costs a state copy, never a split.
* **A member leaves** on a preemption notice (:meth:`LiveGroup.mark_leaving`, before a step's all-reduce, which
  counts the announcements): after that step, which it trained its share of, it leaves and the others re-form
  without it at once (:meth:`LiveGroup.part`): no step aborted, no heartbeat's silence waited for.
* **A newcomer asks to join** (:meth:`LiveGroup.join`, a returning node's worker). Its request is a numbered store
  key; the members see the count (:meth:`LiveGroup.joins_waiting`, rank 0 reads it and the step's all-reduce tells
  the others), re-form at the same step boundary with the newcomers appended, and rank 0 broadcasts the training
  state to everyone (:meth:`LiveGroup.broadcast`): nothing is read from the checkpoint store.

Whether a step's update is applied is itself agreed (:meth:`LiveGroup.agree`): a collective can complete on one
rank and fail on another (a peer lost after its last message), so each rank reports its outcome and one
compare-and-set decides ``commit`` (every member's collectives completed) or ``abort`` (any failed, or a member
that has not reported stopped beating, or did not report within ``timeout_s``); an aborted step is redone by the
next generation, so the model, the optimizer, the schedule and the data position move only on a committed step.

Pure torch.distributed (no Ray): :mod:`tests.unit.test_live_group` runs it on real gloo processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

#: Every store key live recovery writes starts with this (a store shared with other users stays readable).
PREFIX = "live/"
_POLL_S = 0.002
_JOIN_POLL_S = 0.05
_DECIDE_POLL_S = 0.02
#: The store key of the run's end (:meth:`LiveGroup.finish`): read by members that left and by newcomers.
_FINISHED = PREFIX + "finished"
#: How often a member's heartbeat thread bumps its store counter.
HEARTBEAT_S = 0.25
#: How long the founders of a live group wait for each other to start (their workers start apart: imports, builds).
FOUND_DEADLINE_S = 600.0


def _heartbeat_key(member: str) -> str:
    """The store counter ``member``'s heartbeat thread bumps (it exists once the member has started beating)."""
    return f"{PREFIX}hb/{member}"


class PeerLost(RuntimeError):
    """A collective of the live group failed or timed out: a member is gone (or frozen past ``timeout_s``)."""


class LeftOut(RuntimeError):
    """This member was not in the generation the others decided (it arrived late): it must join as a newcomer."""


class GroupGone(RuntimeError):
    """Every member of the live group's newest generation stopped beating before this newcomer was admitted: nobody is
    left to admit it or hand it the state (every replica lost, seen by Ray apart): it fails, and once every replica
    has, Ray Train restarts the whole group."""


class GroupEnded(RuntimeError):
    """The live group finished its run (:meth:`LiveGroup.finish`) before this newcomer was admitted: nothing to join
    (a replacement Ray Train started for a replica lost, or hung, near the run's end)."""


@dataclass(frozen=True)
class Generation:
    """One membership of the live group: ``members`` in rank order; ``joins`` join requests admitted so far."""

    number: int
    members: tuple[str, ...]
    joins: int = 0

    def rank_of(self, member: str) -> int:
        return self.members.index(member)

    def encode(self) -> str:
        return json.dumps({"members": list(self.members), "joins": self.joins})

    @classmethod
    def decode(cls, number: int, text: bytes | str) -> Generation:
        record = json.loads(text)
        return cls(number, tuple(record["members"]), int(record["joins"]))


@dataclass(frozen=True)
class Reformed:
    """A re-formation, as the MLflow run records it: why, the replicas before and after, how long it took."""

    reason: str  # "lost" | "joined" | "left" (members left on a preemption notice, at a step boundary)
    before: Generation
    after: Generation
    seconds: float

    @property
    def lost(self) -> tuple[str, ...]:
        """Members of ``before`` not in ``after``: lost, or (``reason == "left"``) left on a preemption notice."""
        return tuple(m for m in self.before.members if m not in self.after.members)

    @property
    def joined(self) -> tuple[str, ...]:
        return tuple(m for m in self.after.members if m not in self.before.members)


class Heartbeats:
    """What one member has seen of the others' heartbeat counters while it waits for them: a member whose counter
    has not moved for ``dead_after_s`` since this watch first read it is gone."""

    def __init__(self, store: dist.Store, dead_after_s: float) -> None:
        self.store, self.dead_after_s = store, dead_after_s
        self._seen: dict[str, tuple[int, float]] = {}  # member -> (its counter, when this watch saw it move)
        self._polled = 0.0  # when any_silent last read the counters

    def silent(self, member: str, now: float) -> bool:
        count = self.store.add(_heartbeat_key(member), 0)
        seen = self._seen.get(member)
        if seen is None or seen[0] != count:
            self._seen[member] = seen = (count, now)
        return now - seen[1] >= self.dead_after_s

    def any_silent(self, members: Sequence[str], now: float) -> bool:
        """Whether one of ``members`` (those not at a decision point yet) is gone; their counters are read at most
        every :data:`_DECIDE_POLL_S` (False in between), every one of them each time."""
        if now - self._polled < _DECIDE_POLL_S:
            return False
        self._polled = now
        return any([self.silent(m, now) for m in members])  # a list, not a generator: every counter read


@dataclass
class LiveGroup:
    """This process's membership of the live group over ``store`` (see the module docstring)."""

    store: dist.Store
    member: str
    #: A collective (and a step's agreement) waits this long for a frozen peer before it counts as lost.
    timeout_s: float = 30.0
    #: A member whose heartbeat stands still this long is gone (when a generation re-forms after a loss).
    dead_after_s: float = 2.0
    backend: str = "gloo"
    generation: Generation | None = field(default=None, init=False)
    _beating: threading.Event | None = field(default=None, init=False, repr=False)

    # -- membership --------------------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._current().rank_of(self.member)

    @property
    def size(self) -> int:
        return len(self._current().members)

    def found(self, founders: Sequence[str]) -> Generation:
        """Generation 0 of ``founders`` (the same list on each of them, this member among them): the group starts."""
        if self.member not in founders:
            raise ValueError(f"member {self.member!r} is not among the founders {list(founders)}")
        self._beat()
        # Every founder present before the process group's rendezvous: that waits only timeout_s (short: it bounds
        # a frozen peer's collectives), not the founders' start-up skew (one that imports or builds slower; CI's
        # 3.12 lane founded 3 gloo members 2 s apart under load and failed at a 2 s timeout).
        deadline_s = max(self.timeout_s, FOUND_DEADLINE_S)
        try:
            self.store.wait([_heartbeat_key(m) for m in founders], timedelta(seconds=deadline_s))
        except Exception as e:  # (c10d's store timeout)
            missing = [m for m in founders if not self.store.check([_heartbeat_key(m)])]
            raise RuntimeError(f"live group: founders {missing} did not start within {deadline_s:.0f} s") from e
        proposed = Generation(0, tuple(founders))
        decided = Generation.decode(0, self.store.compare_set(self._key(0, "members"), "", proposed.encode()))
        if decided.members != proposed.members:
            raise ValueError(f"the live group was founded as {list(decided.members)}, not {list(founders)}")
        self._enter(decided)
        return decided

    def join(self, deadline_s: float) -> Generation:
        """Ask to join and wait (up to ``deadline_s``) for a generation that has this member; enter it.
        :class:`GroupEnded` as soon as the group's run has finished (nobody is left to admit it)."""
        self._beat()
        index = self.store.add(PREFIX + "joins", 1)
        self.store.set(f"{PREFIX}join/{index}", self.member)
        give_up = time.monotonic() + deadline_s
        number = 0  # generations are decided in order: walk up to the newest, then watch the next
        newest: Generation | None = None
        beats = Heartbeats(self.store, self.dead_after_s)
        while time.monotonic() < give_up:
            generation = self._decided(number)
            if generation is None:
                if self.store.check([_FINISHED]):
                    self.leave()
                    raise GroupEnded(f"live group: the run ended before {self.member} was admitted")
                now = time.monotonic()
                if newest is not None and all([beats.silent(m, now) for m in newest.members]):
                    self.leave()
                    raise GroupGone(
                        f"live group: every member of generation {newest.number} ({', '.join(newest.members)}) "
                        f"stopped beating before {self.member} was admitted: nothing to join"
                    )
                time.sleep(_JOIN_POLL_S)
                continue
            newest = generation
            if self.member in generation.members and generation.joins >= index:
                self._enter(generation)
                return generation
            number += 1
        raise TimeoutError(f"live group: {self.member} was not admitted within {deadline_s:.0f} s")

    def joins_waiting(self) -> int:
        """Join requests not yet admitted (one store read; rank 0 asks and shares the answer in the step)."""
        return self.store.add(PREFIX + "joins", 0) - self._current().joins

    def reform(self, reason: str, leaving: Sequence[str] = ()) -> Reformed:
        """Re-form after a loss (``reason="lost"``), to admit waiting newcomers (``"joined"``) or without the
        members ``leaving`` (``"left"``: they announced it in a committed step, :meth:`mark_leaving`; nobody waits
        for them); every member of the current generation that is alive (and stays) calls it. Raises
        :class:`LeftOut` when the others decided without this member. A member lost while the new group
        rendezvouses makes the next generation form (a loop). This member's process group is destroyed at once,
        before the wait for the others."""
        started, first = time.monotonic(), self._current()
        before, number = first, first.number
        # This member's connections close first: a member still blocked in a collective with it fails at once
        # instead of after timeout_s (in gloo's multi-step collectives only a lost member's direct peers see the
        # loss; the others wait on a survivor that has left the collective: 20 s against 1 s measured)
        if dist.is_initialized():
            dist.destroy_process_group()
        while True:
            number += 1
            decided = self._decide(number, before, admit=reason == "joined", leaving=leaving)
            if self.member not in decided.members:
                self._leave()
                raise LeftOut(f"live group: generation {number} formed without {self.member}")
            try:
                self._enter(decided)
            except (RuntimeError, dist.DistBackendError) as e:  # a member of it died before the rendezvous
                if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                    raise
                before = decided
                continue
            return Reformed(reason, first, decided, time.monotonic() - started)

    def leave(self) -> None:
        """Drop out of the live group (the end of the run): the process group is destroyed, the heartbeat stops."""
        self._leave()
        if self._beating is not None:
            self._beating.set()
            self._beating = None

    def mark_leaving(self, step: int) -> None:
        """Announce, before step ``step``'s all-reduce, that this member leaves after the step (a preemption notice:
        its node is drained, or it got a SIGTERM). Every member learns who from :meth:`leaving` once the step's
        all-reduce (which counts the announcements) completed."""
        self.store.set(self._key(self._current().number, f"leave{step}/{self.member}"), "1")

    def leaving(self, step: int) -> tuple[str, ...]:
        """The members that announced at step ``step`` that they leave (after the step's all-reduce: every
        announcement was written before its member entered it, so every member reads the same list)."""
        generation = self._current()
        key = self._key(generation.number, f"leave{step}/")
        return tuple(m for m in generation.members if self.store.check([key + m]))

    def part(self, leaving: Sequence[str]) -> Reformed | None:
        """After a committed step whose members ``leaving`` announced they leave (every member calls it): a leaving
        member leaves the group (None); the others re-form without it at once, not after its heartbeat's silence."""
        if self.member in leaving:
            self.leave()
            return None
        return self.reform("left", leaving)

    def finish(self) -> None:
        """The run's end, for members that left and wait for it (:meth:`wait_for_end`); rank 0 calls it."""
        self.store.set(_FINISHED, "1")

    def wait_for_end(self, poll_s: float = 0.5) -> None:
        """A member that left: wait until the run ends (:meth:`finish`) or its store is gone (the driver ended)."""
        while True:
            try:
                if self.store.check([_FINISHED]):
                    return
            except Exception:  # the store's server is gone: the run ended
                return
            time.sleep(poll_s)

    # -- collectives -------------------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the members in place; :class:`PeerLost` when a member is gone."""
        with self._collective():
            dist.all_reduce(tensor)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Copy ``tensors`` from rank ``src`` to every member, in place (a newcomer's state, bit for bit)."""
        with self._collective():
            for tensor in tensors:
                dist.broadcast(tensor, src)

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        """A collective's failure as :class:`PeerLost` (its first line: gloo's own, naming the peer)."""
        try:
            yield
        except (RuntimeError, dist.DistBackendError) as e:
            raise PeerLost(f"live group generation {self._current().number}: {str(e).splitlines()[0]}") from e

    def ready(self, step: int, *, what: str = "s") -> bool:
        """Before a collective: whether every member is alive and at it (``go``), or one is gone (``abort``: its
        heartbeat stood still for ``dead_after_s``, or it did not come within ``timeout_s``). One decision, as
        :meth:`agree`'s. Gloo cannot abandon a collective a dead peer never answers (it waits its timeout, even
        when aborted), so a lost member is found here, before the collective, where the heartbeats tell."""
        generation = self._current()
        key = self._key(generation.number, f"ready-{what}{step}")
        self.store.set(f"{key}/{self.member}", "1")
        give_up = time.monotonic() + self.timeout_s
        beats = Heartbeats(self.store, self.dead_after_s)
        while not self.store.check([key + "/verdict"]):
            verdict = None
            missing = [m for m in generation.members if not self.store.check([f"{key}/{m}"])]
            now = time.monotonic()
            if not missing:
                verdict = "go"
            elif now > give_up or beats.any_silent(missing, now):  # (the heartbeats of those not here yet)
                verdict = "abort"
            if verdict is not None:
                self.store.compare_set(key + "/verdict", "", verdict)
                break
            time.sleep(_POLL_S)
        return self.store.get(key + "/verdict") == b"go"

    def agree(self, step: int, ok: bool, *, what: str = "s") -> bool:
        """Whether step ``step``'s update is applied (``what``: ``s``, or ``save`` for its checkpoint): ``commit``
        when every member reports ``ok``; ``abort`` when one reports a failure, or one that has not reported is gone
        (its heartbeat stood still for ``dead_after_s``: killed after the step's collectives, or while rank 0
        commits a checkpoint the others have finished writing) or does not report within ``timeout_s``. One
        decision (a compare-and-set), the same on every member whatever order they arrive in (a frozen one that
        thaws reads it too)."""
        generation = self._current()
        key = self._key(generation.number, f"{what}{step}")
        if not ok:
            self.store.add(key + "/bad", 1)
        self.store.set(f"{key}/done/{self.member}", "1")
        give_up = time.monotonic() + self.timeout_s
        beats = Heartbeats(self.store, self.dead_after_s)
        while not self.store.check([key + "/decided"]):
            verdict = None
            missing = [m for m in generation.members if not self.store.check([f"{key}/done/{m}"])]
            now = time.monotonic()
            if self.store.add(key + "/bad", 0) > 0 or now > give_up:
                verdict = "abort"
            elif not missing:
                verdict = "abort" if self.store.add(key + "/bad", 0) > 0 else "commit"
            elif beats.any_silent(missing, now):  # the heartbeats of those that have not reported
                verdict = "abort"
            if verdict is not None:
                self.store.compare_set(key + "/decided", "", verdict)
                break
            time.sleep(_POLL_S)
        committed = self.store.get(key + "/decided") == b"commit"
        if self.rank == 0 and step >= 2:  # keep the store small: two steps back is settled on every member
            old = self._key(generation.number, f"{what}{step - 2}")
            for suffix in ("/bad", "/decided", *(f"/done/{m}" for m in generation.members)):
                self.store.delete_key(old + suffix)
            ready = self._key(generation.number, f"ready-{what}{step - 2}")  # the same step's readiness (ready())
            for suffix in ("verdict", *generation.members):
                self.store.delete_key(f"{ready}/{suffix}")
        return committed

    # -- internals ---------------------------------------------------------------------------------------------

    def _current(self) -> Generation:
        if self.generation is None:
            raise RuntimeError(f"live group: {self.member} is in no generation (found() or join() first)")
        return self.generation

    @staticmethod
    def _key(number: int, what: str) -> str:
        return f"{PREFIX}g{number}/{what}"

    def _decided(self, number: int) -> Generation | None:
        key = self._key(number, "members")
        return Generation.decode(number, self.store.get(key)) if self.store.check([key]) else None

    def _decide(self, number: int, before: Generation, *, admit: bool, leaving: Sequence[str] = ()) -> Generation:
        """Generation ``number``'s members: ``before``'s that arrived, waiting (up to ``timeout_s``) for every one
        whose heartbeat goes on, except those ``leaving``; then (``admit``: a planned re-formation) the waiting
        newcomers. After a loss no newcomer is admitted: they are after the redone step, when every member expects
        them."""
        self.store.set(self._key(number, f"alive/{self.member}"), "1")
        give_up = time.monotonic() + self.timeout_s
        beats = Heartbeats(self.store, self.dead_after_s)
        arrived: list[str] = []
        while True:
            decided = self._decided(number)
            if decided is not None:
                return decided
            arrived = [m for m in before.members if self.store.check([self._key(number, f"alive/{m}")])]
            now = time.monotonic()
            waiting = [m for m in before.members if m not in arrived and m not in leaving and not beats.silent(m, now)]
            if not waiting or now > give_up:
                break
            time.sleep(_DECIDE_POLL_S)
        joins = self.store.add(PREFIX + "joins", 0) if admit else before.joins
        newcomers = [self.store.get(f"{PREFIX}join/{i}").decode() for i in range(before.joins + 1, joins + 1)]
        proposed = Generation(number, tuple(arrived) + tuple(m for m in newcomers if m not in arrived), joins)
        return Generation.decode(number, self.store.compare_set(self._key(number, "members"), "", proposed.encode()))

    def _beat(self) -> None:
        """Start this member's heartbeat: a daemon thread bumping its store counter every :data:`HEARTBEAT_S`, until
        the member leaves or its parent process dies. Under Ray a worker's parent is its node's raylet: a node
        whose raylet is gone is lost, but its workers live on until Ray marks the node dead (38 s once here) and
        may be stuck outside the group's collectives (waiting for data from the lost node); a member that stops
        beating at once is dropped by the others after ``dead_after_s``, not after ``timeout_s``."""
        if self._beating is not None:
            return
        stop = self._beating = threading.Event()
        key = _heartbeat_key(self.member)
        parent = os.getppid()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                if os.getppid() != parent:  # orphaned: under Ray its node's raylet died (the node is lost)
                    return
                try:
                    self.store.add(key, 1)
                except Exception:  # the store is gone (the run ended): nothing left to tell
                    return

        self.store.add(key, 1)
        threading.Thread(target=beat, name="raytrn-live-heartbeat", daemon=True).start()

    def _enter(self, generation: Generation) -> None:
        """Destroy this process's default group and rendezvous generation ``generation``'s."""
        self._leave()
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(self._key(generation.number, "pg/"), self.store),
            rank=generation.rank_of(self.member),
            world_size=len(generation.members),
            timeout=timedelta(seconds=self.timeout_s),
        )
        self.generation = generation

    def _leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.generation = None
