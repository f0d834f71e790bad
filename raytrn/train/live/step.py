"""One optimizer step of live recovery's replicas: the global batch split over whoever is alive, redone if one is lost.

A step's global batch is ``micro_batches`` fixed-shape micro-batches (``data.global_batch_size`` rows, micro-batch
by micro-batch in the job's one global order). Replica ``i`` of ``R`` trains micro-batches
``[i*G//R, (i+1)*G//R)`` (:func:`share`): with 3 replicas and 12 micro-batches 4 each; with 2 left, 6 each (gradient
accumulation: a larger share, never a new shape). Each micro-batch's mean loss is divided by ``G`` and the replicas'
gradients are *summed* (one flat all-reduce over the live group, the step's loss, the join count and the count of
members leaving riding in its last slots): the same gradient as one process accumulating all ``G`` micro-batches, summed in another order, at
any number of replicas.

A member lost during the step (found before the all-reduce by its heartbeat, :meth:`LiveGroup.ready`; or in it,
:class:`~raytrn.train.live.group.PeerLost`; or a peer that never reports) makes the step *abort* on every member (:meth:`LiveGroup.agree`): no parameter, moment, schedule step or data position moved,
so the survivors re-form and redo the same step over the same micro-batches with the new shares. A committed step
whose loss or gradient norm is NaN or inf (the same on every member: the gradients are reduced) moves no weight and
no optimizer state, only the learning-rate schedule (the restart path's skip, :mod:`raytrn.train.guard`). Waiting newcomers
(rank 0 reads the count, the all-reduce tells everyone) are admitted after a committed step and receive rank 0's
state (:func:`raytrn.train.live.transfer.share_state`); the next step splits the batch over all of them. A member
with a preemption notice trains its share of the step it announces it in (``leaving``), then leaves
(:meth:`LiveGroup.part`): the others re-form without it and split the next step's batch among themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raytrn.train.live.group import LeftOut, LiveGroup, PeerLost, Reformed
from raytrn.train.live.transfer import share_state

#: (micro-batch index within the step) -> that micro-batch's mean loss, with the graph to take gradients of; or a
#: pair (the objective to take gradients of, the loss to report): a MoE model's objective adds its load-balancing
#: loss, which the step's reported loss leaves out.
MicroLoss = Callable[[int], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def share(micro_batches: int, replicas: int, index: int) -> range:
    """The micro-batches of a step's ``micro_batches`` that replica ``index`` of ``replicas`` trains: contiguous,
    in the global order, every one exactly once over the replicas."""
    if not 0 <= index < replicas:
        raise ValueError(f"replica {index} of {replicas}")
    return range(index * micro_batches // replicas, (index + 1) * micro_batches // replicas)


@dataclass
class LiveStepResult:
    loss: float  # the step's mean loss over the whole global batch
    grad_norm: float  # before clipping
    micro_batches: range  # what this replica trained in the committed attempt
    replicas: int  # the live group's size when the step committed
    #: Re-formations after losses during this step, in order.
    reformed: list[Reformed] = field(default_factory=list)
    #: Attempts aborted before the one that committed.
    aborted: int = 0
    #: Newcomers wait to join (rank 0 saw them; every member learns it from the step's all-reduce): call ``admit``.
    joins_waiting: bool = False
    #: Seconds of the step spent on aborted attempts and re-formations (the goodput ledger's restart time).
    recovery_s: float = 0.0
    #: What rank 0 told every member with the step (``LiveTrainer.step``'s ``shared``).
    shared: tuple[float, ...] = ()
    #: Whether the step's loss and gradient norm were finite (else its update was skipped on every member).
    finite: bool = True
    #: Members that announced with the step that they leave after it (a preemption notice): call ``group.part``.
    leaving: tuple[str, ...] = ()

    @property
    def everyone_leaves(self) -> bool:
        """Every member announced it leaves: nobody is left to re-form with."""
        return len(self.leaving) == self.replicas


@dataclass
class LiveTrainer:
    """A replica's model, optimizer and schedule, stepped over the live group."""

    group: LiveGroup
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    grad_clip_norm: float | None = None

    def step(
        self, step: int, micro_batches: int, micro_loss: MicroLoss, shared: Sequence[float] = (), *,
        leaving: bool = False,
    ) -> LiveStepResult:  # fmt: skip
        """Train step ``step`` (``micro_batches`` micro-batches; ``micro_loss(k)`` is micro-batch ``k``'s mean loss)
        until every live member commits it. ``shared``: values rank 0 tells every member with the step (a stop
        request: they ride in the all-reduce; every rank passes as many, only rank 0's count; ``LiveStepResult.shared``).
        ``leaving``: this member leaves after the step (a preemption notice; every member learns it from the
        step: ``LiveStepResult.leaving``). Raises :class:`LeftOut` if the others re-formed without this member (it
        must :meth:`rejoin`)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        reformed: list[Reformed] = []
        aborted = 0
        first = attempt = time.perf_counter()
        while True:
            attempt = time.perf_counter()
            mine = share(micro_batches, self.group.size, self.group.rank)
            self.optimizer.zero_grad(set_to_none=False)
            loss_sum = torch.zeros((), dtype=torch.float32)
            for k in mine:
                got = micro_loss(k)
                objective, loss = got if isinstance(got, tuple) else (got, got)
                (objective / micro_batches).backward()
                loss_sum += loss.detach().float()
            if leaving:  # announced before the all-reduce that counts it (every member reads the names after it)
                self.group.mark_leaving(step)
            if self.group.rank == 0:
                tail = torch.tensor([float(self.group.joins_waiting()), float(leaving), *map(float, shared)])
            else:
                tail = torch.tensor([0.0, float(leaving), *[0.0] * len(shared)])
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]  # an empty share: zeros
            flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss_sum.reshape(1), tail])
            ok = self.group.ready(step)  # every member here and alive, or one is gone: no collective to hang in
            if ok:
                try:
                    self.group.all_reduce(flat)
                except PeerLost:
                    ok = False
            if self.group.agree(step, ok):
                break
            aborted += 1
            reformed.append(self.group.reform("lost"))
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
            offset += p.numel()
        norm = (
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip_norm)
            if self.grad_clip_norm
            else torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))  # type: ignore[arg-type]
        )
        n = sum(p.numel() for p in params)
        finite = bool(torch.isfinite(norm)) and bool(torch.isfinite(flat[n]))  # the same on every member
        if finite:  # a NaN/inf step's update is skipped, as the restart path's (raytrn.train.guard): nothing moves
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return LiveStepResult(
            loss=float(flat[n]) / micro_batches,
            grad_norm=float(norm),
            micro_batches=mine,
            replicas=self.group.size,
            reformed=reformed,
            aborted=aborted,
            joins_waiting=bool(flat[n + 1] > 0),
            recovery_s=attempt - first,
            shared=tuple(float(v) for v in flat[n + 3 :]),
            finite=finite,
            leaving=self.group.leaving(step) if flat[n + 2] > 0 else (),
        )

    def admit(self, progress: dict[str, Any]) -> Reformed:
        """After a step whose result says ``joins_waiting`` (every member calls it): re-form with the newcomers and
        send them rank 0's state and ``progress`` (the step, the data position: plain values)."""
        reformed = self.group.reform("joined")
        self.share(progress)
        return reformed

    def share(self, progress: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0's model, optimizer and schedule state and its ``progress`` on every member (a newcomer's first act;
        survivors keep their own, which is bit-equal); returns rank 0's ``progress``."""
        mine = None
        if self.group.rank == 0:
            mine = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "progress": progress}  # fmt: skip
        state = share_state(self.group, mine)
        if self.group.rank != 0 and progress is None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        return dict(state["progress"])

    def rejoin(self, deadline_s: float) -> dict[str, Any]:
        """Join the live group (a newcomer, or a member left out) and take its state; returns rank 0's progress."""
        self.group.join(deadline_s)
        return self.share(None)


__all__ = ["LeftOut", "LiveStepResult", "LiveTrainer", "MicroLoss", "share"]
