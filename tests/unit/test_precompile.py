"""``raytrn precompile``: one neuron_parallel_compile trial run per world size, isolated from the real run.

The plan is checked against the shipped trn jobs; the runner is checked with a fake
``neuron_parallel_compile`` on PATH that records its argv and environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from raytrn.backends.neuron_env import compile_cache_env
from raytrn.config import JobSpec, load_job
from raytrn.errors import BackendUnavailableError, ConfigError
from raytrn.xla.neuron_compile import PRECOMPILE_STEPS, PrecompileStep, precompile, precompile_plan

pytestmark = pytest.mark.unit

JOBS = Path(__file__).resolve().parents[2] / "jobs"
JOB_8B = JOBS / "llama3-8b-trn1.yaml"
JOB_1B = JOBS / "llama3.2-1b-trn1.yaml"
CC_FLAGS = "--model-type transformer --distribution-strategy=llm-training"


def load(path: Path, *overrides: str) -> JobSpec:
    return load_job(path, list(overrides), base_dir="/base")


def sets(step: PrecompileStep) -> list[str]:
    """The --set values of a step's command, in order."""
    cmd = list(step.command)
    return [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]


def train_args(step: PrecompileStep) -> tuple[str, list[str]]:
    """(job path, overrides) of the `raytrn train` inside a step's command."""
    cmd = list(step.command)
    i = cmd.index("train")
    return cmd[i + 1], sets(step)


# ---------------------------------------------------------------------------------------------------
# The plan


def test_plan_covers_every_node_count() -> None:
    plan = precompile_plan(load(JOB_8B), stamp="s")
    assert [s.world_size for s in plan] == [32, 64, 96, 128]
    assert [s.num_nodes for s in plan] == [1, 2, 3, 4]
    assert [s.data_parallel_size for s in plan] == [1, 2, 3, 4]  # TP 32: one replica per node
    assert [s.grad_accum for s in plan] == [768, 384, 256, 192]
    assert "fixed shapes: seq_len 8192, micro_batch_size 1, grad_accum 768 at TP 32 x DP 1" in plan[0].note


def test_plan_for_the_1b_job() -> None:
    plan = precompile_plan(load(JOB_1B), stamp="s")
    assert [(s.world_size, s.data_parallel_size, s.grad_accum) for s in plan] == [
        (32, 4, 96),
        (64, 8, 48),
        (96, 12, 32),
        (128, 16, 24),
    ]


def test_fixed_size_job_is_one_step() -> None:
    plan = precompile_plan(load(JOB_8B, "scaling.min_workers=64", "scaling.max_workers=64"), stamp="s")
    assert [(s.world_size, s.num_nodes) for s in plan] == [(64, 2)]


def test_commands_pin_the_size_and_isolate_the_run() -> None:
    job = load(JOB_8B)
    for step in precompile_plan(job, python="/venv/bin/python", stamp="20261122-1200"):
        n = step.world_size
        assert step.command[:3] == ("neuron_parallel_compile", "--num_parallel", "8")  # trn1.32xlarge: 512 GiB / 64
        assert step.command[3:8] == ("/venv/bin/python", "-m", "raytrn.cli", "train", str(JOB_8B))
        assert "--no-progress" in step.command
        assert sets(step) == [
            f"scaling.min_workers={n}",
            f"scaling.max_workers={n}",
            f"run.max_steps={PRECOMPILE_STEPS}",
            "tracking.enabled=false",
            f"tracking.run_name=llama3-8b-trn1-precompile-{n}w-20261122-1200",
            "checkpoint.storage=s3://my-raytrn-bucket/checkpoints/raytrn-precompile",
            "checkpoint.every_n_steps=1000000",
            "checkpoint.keep_last=1",
        ]
        assert step.run_name != job.run_name and step.checkpoint_storage != job.checkpoint.storage


def test_commands_load_as_the_intended_trial_job() -> None:
    """The overrides in each command make a valid job: that size only, a few steps, nothing tracked."""
    real = load(JOB_8B, "data.seq_len=4096")
    for step in precompile_plan(real, overrides=["data.seq_len=4096"], stamp="s"):
        path, overrides = train_args(step)
        trial = load(Path(path), *overrides)
        assert trial.scaling.min_workers == trial.scaling.max_workers == step.world_size
        assert trial.run.max_steps == PRECOMPILE_STEPS
        assert not trial.tracking.enabled
        assert trial.tracking.run_name == step.run_name
        assert trial.checkpoint.storage == step.checkpoint_storage
        assert trial.data.seq_len == 4096  # the caller's --set values are repeated: the same shapes are traced
        assert trial.model == real.model and trial.parallel == real.parallel and trial.neuron == real.neuron


