"""Context parallelism as a job setting (``parallel.context_parallel_size``): the tiny Llama trained through
``build_training`` and ``train_step`` on real gloo processes (one spawn of 4 running every layout), each layout against
one process on the same global batches; the DCP checkpoint of CP 2 x FSDP 2 loaded into one process; and what
``raytrn validate`` says. No Ray.

Rows are ``SEQ`` = 37 tokens (neither CP 2's 4 chunks nor CP 4's 8 divide it: 3 tokens of padding a row), packed with
3 or 4 documents and a loss mask, except where a layout trains plain text. Layouts of the 4 ranks: CP 2 x DDP 2,
CP 2 x FSDP 2 (then its checkpoint, the logits of a micro-batch and a validation loss), CP 4 over FSDP (text, full
activation checkpointing), CP 2 x HSDP (2 replicas), CP 2 x TP 2 (selective activation checkpointing).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from raytrn.backends.cpu import CpuBackend
from raytrn.config import JobSpec
from raytrn.config.sizes import data_parallel_rank, data_parallel_size
from raytrn.data.batch import TokenBatch
from raytrn.errors import ConfigError
from raytrn.train.build import build_training
from raytrn.train.checks import check_spec
from raytrn.train.evaluate import Evaluator
from raytrn.train.step import forward, read_metrics, train_step
from tests.unit.gloo_ranks import rank_records, spawn_records, tiny_job

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
GLOBAL_ROWS = 8
SEQ = 37
STEPS = 3
DEADLINE_S = 300
#: One process vs the layout (losses, gradient norms, logits, every parameter after STEPS): the same maths, summed
#: in another order.
TOLERANCE = 2e-5
CP2 = "parallel.context_parallel_size=2"
#: name -> (overrides, rows: "packed" (documents and a loss mask) or "text").
LAYOUTS: dict[str, tuple[tuple[str, ...], str]] = {
    "cp2-ddp2": ((CP2,), "packed"),
    "cp2-fsdp2": ((CP2, "parallel.data_parallel=fsdp"), "packed"),
    "cp4-fsdp-text": (
        ("parallel.context_parallel_size=4", "parallel.data_parallel=fsdp", "parallel.activation_checkpointing=full"),
        "text",
    ),
    "cp2-hsdp2": ((CP2, "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=2"), "packed"),
    "cp2-tp2": (
        (CP2, "parallel.data_parallel=fsdp", "parallel.tensor_parallel_size=2",
         "parallel.activation_checkpointing=selective"),
        "packed",
    ),
}  # fmt: skip
#: Each row's documents (token counts) and padding after them: SEQ + 1 tokens a row, boundaries in other places.
DOCUMENTS = (((9, 14, 11), 4), ((3, 17, 6, 8), 4), ((20, 18), 0), ((5, 5, 5, 21), 2))


def job(tmp: Path, *overrides: str, workers: int = WORLD) -> JobSpec:
    return tiny_job(tmp, *overrides, workers=workers, seq=SEQ, rows=GLOBAL_ROWS, name="context")


def global_batch(step: int, rows: str) -> list[Any]:
    """Global step ``step``'s rows, one micro-batch each: packed rows of several documents (then padding, segment 0)
    with a loss mask training on part of each document, or plain text."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 16, (GLOBAL_ROWS, SEQ + 1), generator=gen) * 31 % 512
    if rows == "text":
        return list(tokens.split(1))
    segments = torch.stack([
        torch.cat([*(torch.full((n,), doc) for doc, n in enumerate(documents, 1)), torch.zeros(pad, dtype=torch.long)])
        for documents, pad in (DOCUMENTS[(row + step) % len(DOCUMENTS)] for row in range(GLOBAL_ROWS))
    ])  # fmt: skip
    mask = (torch.rand(tokens.shape, generator=gen) > 0.3) & (segments > 0)
    return [TokenBatch(r, m, s) for r, m, s in zip(tokens.split(1), mask.split(1), segments.split(1), strict=True)]


def share(j: JobSpec, world: int, rank: int, rows: list[Any]) -> list[Any]:
    """This rank's replica's rows (a context-parallel group's ranks read the same)."""
    dp, dp_rank = data_parallel_size(j, world), data_parallel_rank(j, rank, world)
    n = len(rows) // dp
    return rows[dp_rank * n : (dp_rank + 1) * n]


def train(t: Any, j: JobSpec, world: int, rank: int, rows: str) -> dict[str, list[float]]:
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        result = train_step(t, iter(share(j, world, rank, global_batch(step, rows))), CpuBackend())
        metrics = read_metrics(result, world)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    return {"losses": losses, "grad_norms": norms}


