"""``raytrn precompile JOB.yaml``: fill the Neuron compile cache before the real run.

Every graph shape is a Neuron compile, and the step graph depends on the world size (the data-parallel
size sets the gradient accumulation and the collectives' replica groups). An elastic job therefore
needs its graphs for every size it can take: one ``neuron_parallel_compile`` trial run per world size
(node granularity), each a few steps of ``raytrn train`` fixed at that size, with tracking off and a
throwaway run name and checkpoint prefix. ``neuron_parallel_compile`` runs the trial with
``NEURON_EXTRACT_GRAPHS_ONLY=1`` (graphs are recorded, not compiled; losses are garbage), then compiles
the recorded graphs in parallel into ``NEURON_COMPILE_CACHE_URL``.

The compile cache key includes the compiler flags, so each step's environment carries the same
``NEURON_CC_FLAGS`` and cache URL that the job's workers get (:mod:`raytrn.backends.neuron_env`).
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from raytrn.backends.neuron_env import cc_flags_for, compile_cache_env, instance_spec, neff_cache_env
from raytrn.config import JobSpec
from raytrn.config.sizes import data_parallel_size, world_sizes
from raytrn.errors import BackendUnavailableError, ConfigError
from raytrn.train.checks import check_spec

#: Optimizer steps of each trial run: step 1 (optimizer state created), a steady step, and the last
#: step (which also logs and checkpoints). AWS's NxD recipes extract with 2 steps.
PRECOMPILE_STEPS = 3

#: Upper bound on one world size's trial run plus compilation (an 8B model compiles for a long time).
PRECOMPILE_TIMEOUT_S = 4 * 3600

#: Parallel compiler processes per host: neuron_parallel_compile's own default, ceil(host RAM / 64 GiB).
NUM_PARALLEL = {"trn1.2xlarge": 1, "trn1.32xlarge": 8, "trn1n.32xlarge": 8, "trn2.48xlarge": 32}

#: Variables neuron_parallel_compile sets for its trial run that every Ray worker must see (Ray workers
#: are started by the raylet, not by the driver, so the neuron backend has to forward them).
FORWARD_ENV = ("NEURON_EXTRACT_GRAPHS_ONLY", "NEURON_PARALLEL_COMPILE_CACHE_PATH_LOG")

# Far beyond PRECOMPILE_STEPS: only the final step (which the loop always saves) writes a checkpoint.
_NO_PERIODIC_CHECKPOINT = 1_000_000


@dataclass(frozen=True, kw_only=True)
class PrecompileStep:
    """One world size of the elastic range and the command that fills the cache for it."""

    world_size: int
    num_nodes: int
    data_parallel_size: int
    grad_accum: int
    run_name: str  # throwaway: never the real run's name, unique per precompile
    checkpoint_storage: str  # throwaway prefix under the job's storage
    command: tuple[str, ...]
    env: Mapping[str, str]  # added to the caller's environment
    note: str

    def shell(self) -> str:
        """The step as one copy-pasteable shell line."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.command)}".strip()


