"""Issue 47: one resume object per checkpoint format, chosen by the backend (:mod:`raytrn.checkpoint.resume`), used
by the driver and the workers alike, so that nothing else branches on which format a backend's checkpoints are. The
frozen XLA path's format: ``test_xla_resume.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from raytrn.backends import get_backend
from raytrn.checkpoint.resume import CommittedResume, ResumeFormat

pytestmark = pytest.mark.unit

RAYTRN = Path(__file__).resolve().parents[2] / "raytrn"


@pytest.mark.parametrize("name", ["cpu", "cuda", "neuron"])
def test_the_living_backends_resume_committed_checkpoints(name: str) -> None:
    backend = get_backend(name)
    resume = backend.resume_format()
    assert isinstance(resume, ResumeFormat) and isinstance(resume, CommittedResume)
    assert resume.memory_tier and backend.probes_memory


def test_nothing_branches_on_the_format_but_its_resume_object() -> None:
    """The driver, the sweep and the checkpointer ask the backend's resume object; no module asks which format it is
    (before: six ``committed_checkpoints`` branches, and ``latest_checkpoint(committed=...)``)."""
    naming = {
        str(p.relative_to(RAYTRN))
        for p in RAYTRN.rglob("*.py")
        if re.search(r"\bcommitted_checkpoints\b|\bcommitted=", p.read_text())
    }
    assert not naming, sorted(naming)