def logits_and_validation(t: Any, j: JobSpec, world: int, rank: int) -> dict[str, Any]:
    """The trained model's logits of the first packed row (gathered over the CP group) and the validation loss of
    the next step's global batch (:class:`Evaluator`'s, on this rank's rows)."""
    from raytrn.models.context_parallel import gather_sequence

    batch = global_batch(STEPS + 1, "packed")[0]
    with torch.no_grad():
        logits, *_ = forward(t, batch)
    if t.context_parallel is not None:
        logits = gather_sequence(logits, t.context_parallel.group, SEQ)
    validation: Any = SimpleNamespace(batches=share(j, world, rank, global_batch(STEPS + 1, "packed")))
    return {"logits": logits, "val_loss": Evaluator.evaluate(validation, t, CpuBackend())["val_loss"]}


def full_state(t: Any) -> dict[str, Any]:
    """Weights and AdamW moments as full tensors by name (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(t.model, t.optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": model, "optim": optim.get("state", {}), "last_epoch": t.scheduler.last_epoch}


def _rank(rank: int, world: int, port: int, tmp: str) -> None:
    from raytrn.checkpoint import dcp

    with rank_records(rank, world, port, tmp) as out:
        for name, (overrides, rows) in LAYOUTS.items():
            j = job(Path(tmp), *overrides)
            t = build_training(j, CpuBackend(), world_size=world, rank=rank)
            record: dict[str, Any] = train(t, j, world, rank, rows)
            record["state"] = full_state(t)
            record["checkpoint"] = {"layout": t.checkpoints.layout, "plain": t.checkpoints.plain_layout}
            if name == "cp2-fsdp2":
                record.update(logits_and_validation(t, j, world, rank))
                dcp.save(dcp.training_state(t.model, t.optimizer, t.scheduler), str(Path(tmp) / "ck"))
            out[name] = record


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Every rank's record of every layout."""
    tmp = tmp_path_factory.mktemp("context")
    return tmp, spawn_records(_rank, WORLD, tmp, deadline_s=DEADLINE_S)


_ONE_PROCESS: dict[tuple[str, ...], tuple[dict[str, list[float]], Any]] = {}


def one_process(tmp: Path, name: str) -> tuple[dict[str, list[float]], Any]:
    """One process trained on ``name``'s rows (once for all the layouts that train the same)."""
    overrides, rows = LAYOUTS[name]
    one = (*(o for o in overrides if not o.startswith("parallel.")), rows)
    if one not in _ONE_PROCESS:
        j = job(tmp, *one[:-1], workers=1)
        t = build_training(j, CpuBackend(), world_size=1)
        _ONE_PROCESS[one] = train(t, j, 1, 0, rows), t
    return _ONE_PROCESS[one]


def _max_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[n] - v).abs().max()) for n, v in want.items())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_trains_as_one_process_does(four_ranks: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    """Every rank's losses and gradient norms and every parameter after 3 AdamW steps within 2e-5 of one process
    (the sequence split over the CP ranks, padded to 2 x CP chunks: the padding out of attention and the loss);
    the checkpoint records the context-parallel layout."""
    tmp, ranks = four_ranks
    want, one = one_process(tmp, name)
    for rank in ranks:
        got = rank[name]
        assert got["losses"] == pytest.approx(want["losses"], rel=TOLERANCE, abs=TOLERANCE), name
        assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=TOLERANCE, abs=TOLERANCE), name
    assert want["losses"][-1] < want["losses"][0]  # it trains
    params = {n: p.detach() for n, p in one.model.named_parameters()}
    state = ranks[0][name]["state"]["model"]
    assert state.keys() == params.keys()
    print(f"{name}: parameters' largest difference from one process {_max_error(state, params):.2e}")
    for param_name, value in params.items():
        torch.testing.assert_close(
            state[param_name], value, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda m, n=param_name: f"{n}: {m}"
        )
    overrides, _ = LAYOUTS[name]
    cp = 4 if "cp4" in name else 2
    tp = 2 if "tp2" in name else 1
    layout = ranks[0][name]["checkpoint"]["layout"]
    assert layout["context_parallel_size"] == cp and layout["tensor_parallel_size"] == tp
    assert layout["data_parallel_size"] == WORLD // (cp * tp)
    assert ranks[0][name]["checkpoint"]["plain"] is ("ddp" in name)


def test_logits_and_validation_under_context_parallelism_are_one_process_s(
    four_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    """After training, CP 2 x FSDP 2's logits of a packed row (gathered, the padding cropped) and its validation
    loss (each rank's share of the targets, summed over every rank) within 2e-5 of one process's."""
    tmp, ranks = four_ranks
    _, one = one_process(tmp, "cp2-fsdp2")
    j = job(tmp, workers=1)
    want = logits_and_validation(one, j, 1, 0)
    for rank in ranks:
        got = rank["cp2-fsdp2"]
        print(f"logits' largest difference {float((got['logits'] - want['logits']).abs().max()):.2e}")
        torch.testing.assert_close(got["logits"], want["logits"], rtol=TOLERANCE, atol=TOLERANCE)
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=TOLERANCE)