def precompile_plan(
    job: JobSpec,
    *,
    overrides: Sequence[str] = (),
    python: str = sys.executable,
    steps: int = PRECOMPILE_STEPS,
    hostname: str | None = None,
    stamp: str | None = None,
) -> list[PrecompileStep]:
    """One step per world size ``min_workers..max_workers`` can take (stepping by ``workers_per_node``).

    ``overrides`` are the ``--set`` values the job was loaded with: the trial runs repeat them so they
    trace the same shapes. ``hostname`` picks the per-host compile cache directory (default: this host).
    """
    acc = job.scaling.accelerator
    if acc not in ("neuron", "neuron-xla"):
        raise ConfigError(
            f"{job.source}: precompile is for scaling.accelerator: neuron-xla (got {acc!r}); "
            "other accelerators compile nothing ahead of time"
        )
    check_spec(job)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    host = hostname or socket.gethostname()
    lnc: int | None = job.neuron.lnc
    if acc == "neuron":  # a warm-up run: TorchNeuron compiles as it trains, into its NEFF cache
        lnc = lnc or instance_spec(job.scaling.instance_type or "").default_lnc
        env = neff_cache_env(job.neuron.compile_cache, hostname=host)
    else:
        env = dict(compile_cache_env(job.neuron.compile_cache, hostname=host))
    flags = cc_flags_for(job.neuron.cc_flags, lnc)
    if flags:
        env["NEURON_CC_FLAGS"] = flags
    if acc == "neuron-xla":
        # neuron_parallel_compile finds the graphs in "Extracting graphs (<path>)" lines of the trial run's
        # output. Workers' lines reach it through the driver, whose log dedup would fold the lines of different
        # workers (they differ only in hashes) into one "[repeated Nx across cluster]".
        env["RAY_DEDUP_LOGS"] = "0"
    storage = f"{job.checkpoint.storage.rstrip('/')}/raytrn-precompile"
    num_parallel = NUM_PARALLEL.get(job.scaling.instance_type or "")
    per_node = job.scaling.workers_per_node
    d = job.data
    plan = []
    for n in world_sizes(job):
        dp = data_parallel_size(job, n)
        accum = d.global_batch_size // (d.micro_batch_size * dp) if d.global_batch_size else d.grad_accum or 1
        run_name = f"{job.run_name}-precompile-{n}w-{stamp}"
        sets = [
            *overrides,
            f"scaling.min_workers={n}",
            f"scaling.max_workers={n}",
            f"run.max_steps={steps}",
            "tracking.enabled=false",
            f"tracking.run_name={run_name}",
            f"checkpoint.storage={storage}",
            f"checkpoint.every_n_steps={_NO_PERIODIC_CHECKPOINT}",
            "checkpoint.keep_last=1",
        ]
        wrapper = ["neuron_parallel_compile", *(["--num_parallel", str(num_parallel)] if num_parallel else [])]
        command = [
            *(wrapper if acc == "neuron-xla" else []),
            python,
            "-m",
            "raytrn.cli",
            "train",
            job.source,
            "--no-progress",
            *(arg for s in sets for arg in ("--set", s)),
        ]
        tp = job.parallel.tensor_parallel_size
        plan.append(
            PrecompileStep(
                world_size=n,
                num_nodes=math.ceil(n / per_node) if per_node else 1,
                data_parallel_size=dp,
                grad_accum=accum,
                run_name=run_name,
                checkpoint_storage=storage,
                command=tuple(command),
                env=dict(env),
                note=(
                    f"fixed shapes: seq_len {d.seq_len}, micro_batch_size {d.micro_batch_size}, grad_accum {accum} "
                    f"at TP {tp} x DP {dp}; changing them, the model, the parallel section or neuron.cc_flags "
                    "needs a new precompile"
                ),
            )
        )
    return plan


def precompile(
    job: JobSpec,
    *,
    dry_run: bool,
    echo: Callable[[str], object] = print,
    overrides: Sequence[str] = (),
    timeout_s: float = PRECOMPILE_TIMEOUT_S,
) -> int:
    """Print the plan; unless ``dry_run``, run each step and return the first non-zero exit code (else 0).

    ``neuron`` (TorchNeuron) has no ahead-of-time compile tool: print that, and the warm-up runs that fill the
    NEFF cache instead, and return 2.
    """
    plan = precompile_plan(job, overrides=overrides)
    if job.scaling.accelerator == "neuron":
        for line in _torchneuron_warmup(job, plan):
            echo(line)
        return 2
    echo(f"precompile {job.source}: {len(plan)} world size(s), {PRECOMPILE_STEPS} trial steps each")
    for note in _cache_notes(job, plan):
        echo(f"note: {note}")
    for i, step in enumerate(plan, 1):
        echo(
            f"[{i}/{len(plan)}] {step.world_size} workers on {step.num_nodes} node(s), run {step.run_name}: {step.note}"
        )
        echo(f"  {step.shell()}")
    if dry_run:
        return 0
    exe = shutil.which("neuron_parallel_compile")
    if exe is None:
        raise BackendUnavailableError(
            "neuron_parallel_compile is not on PATH: run this on a trn node with the Neuron DLAMI's PyTorch venv "
            "activated (torch-neuronx provides it), connected to the Ray cluster (RAY_ADDRESS); "
            "--dry-run prints the commands"
        )
    for i, step in enumerate(plan, 1):
        echo(f"[{i}/{len(plan)}] precompiling {step.world_size} workers ...")
        started = time.monotonic()
        rc = _run([exe, *step.command[1:]], env={**os.environ, **step.env}, echo=echo, timeout_s=timeout_s)
        if rc != 0:
            why = f"timed out after {timeout_s:.0f} s" if rc == _TIMEOUT_RC else f"exited with code {rc}"
            echo(
                f"[{i}/{len(plan)}] precompile for {step.world_size} workers {why}; later sizes not compiled. "
                "An interrupted run can leave compile-cache locks: `neuron_parallel_compile --command clear-locks` "
                "(with the same NEURON_COMPILE_CACHE_URL) clears them"
            )
            return rc
        echo(f"[{i}/{len(plan)}] {step.world_size} workers done in {time.monotonic() - started:.0f} s")
    echo(f"precompile {job.source}: all {len(plan)} world size(s) compiled")
    return 0


