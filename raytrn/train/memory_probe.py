"""What a worker's memory actually was, to set against ``raytrn estimate``'s (:mod:`raytrn.estimate.memory`).

Measured once per worker group, at its second step (AdamW's state exists by then), as the largest over the workers
(every rank takes part: one all-reduce at that step):

- on a device with an allocator that counts (cuda, neuron): its peak of allocated bytes, compared with the
  estimate's total less the runtime's share (the allocator does not see the runtime);
- elsewhere (cpu): the state the worker holds, counted exactly (its local parameters, one gradient per trainable
  parameter, AdamW's moments) plus the tensors the step's forward saves for backward (each storage once, the
  parameters' excluded; one micro-batch's) and the model's output, the logits (held by the step through backward,
  saved for it by nothing: without them the tiny job measured 24% short), compared with
  :attr:`MemoryEstimate.probed`. Not measured under ``torch.compile`` or activation checkpointing, whose saved
  tensors autograd's hooks do not see.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from raytrn.backends.base import Backend
from raytrn.config import JobSpec


def local_bytes(tensor: Any) -> int:
    """Bytes of a tensor this process holds: a DTensor's local shard (FSDP, TP, EP), a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return int(local.numel() * local.element_size())


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of an optimizer's state tensors this process holds (AdamW's moments, a DTensor's local shard; not the
    scalar step counts)."""
    return sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if v.ndim)


def held_state_bytes(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Parameters, gradients and AdamW state one worker holds (exact counts of its local tensors). Gradients are
    None between steps: counted as one per trainable parameter shard, which they are during the step."""
    params = list(model.parameters())
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p) for p in params if p.requires_grad),
        "optim": optimizer_state_bytes(optimizer),
    }


@dataclass(frozen=True)
class MeasuredMemory:
    """A worker's memory (the largest over the group's workers) and what it measured."""

    bytes: int
    how: str  # "allocator" or "probe"


class MemoryProbe:
    """One measurement per worker group (see the module): :meth:`stepping` around the train step,
    :meth:`measure` after it (every rank)."""

    def __init__(self, job: JobSpec, backend: Backend, *, start_step: int, enabled: bool = True) -> None:
        self.job, self.backend = job, backend
        self.allocator = backend.peak_memory_bytes() is not None
        why = None
        if not enabled:
            why = "this backend does not measure it (the frozen XLA path: no new features)"
        elif not self.allocator and job.run.compile:
            why = "torch.compile: its saved tensors are not seen by autograd's hooks"
        elif not self.allocator and job.parallel.activation_checkpointing != "none":
            why = "activation checkpointing: its saved tensors are not seen by autograd's hooks"
        #: Why nothing is measured (None: it is, at step :attr:`at`).
        self.skipped: str | None = why
        self.at = start_step + 2 if why is None and start_step + 2 <= job.run.max_steps else None
        self.result: MeasuredMemory | None = None
        self._saved: dict[int, Any] = {}

    @contextmanager
    def stepping(self, step: int) -> Iterator[None]:
        """Around the train step ``step``: at the probe's step on a cpu worker, the storages its forward passes
        save for backward, and the logits they return, are recorded (kept until :meth:`measure`)."""
        if step != self.at or self.allocator:
            yield
            return
        saved = self._saved

        def pack(x: torch.Tensor) -> torch.Tensor:
            for plain in _plain(x):
                storage = plain.untyped_storage()
                saved.setdefault(storage.data_ptr(), storage)
            return x

        def output(module: torch.nn.Module, args: Any, out: Any) -> None:
            # The model's logits: the step holds them until its backward is done, yet nothing saves them for it
            # (the loss keeps its log-softmax, the head its input). Every module's output passes here: a tuple of
            # the model's (raytrn.models.decoder.CausalLMOutput, under DDP or FSDP too) has them.
            logits = getattr(out, "logits", None)
            if isinstance(logits, torch.Tensor):
                pack(logits)

        hook = torch.nn.modules.module.register_module_forward_hook(output)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                yield
        finally:
            hook.remove()

    def measure(self, step: int, model: torch.nn.Module, optimizer: Any, grad_accum: int) -> MeasuredMemory | None:
        """After the train step ``step`` (of ``grad_accum`` micro-batches): at the probe's step, the measurement (the
        largest over the workers, a collective); else None."""
        if step != self.at:
            return None
        if self.allocator:
            local, how = self.backend.peak_memory_bytes() or 0, "allocator"
        else:
            params = {local_param.untyped_storage().data_ptr() for local_param in _locals(model)}
            # FSDP's gathered parameters are saved too: freed (size 0) once the step is done, they drop out here
            saved = sum(s.nbytes() for ptr, s in self._saved.items() if ptr not in params)
            self._saved.clear()
            local = sum(held_state_bytes(model, optimizer).values()) + saved // max(1, grad_accum)
            how = "probe"
        value = torch.tensor([float(local)], device=self.backend.device())
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        self.result = MeasuredMemory(int(value.item()), how)
        return self.result


def _locals(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        yield p.to_local() if isinstance(p, DTensor) else p


def _plain(x: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors that hold ``x``'s memory: a wrapper subclass (a DTensor under TP, a functional collective's
    waiting tensor) is saved as itself, its inner tensors hold the bytes (PyTorch's subclass protocol names them)."""
    flatten = getattr(type(x), "__tensor_flatten__", None)
    if flatten is None:
        yield x
        return
    for name in flatten(x)[0]:
        inner = getattr(x, name)
        if isinstance(inner, torch.Tensor):
            yield from _plain(inner)
