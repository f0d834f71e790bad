"""`raytrn precheck` for TorchNeuron (and cpu/cuda) jobs: the real step under torch.compile(fullgraph=True,
dynamic=False) on CPU. A clean job passes; planted shape changes, Python-value recompiles and graph breaks fail,
each explained. Runs in the main venv (no torch-xla)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import raytrn.models
import raytrn.train.build
from raytrn.config import JobSpec, load_job
from raytrn.train.precheck import precheck
from tests.unit.test_precheck_layouts import FP32

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _job(*overrides: str, seq_len: int = 32) -> JobSpec:
    return load_job(
        REPO / "jobs" / "tiny.yaml",
        ["data.manifest=/nonexistent", f"data.seq_len={seq_len}", "data.micro_batch_size=2", "run.log_every=3",
         *overrides],
    )  # fmt: skip


def _batches(n_steps: int, seq_len: int, *, short_at: int | None = None) -> Iterator[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    for step in range(1, n_steps + 10):
        length = seq_len - 8 if step == short_at else seq_len
        yield torch.randint(0, 4096, (2, length + 1), generator=gen)


def test_a_clean_job_passes_and_the_report_says_how_it_ran() -> None:
    report = precheck(_job(), steps=7, warmup_steps=3)
    assert report.ok and not report.late_compiles and not report.graph_break
    assert report.mode == "torch.compile(fullgraph=True, dynamic=False) on CPU, as 'cpu' compiles the step"
    assert report.records[0].compiles >= 2  # the model and the loss, at the first step
    assert sum(r.compiles for r in report.records[1:]) == 0  # log steps (3, 6) read metrics outside the graph
    assert [r.logged for r in report.records] == [False, False, True, False, False, True, False]
    text = report.render()
    assert "verdict: PASS (no recompiles after warm-up)" in text
    assert "host-device syncs" not in text  # not measured on this path
    assert "   1         " in text and "           -  " in text


def test_a_shape_change_after_warm_up_fails_with_the_shapes() -> None:
    report = precheck(_job(), steps=7, warmup_steps=3, batches=_batches(7, 32, short_at=5))
    assert not report.ok
    [late] = report.late_compiles
    assert late.step == 5 and late.input_shape == (2, 25)
    assert report.reasons(late) == ["input shape changed from [2, 33] to [2, 25]"]
    assert "verdict: FAIL (recompiles after warm-up)" in report.render()


class _Wrapped(torch.nn.Module):
    """The job's model with a planted problem in its forward."""

    def __init__(self, inner: torch.nn.Module, problem: str) -> None:
        super().__init__()
        self.inner, self.problem, self.calls = inner, problem, 0

    def forward(self, input_ids: torch.Tensor) -> Any:
        if self.problem == "python-value":  # a Python int the graph depends on, changing every step
            self.calls += 1
            input_ids = input_ids + 0 * (self.calls % 7)
        if self.problem == "graph-break":  # data-dependent control flow: Dynamo must break the graph here
            if input_ids.sum().item() < 0:
                input_ids = input_ids * 0
        return self.inner(input_ids=input_ids)


def _plant(monkeypatch: pytest.MonkeyPatch, problem: str) -> None:
    build = raytrn.models.build_model
    # where the training is built (raytrn.train.build imports build_model by name)
    monkeypatch.setattr(raytrn.train.build, "build_model", lambda *a, **k: _Wrapped(build(*a, **k), problem))


def test_a_python_value_recompile_fails_with_dynamos_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    _plant(monkeypatch, "python-value")
    report = precheck(_job(seq_len=24), steps=6, warmup_steps=2)
    assert not report.ok and report.late_compiles
    assert report.reasons(report.late_compiles[0]) == [
        "a Dynamo guard failed (a Python value the model reads changed): run with TORCH_LOGS=recompiles"
    ]


def test_a_graph_break_fails_with_where_it_broke(monkeypatch: pytest.MonkeyPatch) -> None:
    _plant(monkeypatch, "graph-break")
    report = precheck(_job(seq_len=16), steps=5, warmup_steps=2)
    assert not report.ok and report.records == []  # the first step stopped at the break
    assert "test_precheck_compiled.py" in report.graph_break  # the user's line
    text = report.render()
    assert "step 1: graph break (fullgraph=True stops the run here): " in text
    assert text.endswith("verdict: FAIL (graph break)")


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("llama3.2-1b-trn2.yaml", []),
        # fp32: the same graphs, and a CPU without bf16 matrix units spared the wait (FP32's comment)
        ("qwen3-8b-trn2.yaml", ["--set", FP32]),
        ("qwen3-30b-a3b-trn2.yaml", ["--set", FP32]),
    ],
)
def test_cli_on_the_trn2_job(capsys: pytest.CaptureFixture[str], name: str, overrides: list[str]) -> None:
    """`raytrn precheck jobs/<trn2 job> --tiny` in the main venv: exit 0 and PASS (Llama in the job's bf16; Qwen3's
    per-head norms; Qwen3-MoE's capacity dispatch: fixed shapes, no graph break)."""
    from raytrn.cli import main

    assert main(["precheck", str(REPO / "jobs" / name), "--tiny", "--steps", "5", *overrides]) == 0
    out = capsys.readouterr().out
    assert "as 'neuron' compiles the step" in out and "verdict: PASS" in out


def test_cli_exit_code_on_failure(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from raytrn.cli import main

    _plant(monkeypatch, "graph-break")
    args = ["precheck", str(REPO / "jobs" / "tiny.yaml"), "--steps", "5", "--set", "data.manifest=/nonexistent"]
    assert main([*args, "--set", "data.seq_len=20"]) == 1
    assert "verdict: FAIL (graph break)" in capsys.readouterr().out
