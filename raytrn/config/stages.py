"""Where a pipeline cuts a model and which ranks hold which stages: pure (no torch), so ``raytrn validate`` and
``raytrn estimate`` know a pipelined layout on a laptop; :mod:`raytrn.models.pipeline` builds the stages."""

from __future__ import annotations

#: ``parallel.pipeline_schedule`` -> (the torch.distributed.pipelining class name, stages per rank, V-shaped).
SCHEDULES: dict[str, tuple[str, int, bool]] = {
    "1f1b": ("Schedule1F1B", 1, False),
    "gpipe": ("ScheduleGPipe", 1, False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, False),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2, False),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", 2, True),
    "dualpipev": ("ScheduleDualPipeV", 2, True),
}

#: The schedules that split a stage's backward into an input-gradient and a later weight-gradient pass.
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The decoder layers of each of ``num_stages`` stages: contiguous, in order, every layer once; as even as the
    count allows, the extra layers of an uneven split on the middle stages first (the end stages also carry the
    embedding and the head)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"{num_layers} decoder layers cannot make {num_stages} pipeline stages (one layer at least each)"
        )
    base, extra = divmod(num_layers, num_stages)
    order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), abs(2 * s - (num_stages - 1))))
    sizes = [base + (1 if s in order[:extra] else 0) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def stage_indices(schedule: str, pp_rank: int, pp_size: int) -> list[int]:
    """The stages rank ``pp_rank`` of ``pp_size`` holds under ``schedule``, in the order the schedule takes them."""
    _, per_rank, v_shaped = SCHEDULES[schedule]
    if v_shaped:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + v * pp_size for v in range(per_rank)]


__all__ = ["SCHEDULES", "ZERO_BUBBLE", "stage_indices", "stage_layers"]