def _torchneuron_warmup(job: JobSpec, plan: list[PrecompileStep]) -> list[str]:
    cache = job.neuron.compile_cache
    lines = [
        f"precompile {job.source}: scaling.accelerator 'neuron' (TorchNeuron) has no ahead-of-time compile tool: "
        "neuron_parallel_compile is for the XLA path (neuron-xla) only. TorchNeuron compiles each graph the first "
        "time it runs (eager ops and torch.compile(backend='neuron') alike) and caches the result.",
        f"Instead, run a short warm-up job at every world size the job can take ({len(plan)}), on the same instance "
        "type with the same shapes and compiler flags, so the real run finds its graphs in the NEFF cache"
        + (
            f" ({cache}: per host under a shared mount)."
            if cache
            else "; set neuron.compile_cache to a directory that outlives the nodes (e.g. on FSx) first."
        ),
        "Whether the cache carries across nodes and releases as AWS's docs describe is not yet verified on "
        "hardware by raytrn; `raytrn precheck JOB.yaml` catches recompiles on CPU before you rent a node.",
    ]
    for i, step in enumerate(plan, 1):
        lines.append(f"[{i}/{len(plan)}] {step.world_size} workers on {step.num_nodes} node(s): {step.note}")
        # No environment in front: every worker derives its NEFF cache and compiler flags from the job itself
        # (raytrn.backends.neuron_env), on its own host.
        lines.append(f"  {shlex.join(step.command)}")
    return lines


def _cache_notes(job: JobSpec, plan: list[PrecompileStep]) -> list[str]:
    cache = job.neuron.compile_cache
    multi_node = any(s.num_nodes > 1 for s in plan)
    if cache is None:
        return [
            "neuron.compile_cache is unset: graphs go to this host's /var/tmp/neuron-compile-cache only; "
            "set an s3:// cache so every node of the real run finds them"
        ]
    if multi_node and not cache.startswith("s3://"):
        return [
            f"neuron.compile_cache={cache!r} is per host: the graphs are compiled into this host's cache only, "
            "so other nodes of a multi-node run compile again; an s3:// cache is shared by all nodes"
        ]
    return []


_TIMEOUT_RC = 124


def _run(cmd: list[str], *, env: Mapping[str, str], echo: Callable[[str], object], timeout_s: float) -> int:
    """Run ``cmd``, echoing its output line by line; kill its process group after ``timeout_s`` (exit 124)."""
    proc = subprocess.Popen(
        cmd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,  # its own process group: a timeout or Ctrl-C ends the trial run's children too
    )
    timed_out = threading.Event()

    def on_timeout() -> None:
        timed_out.set()
        _kill_group(proc)

    timer = threading.Timer(timeout_s, on_timeout)
    timer.daemon = True
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            echo(line.rstrip("\n"))
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            _kill_group(proc)
    return _TIMEOUT_RC if timed_out.is_set() else rc


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group this module started (by its id), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