def test_a_context_parallel_checkpoint_loads_into_one_process_bit_equal(
    four_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    """DCP: CP 2 x FSDP 2's checkpoint restores into one process (CP 1) bit-equal: weights, every AdamW moment,
    the schedule's step."""
    from raytrn.checkpoint import dcp

    tmp, ranks = four_ranks
    saved = ranks[0]["cp2-fsdp2"]["state"]
    one = build_training(job(tmp, workers=1), CpuBackend(), world_size=1)
    dcp.load(str(tmp / "ck"), one.model, one.optimizer, one.scheduler, source="test")
    named = dict(one.model.named_parameters())
    assert named.keys() == saved["model"].keys() == saved["optim"].keys()
    assert all(torch.equal(named[n].detach(), v) for n, v in saved["model"].items())
    for param_name, moments in saved["optim"].items():
        mine = one.optimizer.state[named[param_name]]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(mine[key], moments[key]), (param_name, key)
    assert one.scheduler.last_epoch == saved["last_epoch"] == STEPS


# -- what validate says (pure) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((CP2, "model.family=qwen3_moe", "model.preset=tiny-qwen3-moe"),
         "parallel.context_parallel_size 2 cannot train a MoE model (qwen3_moe)"),
        ((CP2, "parallel.pipeline_parallel_size=2", "parallel.data_parallel=fsdp", "model.tie_word_embeddings=false"),
         "cannot train with parallel.pipeline_parallel_size 2: a pipeline's stages passing sequence shards is not "
         "built yet"),
        ((CP2, "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=1", "scaling.recovery=live"),
         "cannot train with scaling.recovery: live"),
        (("parallel.context_parallel_size=4", "data.seq_len=7"),
         "cannot train data.seq_len 7: a row is cut into 2 x CP = 8 chunks"),
        (("parallel.context_parallel_size=3",),
         "8 worker(s) (a world size the job can take) is not a multiple of parallel.context_parallel_size 3 x TP 1"),
        ((CP2, "parallel.data_parallel=fsdp", "parallel.tensor_parallel_size=2", "scaling.min_workers=6",
          "scaling.max_workers=6"),
         "6 worker(s) (a world size the job can take) is not a multiple of parallel.context_parallel_size 2 x TP 2"),
        ((CP2, "parallel.data_parallel=hsdp", "parallel.hsdp_shard_size=2", "parallel.tensor_parallel_size=2"),
         "parallel.hsdp_shard_size 2 (hsdp's shard group) is not a multiple of parallel.context_parallel_size 2 x "
         "TP 2"),
        ((CP2, "scaling.accelerator=xla-cpu"),
         "parallel.context_parallel_size 2 is not available on scaling.accelerator xla-cpu (the XLA path, frozen)"),
        ((CP2, "scaling.accelerator=neuron-xla"),
         "parallel.context_parallel_size 2 is not available on scaling.accelerator neuron-xla"),
    ],
)  # fmt: skip
def test_what_context_parallelism_cannot_train_is_refused_one_clear_error_each(
    tmp_path: Path, overrides: tuple[str, ...], expected: str
) -> None:
    with pytest.raises(ConfigError) as e:
        check_spec(job(tmp_path, "data.global_batch_size=32", *overrides, workers=8))
    assert expected in str(e.value), str(e.value)


def test_context_parallelism_is_described_and_its_ranks_read_the_same_rows(tmp_path: Path) -> None:
    from raytrn.config.layout import check_parallel
    from raytrn.config.sizes import describe_sizes, world_sizes

    j = job(tmp_path, CP2, "parallel.data_parallel=fsdp", "parallel.tensor_parallel_size=2", workers=8)
    assert check_parallel(j) == [
        "parallel: fsdp over 2 data-parallel rank(s), context parallel 2 (ring attention, 4 chunks of 10 tokens a "
        "row, 3 of them padding; FSDP shards over 4 data x context ranks), tensor parallel 2 (DTensor)"
    ]
    # the mesh (dp, cp, tp): TP pairs consecutive, a CP group's 4 ranks one replica
    assert data_parallel_size(j, 8) == 2
    assert [data_parallel_rank(j, r, 8) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    ddp = job(tmp_path, "parallel.context_parallel_size=4", workers=8)
    assert check_parallel(ddp) == [
        "parallel: ddp over 2 data-parallel rank(s), context parallel 4 (ring attention, 8 chunks of 5 tokens a row, "
        "3 of them padding)"
    ]
    elastic = job(tmp_path, CP2, "parallel.data_parallel=fsdp", "scaling.min_workers=2", "scaling.max_workers=7",
                  "data.global_batch_size=null", "data.grad_accum=1")  # fmt: skip
    assert world_sizes(elastic) == [2, 4, 6]
    assert "whole context-parallel groups (parallel.context_parallel_size 2)" in describe_sizes(elastic)
    with pytest.raises(ConfigError, match="not divisible by parallel.context_parallel_size"):
        data_parallel_size(elastic, 5)