def test_each_precompile_gets_fresh_run_names() -> None:
    # A rerun must not resume the last trial's checkpoint (at max_steps: nothing would be traced).
    a = precompile_plan(load(JOB_8B), stamp="20261122-1200")
    b = precompile_plan(load(JOB_8B), stamp="20261122-1300")
    assert not {s.run_name for s in a} & {s.run_name for s in b}


def test_env_is_the_workers_compile_cache_and_flags() -> None:
    [step] = precompile_plan(load(JOB_8B, "scaling.max_workers=32"), stamp="s")
    assert dict(step.env) == {
        "NEURON_COMPILE_CACHE_URL": "s3://my-raytrn-bucket/neuron-cache",
        "NEURON_CC_FLAGS": CC_FLAGS,
        # Every worker's "Extracting graphs (...)" line must reach neuron_parallel_compile un-deduplicated.
        "RAY_DEDUP_LOGS": "0",
    }
    assert step.shell().startswith(
        f"NEURON_COMPILE_CACHE_URL=s3://my-raytrn-bucket/neuron-cache NEURON_CC_FLAGS='{CC_FLAGS}' RAY_DEDUP_LOGS=0 "
        "neuron_parallel_compile --num_parallel 8 "
    )


def test_shared_fs_cache_is_per_host() -> None:
    job = load(JOB_8B, "neuron.compile_cache=/fsx/neuron-cache")
    [step, *_] = precompile_plan(job, hostname="trn-a", stamp="s")
    assert step.env["NEURON_COMPILE_CACHE_URL"] == "/fsx/neuron-cache/trn-a"
    assert (
        dict(step.env)["NEURON_COMPILE_CACHE_URL"]
        == compile_cache_env("/fsx/neuron-cache", hostname="trn-a")["NEURON_COMPILE_CACHE_URL"]
    )


def test_trn2_lnc_reaches_the_compiler_flags() -> None:
    job = load(JOB_1B, "scaling.instance_type=trn2.48xlarge", "neuron.lnc=2", "scaling.workers_per_node=64")
    step = precompile_plan(job, stamp="s")[0]
    assert step.env["NEURON_CC_FLAGS"] == f"{CC_FLAGS} --logical-nc-config 2"
    assert step.command[:3] == ("neuron_parallel_compile", "--num_parallel", "32")


def test_precompile_is_for_neuron() -> None:
    with pytest.raises(ConfigError, match=r"precompile is for scaling.accelerator: neuron-xla \(got 'cpu'\)"):
        precompile_plan(load(JOBS / "tiny.yaml"))


def test_plan_reports_layout_errors_first() -> None:
    with pytest.raises(ConfigError, match="data.global_batch_size"):
        precompile_plan(load(JOB_8B, "data.global_batch_size=1024"))


# ---------------------------------------------------------------------------------------------------
# Running it


