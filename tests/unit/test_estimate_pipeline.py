"""``raytrn estimate`` of a pipelined job (``parallel.pipeline_parallel_size``): the heaviest pipeline rank's
memory, against parameters counted on the tiny model's real stages (:func:`raytrn.models.pipeline.split_model`) and
the micro-batches in flight read off ``torch.distributed.pipelining``'s own schedule orders; the bubble of each
schedule family, applied to tokens/s and time; the JSON and the rendered line; a larger pipeline among the fixes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from raytrn.cli import main
from raytrn.config import JobSpec, load_job
from raytrn.config.stages import SCHEDULES
from raytrn.estimate.devices import Device
from raytrn.estimate.job import estimate_job, fixes, pipeline_bubble
from raytrn.estimate.memory import activation_bytes, estimate_memory, in_flight, logits_in_flight
from raytrn.models import model_stats

pytestmark = pytest.mark.unit

JOBS = Path(__file__).resolve().parents[2] / "jobs"
#: The tiny Llama as tests/unit/test_pipeline.py pipelines it: 4 layers, untied, a global batch of 16 rows.
TINY = ("data.manifest=unused", "data.seq_len=24", "model.vocab_size=512", "model.num_layers=4",
        "model.tie_word_embeddings=false", "tracking.log_model=false", "data.grad_accum=null",
        "data.global_batch_size=16", "data.micro_batch_size=1")  # fmt: skip
#: Llama 3.1 8B on 4 trn2 nodes, the pipeline over FSDP (TP 1: pipeline x TP x FSDP is not verified).
BIG = ("parallel.tensor_parallel_size=1", "scaling.min_workers=256", "scaling.max_workers=256",
       "tracking.log_model=false")  # fmt: skip


def tiny(*overrides: str, workers: int = 4) -> JobSpec:
    return load_job(JOBS / "tiny.yaml", [*TINY, f"scaling.min_workers={workers}", f"scaling.max_workers={workers}",
                                         *overrides], resolve=False)  # fmt: skip


def big(*overrides: str) -> JobSpec:
    return load_job(JOBS / "llama3-8b-trn2.yaml", [*BIG, *overrides], resolve=False)


def stage_params(job: JobSpec, num_stages: int) -> list[int]:
    """Each stage's parameters, counted on the tiny model cut by raytrn's own pipeline code."""
    from raytrn.models.build import build_model
    from raytrn.models.pipeline import split_model

    return [
        sum(t.numel() for t in split_model(build_model(job.model, seed=0), s, num_stages).parameters())  # type: ignore[arg-type]
        for s in range(num_stages)
    ]


def test_a_rank_holds_its_stage_the_embedding_or_the_head_and_its_micro_batches():
    """PP 2 (1F1B, no data parallelism) against PP 1: a rank's parameters are what split_model's stage holds (about
    half the model); rank 0 keeps 2 micro-batches of its 2 layers in flight (PP 1's 4 layers of one, less the final
    norm), the last rank one, with the final norm and the logits. With a 512-token vocabulary rank 0 is the
    heaviest, with 4,096 the last rank (its logits)."""
    whole = estimate_memory(tiny(workers=2), 2)
    pp2 = estimate_memory(tiny("parallel.pipeline_parallel_size=2", workers=2), 2)
    first, last = stage_params(tiny(), 2)
    m = tiny().model
    assert first + last == model_stats(m, 24).num_params  # the cut loses nothing
    assert whole.parameters == 4 * (first + last) and pp2.parameters == 4 * first  # float32
    assert 0.4 < first / (first + last) < 0.6
    assert pp2.gradients == pp2.optimizer / 2 == pp2.parameters  # AdamW: two moments
    assert pp2.gradient_buckets == 0 and pp2.gathered == 0  # one replica: no DDP, no FSDP
    assert pp2.notes == ["ddp (one data-parallel rank: not sharded)",
                         "pipeline parallel 2 (1f1b, 2 stages of 2/2 layers, 16 micro-batches): the heaviest rank, 0, "
                         "holds stage 0 (2 layers, the embedding), 2 micro-batches in flight"]  # fmt: skip
    final_norm = 24 * 2 * m.hidden_size * 4  # its input and output, float32
    assert whole.activations == activation_bytes(tiny(), 24, 4)
    assert pp2.activations == whole.activations - final_norm and pp2.logits == pp2.logits_backward == 0

    vocab = ("model.vocab_size=4096",)
    whole = estimate_memory(tiny(*vocab, workers=2), 2)
    pp2 = estimate_memory(tiny(*vocab, "parallel.pipeline_parallel_size=2", workers=2), 2)
    first, last = stage_params(tiny(*vocab), 2)
    assert pp2.parameters == 4 * last and last - first == m.hidden_size  # the head's size is the embedding's
    assert pp2.notes[1].endswith("the heaviest rank, 1, holds stage 1 (2 layers, the final norm and head), "
                                 "1 micro-batch in flight")  # fmt: skip
    per_layer = (whole.activations - final_norm) // 4
    assert pp2.activations == 2 * per_layer + final_norm  # its 2 layers and the final norm, one micro-batch
    assert (pp2.logits, pp2.logits_backward) == (whole.logits, whole.logits_backward)

    v = estimate_memory(tiny("parallel.pipeline_parallel_size=2", "parallel.pipeline_schedule=zbv_zero_bubble",
                             workers=2), 2)  # fmt: skip
    assert "the heaviest rank, 0, holds stages 0 and 3 (2 layers, the embedding, the final norm and head)" in (
        ", ".join(v.notes)
    )  # the V: the first and the last stage on rank 0
    stages = stage_params(tiny(), 4)
    assert v.parameters == 4 * (stages[0] + stages[3])


def test_fsdp_under_a_pipeline_shards_a_stage_over_its_replicas_and_keeps_it_gathered_through_the_step():
    """PP 2 x FSDP 2: the state of stage 0 over its 2 data-parallel ranks; the stage whole (and its gradients
    unsharded) from its first backward on (torch.distributed.pipelining turns resharding after backward off)."""
    job = tiny("parallel.pipeline_parallel_size=2", "parallel.data_parallel=fsdp")
    est = estimate_memory(job, 4)
    first, _ = stage_params(job, 2)
    assert est.notes[:2] == ["fsdp over 2 data-parallel ranks of a stage",
                             "pipeline parallel 2 (1f1b, 2 stages of 2/2 layers, 8 micro-batches): the heaviest rank, "
                             "0, holds stage 0 (2 layers, the embedding), 2 micro-batches in flight"]  # fmt: skip
    assert est.parameters == 4 * first // 2 and est.optimizer == 2 * est.parameters
    assert est.gathered == 4 * first + 4 * first  # float32 parameters and gradients, no autocast
    bf16 = estimate_memory(tiny("parallel.pipeline_parallel_size=2", "parallel.data_parallel=fsdp",
                                "model.autocast=bfloat16"), 4)  # fmt: skip
    assert bf16.gathered == 2 * first + 4 * first  # gathered in bf16, gradients accumulated in FSDP's fp32


def test_the_8b_over_a_pipeline_holds_a_quarter_of_the_layers_and_the_head_on_the_last_rank():
    """Llama 3.1 8B, PP 4 x FSDP 64: rank 3 holds 8 of 32 layers, the final norm and the head (from the model
    card's count: 8,030,261,248 = 32 layers + embedding + head + norm), its state over 64 ranks; its loss in chunks
    as the step's."""
    m = big().model
    h, vocab = m.hidden_size, m.vocab_size
    layer = (8_030_261_248 - 2 * vocab * h - h) // 32
    est = estimate_memory(big("parallel.pipeline_parallel_size=4"), 256)
    held = 8 * layer + vocab * h + h
    assert est.notes[1].endswith(
        "the heaviest rank, 3, holds stage 3 (8 layers, the final norm and head), 1 micro-batch in flight"
    )
    assert est.parameters == pytest.approx(4 * held / 64, abs=4 * 3)
    assert est.gathered == 2 * held + 4 * held  # bf16 autocast: gathered bf16, gradients fp32
    one = estimate_memory(big(), 256)  # the loss in chunks, as the step's (raytrn.train.loss): the same per micro-batch
    assert est.logits == one.logits < 8192 * vocab * (2 + 4) and est.logits_backward == one.logits_backward
    gpipe = estimate_memory(big("parallel.pipeline_parallel_size=4", "parallel.pipeline_schedule=gpipe"), 256)
    assert gpipe.logits == 12 * est.logits  # every micro-batch's (768 rows / 64 replicas) before any backward


def _torch_orders(schedule: str, ranks: int, micro: int) -> dict[int, list[Any]]:
    """``torch.distributed.pipelining``'s own order of each rank's actions under ``schedule`` (its schedules
    compute every rank's order from the sizes alone: called here without stages or a process group). Private
    names: this fails loudly if they move."""
    from torch.distributed.pipelining import schedules as s

    cls = getattr(s, SCHEDULES[schedule][0])
    if SCHEDULES[schedule][1] == 1:
        return cls._get_pipeline_order(SimpleNamespace(_num_stages=ranks, _n_microbatches=micro))
    state = SimpleNamespace(pp_group_size=ranks, _n_microbatches=micro, n_local_stages=2, num_stages=2 * ranks,
                            microbatches_per_round=micro // max(1, micro // ranks))  # fmt: skip
    return {r: cls._calculate_single_rank_operations(state, r) for r in range(ranks)}


def _peak(actions: list[Any], *, until: tuple[str, ...] = ("B", "W")) -> dict[int, int]:
    """The micro-batches in flight on each stage when the most are: a forward keeps its micro-batch until its full
    backward (``B``) or its weight-gradient pass (``W``: the input-gradient pass, ``I``, keeps the stage's graph for
    it), its logits until ``B`` or ``I``."""
    from torch.distributed.pipelining import schedules as s

    held: Counter[int] = Counter()
    best: dict[int, int] = {}

    def run(a: Any) -> None:
        if a.computation_type == s.OVERLAP_F_B:
            for sub in a.sub_actions:
                run(sub)
        elif a.computation_type == s.FORWARD:
            held[a.stage_index] += 1
        elif a.computation_type.value in until:
            held[a.stage_index] -= 1

    for action in actions:
        if action is not None:
            run(action)
            if sum(held.values()) > sum(best.values()):
                best = {k: n for k, n in held.items() if n}
    return best


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_micro_batches_in_flight_are_torchs_schedules(schedule: str):
    for ranks, micro in ((2, 4), (2, 8), (4, 8), (4, 16), (8, 16)):
        orders = _torch_orders(schedule, ranks, micro)
        for rank in range(ranks):
            expected = {s: n for s, n in in_flight(schedule, rank, ranks, micro).items() if n}
            assert _peak(orders[rank]) == expected, (schedule, ranks, micro, rank)
        last = ranks * SCHEDULES[schedule][1] - 1
        head = 0 if SCHEDULES[schedule][2] else ranks - 1  # the V's last stage is on rank 0
        only = [a for a in orders[head] if a is not None]
        only = [x for a in only for x in (a.sub_actions or (a,)) if x.stage_index == last]
        assert _peak(only, until=("B", "I")) == {last: logits_in_flight(schedule, micro)}, (schedule, ranks, micro)


def test_the_bubble_of_each_schedule_family():
    p, m = 4, 8
    assert pipeline_bubble("1f1b", p, m)[0] == pytest.approx(3 / 11)  # (P-1)/(m+P-1)
    assert pipeline_bubble("gpipe", p, m)[0] == pytest.approx(3 / 11)
    assert pipeline_bubble("interleaved_1f1b", p, m)[0] == pytest.approx(3 / 19)  # (P-1)/(v m+P-1), v 2
    assert pipeline_bubble("interleaved_zero_bubble", p, m)[0] == pytest.approx(3 / 51)  # a third of the idle time
    assert pipeline_bubble("zbv_zero_bubble", p, m)[0] == 0  # ZB-V's claim
    assert pipeline_bubble("dualpipev", p, m)[0] == pytest.approx(3 / 27)
    for schedule in SCHEDULES:  # more micro-batches, a smaller bubble; every one says it is theory
        fraction, theory = pipeline_bubble(schedule, p, m)
        assert pipeline_bubble(schedule, p, 4 * m)[0] <= fraction < 0.5 and theory.startswith("theory")


def test_the_bubble_slows_tokens_per_s_and_time_and_is_printed_and_in_the_json(capsys):
    """PP 4 x FSDP 64 of the 8B: 12 micro-batches a replica (768 rows over 64), a 1F1B bubble of 3/15; tokens/s
    are PP 1's at the same MFU times 1 - bubble, the time over them."""
    flat = estimate_job(big(), world_size=256)
    pp = estimate_job(big("parallel.pipeline_parallel_size=4"), world_size=256)
    assert pp.pipeline is not None and flat.pipeline is None
    assert (pp.pipeline.micro_batches, pp.pipeline.fraction) == (12, pytest.approx(3 / 15))
    assert pp.mfu == flat.mfu and pp.tokens_per_s_per_node == pytest.approx(flat.tokens_per_s_per_node * 0.8)
    assert pp.hours == pytest.approx((flat.hours or 0) / 0.8)
    assert "\npipeline: 1f1b over 4 stages, 12 micro-batches: bubble 20% (theory (P-1)/(m+P-1)); the speed" in (
        pp.render()
    )
    args = ["estimate", str(JOBS / "llama3-8b-trn2.yaml"), "--no-history", *[x for o in BIG for x in ("--set", o)]]
    main([*args, "--set", "parallel.pipeline_parallel_size=4", "--set", "parallel.pipeline_schedule=interleaved_1f1b",
          "--json"])  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["pipeline"] == {"schedule": "interleaved_1f1b", "ranks": 4, "stages_per_rank": 2,
                                "micro_batches": 12, "bubble": pytest.approx(3 / 27),
                                "theory": "theory (P-1)/(v*m+P-1), v = 2 stages a rank"}  # fmt: skip
    assert "pipeline parallel 4 (interleaved_1f1b, 8 stages of 4/4/4/4/4/4/4/4 layers" in " ".join(
        data["memory"]["notes"]
    )
    main([*args, "--json"])
    assert json.loads(capsys.readouterr().out)["pipeline"] is None
    main([*args, "--set", "parallel.pipeline_parallel_size=2", "--set", "parallel.pipeline_schedule=gpipe"])
    out = capsys.readouterr().out
    assert "\npipeline: gpipe over 2 stages, 6 micro-batches: bubble 14% (theory (P-1)/(m+P-1))" in out


def test_a_pipelined_job_that_does_not_fit_is_offered_a_longer_pipeline():
    """PP 2 x FSDP 2 of the tiny model on a device just too small: PP 4 (one layer a rank, no data parallelism, the
    same layers x micro-batches in flight on rank 0) fits; every fix offered validates as a job (PP 8 would not: 4
    layers)."""
    from raytrn.config.layout import check_parallel

    fixed = ("parallel.data_parallel=fsdp", "parallel.activation_checkpointing=full")
    job = tiny("parallel.pipeline_parallel_size=2", *fixed)
    four = estimate_memory(tiny("parallel.pipeline_parallel_size=4", *fixed), 4)
    assert four.total < estimate_memory(job, 4).total
    device = Device(name="small", memory_bytes=int(four.total / 0.9) + 1, peak_flops=None, source="test")
    found = {f.overrides: f.memory for f in fixes(job, 4, device)}
    assert found[("parallel.pipeline_parallel_size=4",)] == four  # (TP 2 fits too: PP 2 x TP 2, one replica)
    for overrides in found:
        check_parallel(tiny("parallel.pipeline_parallel_size=2", *fixed, *overrides))
