"""Validation under pipeline parallelism (``parallel.pipeline_parallel_size > 1`` with ``data.validation``): the
tiny Llama's validation loss through its stages, forward only, one micro-batch at a time
(:mod:`raytrn.train.pipelined_eval`), on real gloo processes (one spawn of 4 running every layout), against one
process's :class:`~raytrn.train.evaluate.Evaluator` on the same weights and rows; and what ``raytrn validate`` says.
No Ray.

Each layout evaluates before any training step (before the schedule's first step), after 2 steps and after a third:
every rank's ``val_loss`` and training loss against one process doing the same. Layouts of the 4 ranks: PP 2 x FSDP
2 under 1F1B on plain text (6 micro-batches a data-parallel rank, more than the pipeline's 4); under interleaved
1F1B on packed rows with loss masks and document attention, in micro-batches of 2 rows but a last one of 1; the tiny
Qwen3-MoE as PP 2 x FSDP 2 and as PP 2 x EP 2 (its validation loss the language loss alone, as one process's); PP 2
x TP 2 under interleaved zero bubble (every tensor-parallel copy of the last stage counts its sums, as without a
pipeline); PP 2 x FSDP 2 under ZBV zero bubble on packed rows (a V: stages 0 and 3 on one rank, the turn between 1
and 2 in the other).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from raytrn.backends.cpu import CpuBackend
from raytrn.config import JobSpec
from raytrn.data.batch import TokenBatch
from raytrn.train.build import build_training
from raytrn.train.checks import check_spec
from raytrn.train.evaluate import Evaluator
from raytrn.train.step import read_metrics, train_step
from tests.unit.gloo_ranks import rank_records, spawn_records, tiny_pipeline_job

pytestmark = pytest.mark.unit

WORLD = 4
GLOBAL_ROWS = 8
SEQ = 24
DEADLINE_S = 240
#: One process vs the pipeline: the same maths summed in another order (the micro-batches' sums added on the last
#: stage, FSDP's reduce-scatter of the gradients of the steps between), as tests/unit/test_pipeline.py's losses.
TOLERANCE = 2e-5
#: Steps before each evaluation after the first (before any step).
STEPS = (2, 1)
FSDP2 = ("parallel.data_parallel=fsdp", "parallel.pipeline_parallel_size=2")
MOE = ("model.family=qwen3_moe", "model.preset=tiny-qwen3-moe", "model.num_layers=4", "model.router_aux_loss_coef=0.01")
#: name -> (overrides, rows: "text" or "packed").
LAYOUTS: dict[str, tuple[tuple[str, ...], str]] = {
    "pp2-fsdp2-1f1b-text": (FSDP2, "text"),
    "pp2-fsdp2-interleaved-packed": ((*FSDP2, "parallel.pipeline_schedule=interleaved_1f1b"), "packed"),
    "pp2-fsdp2-moe": ((*FSDP2, *MOE), "text"),
    "pp2-ep2-moe": ((*FSDP2, *MOE, "parallel.expert_parallel_size=2"), "text"),
    "pp2-tp2-interleaved-zero-bubble": (
        (*FSDP2, "parallel.tensor_parallel_size=2", "parallel.pipeline_schedule=interleaved_zero_bubble"),
        "text",
    ),
    # a V: the first and the last stage on pipeline rank 0, the two middle ones on rank 1 (the V's turn in a rank)
    "pp2-fsdp2-zbv-packed": ((*FSDP2, "parallel.pipeline_schedule=zbv_zero_bubble"), "packed"),
}


def job(tmp: Path, *overrides: str, workers: int = WORLD) -> JobSpec:
    return tiny_pipeline_job(tmp, *overrides, workers=workers, seq=SEQ, rows=GLOBAL_ROWS, name="pipeline-validation")


def rows(seed: int, n: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``n`` rows of ``SEQ + 1`` tokens; packed: 3 documents a row (the last of varying length, then padding) and a
    loss mask training on part of each document (some rows on few of their tokens)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 16, (n, SEQ + 1), generator=gen) * 31 % 512
    if not packed:
        return tokens, None, None
    segments = torch.ones_like(tokens)
    segments[:, 9:] = 2
    segments[:, 17:] = 3
    for r in range(n):
        segments[r, 20 + r % 5 :] = 0
    keep = torch.rand(n, 1, generator=gen) * 0.8 + 0.1  # each row trains on its own share of its targets
    mask = (torch.rand(tokens.shape, generator=gen) < keep) & (segments > 0)
    return tokens, mask, segments


def training_batch(step: int, packed: bool) -> list[Any]:
    """Global step ``step``'s rows, one micro-batch each."""
    tokens, mask, segments = rows(1000 + step, GLOBAL_ROWS, packed)
    if mask is None:
        return list(tokens.split(1))
    return [TokenBatch(*parts) for parts in zip(tokens.split(1), mask.split(1), segments.split(1), strict=True)]


