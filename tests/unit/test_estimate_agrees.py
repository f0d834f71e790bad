"""``raytrn estimate`` agrees with ``raytrn validate``: it runs validate's checks of the job (without data) first and
refuses what validate refuses with the same line; its memory verdict (fits, tight, does not fit) and its exit code
are those ``raytrn submit`` and ``validate --cluster`` act on; an MFU carried over from a dense model to a MoE one
says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrn.cli import main
from raytrn.config import load_job
from raytrn.estimate.devices import GIB
from raytrn.estimate.job import estimate_job, estimate_params

JOBS = Path(__file__).resolve().parents[2] / "jobs"
TRN2 = str(JOBS / "llama3.2-1b-trn2.yaml")
#: qwen3-0.6b-sft-trn2 without activation checkpointing at micro-batch 2: 21.8 GiB of the core's 24 (90%: 21.6).
TIGHT = (str(JOBS / "qwen3-0.6b-sft-trn2.yaml"), "--set", "parallel.activation_checkpointing=none",
         "--set", "data.micro_batch_size=2", "--set", "data.global_batch_size=128")  # fmt: skip


@pytest.mark.parametrize(
    ("job", "overrides"),
    [
        (TRN2, ("data.grad_accum=null", "data.global_batch_size=7")),  # not divisible by the data-parallel sizes
        (TRN2, ("scaling.instance_type=trn9.huge",)),  # no such instance type
        (TRN2, ("scaling.instance_type=trn1.32xlarge",)),  # TorchNeuron on trn1
        (TRN2, ("parallel.tensor_parallel_size=3",)),  # TP must divide the heads and the MLP
        (str(JOBS / "tiny.yaml"), ("parallel.tensor_parallel_size=2",)),  # TP under DDP
    ],
    ids=["global-batch", "instance-type", "accelerator-family", "tp-divides", "tp-needs-fsdp"],
)
def test_estimate_refuses_what_validate_refuses_with_the_same_error(capsys, job, overrides):
    sets = [a for o in overrides for a in ("--set", o)]
    assert main(["validate", job, "--no-data", *sets]) == 2
    refused = capsys.readouterr().err
    assert refused.startswith("raytrn: error: ")
    assert main(["estimate", job, "--no-history", *sets]) == 2
    out = capsys.readouterr()
    assert out.err == refused and out.out == ""
    assert main(["estimate", job, "--no-history", "--json", *sets]) == 2
    assert capsys.readouterr().err == refused


def test_estimate_shows_validates_warnings_on_stderr(capsys):
    assert main(["estimate", str(JOBS / "tiny.yaml"), "--no-history", "--json", "--set", "optim.fused=true"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["world_size"] == 2  # stdout stays JSON
    assert "raytrn: warning: optim.fused=True is ignored on scaling.accelerator='cpu'" in out.err


def test_the_memory_verdict_is_fits_tight_or_does_not_fit_with_the_exit_code_submit_acts_on(capsys):
    """fits: at most the 90% of the device planned for (exit 0); tight: above it, not above the device (exit 0:
    submit and validate --cluster take it, and say tight); does not fit: above the device (exit 1: they refuse it)."""
    assert main(["estimate", TRN2, "--no-history"]) == 0
    assert "\nmemory: fits (" in capsys.readouterr().out
    assert main(["estimate", *TIGHT, "--no-history"]) == 0
    out = capsys.readouterr().out
    assert "\nmemory: tight (" in out and "\nchanges that bring it within 90% (smallest first):" in out
    assert main(["estimate", *TIGHT, "--no-history", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory_verdict"] == "tight" and data["fits"] is False
    assert 0.9 * data["device"]["memory_bytes"] < data["memory"]["total"] <= data["device"]["memory_bytes"]
    too_big = [str(JOBS / "llama3-8b-trn2.yaml"), "--set", "parallel.tensor_parallel_size=1",
               "--set", "parallel.data_parallel=ddp", "--no-history"]  # fmt: skip
    assert main(["estimate", *too_big]) == 1
    assert "\nmemory: does not fit (" in capsys.readouterr().out
    assert main(["estimate", *too_big, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["memory_verdict"] == "does not fit"
    # the one-line summary submit prints says the same word
    tight = estimate_job(load_job(TIGHT[0], [TIGHT[i] for i in (2, 4, 6)], resolve=False))
    assert tight.memory_verdict == "tight" and tight.summary().startswith("estimate: tight")
    assert tight.margin_bytes is not None and -GIB < tight.margin_bytes < 0


def test_an_moe_estimate_labels_an_mfu_carried_over_from_a_dense_model(capsys):
    moe = str(JOBS / "qwen3-30b-a3b-trn2.yaml")
    assert main(["estimate", moe, "--no-history"]) == 0
    speed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("speed: "))
    assert "a dense model's MFU carried over to this MoE model" in speed
    assert main(["estimate", moe, "--no-history", "--json"]) == 0
    assert "a dense model's MFU carried over to this MoE model" in json.loads(capsys.readouterr().out)["mfu"]["source"]
    assert main(["estimate", moe, "--no-history", "--json", "--mfu", "0.2"]) == 0  # the user's own: as given
    assert json.loads(capsys.readouterr().out)["mfu"] == {"value": 0.2, "source": "--mfu"}
    assert main(["estimate", TRN2, "--no-history"]) == 0  # a dense model: the dense figure, no label
    assert "carried over to this MoE" not in capsys.readouterr().out
    params = estimate_params(load_job(moe, resolve=False))  # what a run logs
    assert "a dense model's MFU carried over to this MoE model" in params["estimate.mfu_source"]