def test_dry_run_prints_the_commands(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no neuron_parallel_compile: a dry run does not need it
    out: list[str] = []
    assert precompile(load(JOB_8B), dry_run=True, echo=out.append) == 0
    text = "\n".join(out)
    assert out[0] == f"precompile {JOB_8B}: 4 world size(s), {PRECOMPILE_STEPS} trial steps each"
    for n, nodes in ((32, 1), (64, 2), (96, 3), (128, 4)):
        assert f"{n} workers on {nodes} node(s)" in text
        assert f"--set scaling.min_workers={n} --set scaling.max_workers={n}" in text
    assert text.count("neuron_parallel_compile --num_parallel 8 ") == 4


def test_dry_run_warns_about_a_per_host_cache_for_multi_node_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    out: list[str] = []
    precompile(load(JOB_8B, "neuron.compile_cache=/fsx/cache"), dry_run=True, echo=out.append)
    assert any(line.startswith("note: neuron.compile_cache='/fsx/cache' is per host") for line in out)
    out.clear()
    precompile(load(JOB_8B), dry_run=True, echo=out.append)  # s3: shared
    assert not any(line.startswith("note:") for line in out)


def test_torchneuron_has_no_precompile_and_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``neuron`` (TorchNeuron, trn2): no ahead-of-time tool exists; precompile says so, prints a warm-up run per
    world size (the workers take their NEFF cache from the job, not from a driver variable) and exits 2, with or
    without --dry-run and without neuron_parallel_compile on PATH."""
    monkeypatch.setenv("PATH", str(tmp_path))
    job = load(JOBS / "llama3-8b-trn2.yaml", "neuron.compile_cache=/fsx/neff")
    for dry_run in (True, False):
        out: list[str] = []
        assert precompile(job, dry_run=dry_run, echo=out.append) == 2
        text = "\n".join(out)
        assert "has no ahead-of-time compile tool" in out[0] and "neuron_parallel_compile is for the XLA path" in out[0]
        assert "run a short warm-up job at every world size the job can take (4)" in text and "/fsx/neff" in text
        for n, nodes in ((64, 1), (128, 2), (192, 3), (256, 4)):
            assert f"{n} workers on {nodes} node(s)" in text
            assert f"--set scaling.min_workers={n} --set scaling.max_workers={n} --set run.max_steps=" in text
        commands = [line.strip() for line in out if line.startswith("  ")]
        assert len(commands) == 4 and all(" train " in c and "=" not in c.split()[0] for c in commands), commands
        assert "neuron_parallel_compile --" not in text and "TORCH_NEURONX_NEFF_CACHE_DIR" not in text
    out.clear()
    precompile(load(JOBS / "llama3-8b-trn2.yaml", "neuron.compile_cache=null"), dry_run=True, echo=out.append)
    assert "set neuron.compile_cache to a directory that outlives the nodes" in "\n".join(out)


def test_running_needs_neuron_parallel_compile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BackendUnavailableError, match="run this on a trn node with the Neuron DLAMI"):
        precompile(load(JOB_8B), dry_run=False, echo=lambda _: None)


FAKE = """#!{python}
import json, os, sys, time
argv = sys.argv[1:]
with open(os.environ["FAKE_NPC_LOG"], "a") as f:
    f.write(json.dumps({{"argv": argv, "cache": os.environ.get("NEURON_COMPILE_CACHE_URL"),
                        "flags": os.environ.get("NEURON_CC_FLAGS"),
                        "dedup": os.environ.get("RAY_DEDUP_LOGS")}}) + "\\n")
size = next(a.split("=")[1] for a in argv if a.startswith("scaling.min_workers="))
print(f"fake trial run for {{size}} workers", flush=True)
if size == os.environ.get("FAKE_NPC_SLEEP_AT"):
    time.sleep(60)
if size == os.environ.get("FAKE_NPC_FAIL_AT"):
    print("compilation failed", flush=True)
    sys.exit(3)
"""


@pytest.fixture
def fake_npc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fake neuron_parallel_compile on PATH; returns the JSONL file it appends each call to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "neuron_parallel_compile"
    script.write_text(FAKE.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_NPC_LOG", str(log))
    return log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_runs_every_step_with_its_env(fake_npc: Path) -> None:
    job = load(JOB_8B)
    out: list[str] = []
    assert precompile(job, dry_run=False, echo=out.append) == 0
    plan = precompile_plan(job, stamp="s")
    recorded = calls(fake_npc)
    assert len(recorded) == 4
    for step, call in zip(plan, recorded, strict=True):
        # argv after the executable: the plan's command (run names differ only by their timestamp).
        assert call["argv"][:7] == list(step.command[1:8])
        assert sets(step)[:3] == [a for a in call["argv"] if a.startswith(("scaling.", "run."))]
        assert call["cache"] == "s3://my-raytrn-bucket/neuron-cache"
        assert call["flags"] == CC_FLAGS
        assert call["dedup"] == "0"
    for n in (32, 64, 96, 128):
        assert f"fake trial run for {n} workers" in out  # the tool's output is streamed through echo
    assert out[-1] == f"precompile {JOB_8B}: all 4 world size(s) compiled"


def test_a_failing_step_stops_with_its_code(fake_npc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NPC_FAIL_AT", "64")
    out: list[str] = []
    assert precompile(load(JOB_8B), dry_run=False, echo=out.append) == 3
    assert [c["argv"][c["argv"].index("--set") + 1] for c in calls(fake_npc)] == [
        "scaling.min_workers=32",
        "scaling.min_workers=64",
    ]  # 96 and 128 never ran
    assert "compilation failed" in out
    assert any("precompile for 64 workers exited with code 3; later sizes not compiled" in line for line in out)


def test_a_hung_step_is_killed_at_the_timeout(fake_npc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NPC_SLEEP_AT", "32")
    out: list[str] = []
    started = time.monotonic()
    assert precompile(load(JOB_8B), dry_run=False, echo=out.append, timeout_s=1) == 124
    assert time.monotonic() - started < 20
    assert len(calls(fake_npc)) == 1
    assert any("precompile for 32 workers timed out after 1 s" in line for line in out)
