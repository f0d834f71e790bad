"""The precheck's memory estimate and refusal (no torch-xla needed: the check runs before anything is built;
the estimate is checked against measured peaks in tests/xla/test_precheck.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrn.config import load_job
from raytrn.errors import BackendUnavailableError, RaytrnError
from raytrn.train.precheck import TINY_SEQ_LEN, TINY_VOCAB, estimate_memory, precheck, shrink

pytestmark = pytest.mark.unit
JOB = Path(__file__).resolve().parents[2] / "jobs" / "llama3.2-1b-trn1.yaml"
GIB = 1 << 30


def test_the_1b_job_under_small_needs_more_than_a_laptop() -> None:
    """The issue's OOM: --small keeps seq 8192 and vocab 128,256; the fp32 logits alone are 4.2 GB a copy."""
    small = estimate_memory(shrink(load_job(JOB)))
    assert small.logits == 5 * 8192 * 128256 * 4 and small.total > 24 * GIB
    tiny_job = shrink(load_job(JOB), shapes=True)
    assert (tiny_job.data.seq_len, tiny_job.model.vocab_size) == (TINY_SEQ_LEN, TINY_VOCAB)
    assert tiny_job.model.num_layers == 2 and tiny_job.data.micro_batch_size == 1  # same step structure
    assert estimate_memory(tiny_job).total < 2 * GIB


def test_refused_before_anything_is_built() -> None:
    """The refusal comes before torch-xla is imported (it is not installed in this venv: reaching it would
    raise BackendUnavailableError instead)."""
    with pytest.raises(RaytrnError) as e:
        precheck(load_job(JOB), small=True, max_memory_bytes=16 * GIB)
    assert not isinstance(e.value, BackendUnavailableError)
    msg = str(e.value)
    assert "needs about 27." in msg and "logits 19.6 GiB" in msg and "16.0 GiB available" in msg
    assert "Use --tiny" in msg and "--max-memory-gb" in msg
    with pytest.raises(RaytrnError, match="Use --small .* or --tiny"):
        precheck(load_job(JOB), max_memory_bytes=16 * GIB)
    with pytest.raises(BackendUnavailableError):  # fits: goes on to torch-xla, which is not here
        precheck(load_job(JOB), tiny=True, max_memory_bytes=16 * GIB)


def test_cli_refusal_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from raytrn.cli import main

    assert main(["precheck", str(JOB), "--small", "--max-memory-gb", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raytrn: error: precheck: ") and err.count("\n") == 1


@pytest.mark.parametrize("field", ["seq_len", "vocab", "layers", "micro"])
def test_the_estimate_grows_with_every_dimension(field: str) -> None:
    base = shrink(load_job(JOB), shapes=True)
    bigger = {
        "seq_len": base.model_copy(update={"data": base.data.model_copy(update={"seq_len": 512})}),
        "vocab": base.model_copy(update={"model": base.model.model_copy(update={"vocab_size": 8192})}),
        "layers": base.model_copy(update={"model": base.model.model_copy(update={"num_layers": 4})}),
        "micro": base.model_copy(update={"data": base.data.model_copy(update={"micro_batch_size": 2})}),
    }[field]
    assert estimate_memory(bigger).total > estimate_memory(base).total