def validation(packed: bool, dp: int, dp_rank: int) -> list[Any]:
    """Data-parallel rank ``dp_rank``'s validation micro-batches of 2 ranks (``dp`` 1: both ranks', in order). Text:
    6 rows a rank, one a micro-batch. Packed: 9 rows a rank, in micro-batches of 2 rows but the last of 1."""
    per_rank = 9 if packed else 6
    cut = [2, 2, 2, 2, 1] if packed else [1] * per_rank
    tokens, mask, segments = rows(7, 2 * per_rank, packed)
    out: list[Any] = []
    for r in range(2) if dp == 1 else [dp_rank]:
        share = slice(r * per_rank, (r + 1) * per_rank)
        if mask is None or segments is None:
            out += tokens[share].split(cut)
        else:
            parts = (tokens[share].split(cut), mask[share].split(cut), segments[share].split(cut))
            out += [TokenBatch(*p) for p in zip(*parts, strict=True)]
    return out


def run(t: Any, j: JobSpec, world: int, rank: int, packed: bool) -> dict[str, list[float]]:
    """An evaluation, then for each of STEPS that many training steps and an evaluation: the training losses and
    the validation losses this rank reports."""
    from raytrn.config.sizes import data_parallel_rank, data_parallel_size

    dp, dp_rank = data_parallel_size(j, world), data_parallel_rank(j, rank, world)
    evaluator: Any = SimpleNamespace(batches=validation(packed, dp, dp_rank))
    losses, val_losses = [], [Evaluator.evaluate(evaluator, t, CpuBackend())["val_loss"]]
    step = 0
    for steps in STEPS:
        for _ in range(steps):
            step += 1
            batch = training_batch(step, packed)
            share = len(batch) // dp
            result = train_step(t, iter(batch[dp_rank * share : (dp_rank + 1) * share]), CpuBackend())
            losses.append(read_metrics(result, world)["loss"])
        val_losses.append(Evaluator.evaluate(evaluator, t, CpuBackend())["val_loss"])
    assert t.model.training  # the evaluator's eval mode undone
    return {"losses": losses, "val_losses": val_losses}


def _rank(rank: int, world: int, port: int, tmp: str) -> None:
    with rank_records(rank, world, port, tmp) as out:
        for name, (overrides, kind) in LAYOUTS.items():
            j = job(Path(tmp), *overrides)
            t = build_training(j, CpuBackend(), world_size=world, rank=rank)
            assert t.pipeline is not None
            out[name] = run(t, j, world, rank, packed=kind == "packed")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("pipeline-validation")
    return tmp, spawn_records(_rank, WORLD, tmp, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_pipelines_validation_loss_is_one_process_s(four_ranks: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    """Every rank of every stage reports one process's val_loss (the mean over the counted targets of every data-
    parallel rank's rows) within 2e-5, before training and after each round of steps; the training losses after
    each evaluation are one process's too (evaluating leaves the schedule and the trajectory as they were)."""
    tmp, ranks = four_ranks
    overrides, kind = LAYOUTS[name]
    j = job(tmp, *(o for o in overrides if not o.startswith("parallel.")), workers=1)
    want = run(build_training(j, CpuBackend(), world_size=1), j, 1, 0, packed=kind == "packed")
    assert want["val_losses"][-1] < want["val_losses"][0]  # it learns: the losses compared differ
    for rank in ranks:
        got = rank[name]
        worst = max(abs(g / w - 1) for g, w in zip(got["val_losses"], want["val_losses"], strict=True))
        print(f"{name}: val_loss {want['val_losses']}, largest relative difference {worst:.1e}")
        assert got["val_losses"] == pytest.approx(want["val_losses"], rel=TOLERANCE), name
        assert got["losses"] == pytest.approx(want["losses"], rel=TOLERANCE), name


def test_a_pipeline_with_a_validation_set_is_accepted_under_every_schedule(tmp_path: Path) -> None:
    """``raytrn validate``: a pipelined job with ``data.validation`` passes under every schedule (validation walks the
    stages itself, not through the schedule)."""
    from raytrn.config.stages import SCHEDULES

    for schedule in SCHEDULES:
        check_spec(job(tmp_path, *FSDP2, f"parallel.pipeline_schedule={schedule}", "data.global_batch_size=32",
                       "data.validation=somewhere", workers=8))  # fmt: skip
