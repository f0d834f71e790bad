"""Whether torch DCP runs as one process here, said once for every raytrn caller (checkpoints, evaluation exports,
Hugging Face weights): a module below both :mod:`raytrn.checkpoint` and :mod:`raytrn.models`."""

from __future__ import annotations


def no_dist(alone: bool = False) -> bool:
    """Whether DCP runs as one process: no process group here, or ``alone`` (this process reads or writes its whole
    state with none of its group's collectives: the live rank 0's snapshot, the evaluator's export). DCP then warns
    on every call that it assumes one process: it is the intent, so the warning is silenced (stays off the run's
    terminal)."""
    import warnings

    import torch  # (here: the driver imports raytrn.models.hf's module, and never torch)

    single = alone or not (torch.distributed.is_available() and torch.distributed.is_initialized())
    if single:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    return single
