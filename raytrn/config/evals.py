"""The job spec's ``eval`` section: the evaluation harness on committed checkpoints, off the training loop
(:mod:`raytrn.evals`).

Re-exported by :mod:`raytrn.config.schema` with the other sections.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from raytrn.config.section import Section


class EvalConfig(Section):
    """The evaluation harness (lm-eval) on committed checkpoints, off the training loop (:mod:`raytrn.evals`)."""

    tasks: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="lm-eval task names: raytrn's shipped ones (stdlib_next_line) or those of the task YAML files in "
        "include_path; empty: no evaluation",
    )
    include_path: str | None = Field(
        None,
        description="a directory (local, shared filesystem or s3://) of lm-eval task YAML files over local "
        "datasets: a prepared copy of a benchmark; nothing is downloaded from a hub",
    )
    every_n_checkpoints: int = Field(1, gt=0, le=10**6, description="evaluate every Nth committed checkpoint")
    limit: int | None = Field(None, gt=0, le=10**9, description="examples per task (lm-eval's --limit); null: all")
    batch_size: int = Field(8, gt=0, le=4096, description="lm-eval's batch size")
    timeout_s: float = Field(
        1800.0, gt=0, le=10**6, description="an evaluation (export + harness) still running after this is stopped"
    )
    num_cpus: float = Field(1.0, ge=0, le=4096, description="CPUs the evaluation task reserves")
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="where lm-eval runs the exported model: cpu (a trn node's host CPUs: the harness has no Neuron "
        "backend) or cuda (one GPU reserved)",
    )
