"""The ``raytrn`` command line: train, validate and data preparation.

User mistakes surface as one clear message on stderr and exit code 2 (argparse's own convention for
misuse); everything else is a real bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from raytrn import __version__
from raytrn.backends import get_backend
from raytrn.cli_args import (
    add_ray_dashboard_option,
    add_set_option,
    add_verbose_option,
    integer,
    number,
    use_ray_dashboard_option,
)
from raytrn.cluster.capacity import check_job_fits
from raytrn.cluster.cli import register as register_cluster
from raytrn.cluster.validate import validate_cluster_file
from raytrn.config import JobSpec, load_job, read_job_file, resolve_paths
from raytrn.errors import RaytrnError
from raytrn.estimate.cli import register as register_estimate
from raytrn.ray_output import route_ray_output
from raytrn.runtime import check_paths_for_ray_job
from raytrn.submit import register as register_submit
from raytrn.sweep.cli import register as register_sweep
from raytrn.tracking.last_run import record_last_run
from raytrn.tracking.runs_cli import register as register_runs
from raytrn.tracking.runs_cli import register_models
from raytrn.tracking.server import register as register_mlflow

# Commands import their heavy modules when they run (measured, CPU s): raytrn.train.trainer pulls in torch and Ray
# Train (~5.7 s), train.precheck torch (~3.7 s), train.checks and data.prepare pyarrow (+0.2 s on --help's 0.45 s).

_EPILOG = """\
examples:
  raytrn data prepare --input "$(python -c 'import sysconfig;print(sysconfig.get_paths()["stdlib"])')/*.py" \\
      --output data/stdlib --seq-len 128 --vocab-size 4096
  raytrn validate jobs/tiny.yaml
  raytrn train jobs/tiny.yaml --set run.max_steps=50 --set optim.lr=1e-3
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raytrn",
        description="Elastic LLM training on Ray for AWS Trainium (and CPU/CUDA): "
        "prepare packed token shards, validate job specs, and train with Ray Train + MLflow.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p_train = sub.add_parser(
        "train",
        help="run a training job from a job spec",
        description="Train the model described by JOB.yaml with Ray Train. Connects to the Ray cluster in "
        "RAY_ADDRESS (as under `ray job submit`) or starts a local Ray. Resumes from the latest "
        "checkpoint of the same run name when one exists under checkpoint.storage.",
    )
    p_train.add_argument("job", metavar="JOB.yaml", help="job spec file (see jobs/)")
    add_set_option(p_train)
    p_train.add_argument(
        "--no-progress", action="store_true", help="print one progress line per log step instead of a live line"
    )
    p_train.add_argument(
        "--take-over",
        action="store_true",
        help="replace a stale lease on the run (its job's driver stopped renewing it: killed, machine lost)",
    )
    add_verbose_option(p_train)
    add_ray_dashboard_option(p_train)
    p_train.set_defaults(func=_cmd_train)

    p_stop = sub.add_parser(
        "stop",
        help="end a training run early, at its next step, checkpointed (the run ends FINISHED)",
        description="Ask RUN, training on the Ray cluster in RAY_ADDRESS (or --address, the cluster's HOST:PORT), to "
        "end at its next step, or at step N: every worker stops at the same step, the run saves its checkpoint, "
        "evaluates and exports as it would at run.max_steps, and ends FINISHED. Training the same job again resumes "
        "there (the learning-rate schedule stays the job's).",
    )
    p_stop.add_argument("run", metavar="RUN", help="the run's name (tracking.run_name; `raytrn train` prints it)")
    p_stop.add_argument("--at-step", type=integer, metavar="N", help="the step to end at (default: the next one)")
    p_stop.add_argument("--address", metavar="HOST:PORT", help="the Ray cluster (default: RAY_ADDRESS)")
    p_stop.set_defaults(func=_cmd_stop)

    p_val = sub.add_parser(
        "validate",
        help="check a job spec (and its local dataset) without running anything",
        description="Parse and range-check JOB.yaml, apply --set overrides, and check that a local data "
        "manifest exists, its shards exist and its tokenizer fits the model. Exit 0 when valid, 2 otherwise.",
    )
    p_val.add_argument("job", metavar="JOB.yaml")
    add_set_option(p_val)
    p_val.add_argument(
        "--no-data", action="store_true", help="skip the dataset checks (its path exists only on the cluster)"
    )
    p_val.add_argument(
        "--cluster",
        metavar="FILE",
        help="also check the job fits this cluster file (cluster/*.yaml or a KubeRay manifest): refused when it asks "
        "for more workers than the cluster can ever provide",
    )
    p_val.set_defaults(func=_cmd_validate)

    p_pre = sub.add_parser(
        "precheck",
        help="run the training step on CPU and catch graph breaks and recompiles before renting a trn node",
        description="Run the job's real training step K times on CPU with the job's sequence length and micro-batch, "
        "and report graphs compiled and graph hashes per step. scaling.accelerator neuron (TorchNeuron), cpu and "
        "cuda: under torch.compile(fullgraph=True, dynamic=False), as TorchNeuron's torch.compile(backend='neuron') "
        "traces it; a graph break fails. neuron-xla and xla-cpu: on torch-xla (PJRT_DEVICE=CPU; needs torch-xla, e.g. "
        "`.venv-xla/bin/raytrn precheck JOB.yaml`), also counting host-device syncs. Exit 1 when a step after warm-up "
        "compiles a new graph (each one is a Neuron compile) or the graph breaks, 0 otherwise.",
    )
    p_pre.add_argument("job", metavar="JOB.yaml")
    add_set_option(p_pre)
    p_pre.add_argument(
        "--steps", type=integer, default=None, metavar="K", help="steps to run (default: 2 log intervals)"
    )
    p_pre.add_argument("--warmup", type=integer, default=3, metavar="W", help="steps allowed to compile (default 3)")
    p_pre.add_argument(
        "--small", action="store_true", help="shrink the model's depth/width (same vocab, seq_len and micro-batch)"
    )
    p_pre.add_argument(
        "--tiny",
        action="store_true",
        help="--small, and seq_len <= 256 and vocabulary <= 4096: the same step graph, small enough for a laptop",
    )
    p_pre.add_argument(
        "--max-memory-gb",
        type=number,
        metavar="GB",
        help="allow the step this much memory (default: what the machine has available; refused above it)",
    )
    p_pre.set_defaults(func=_cmd_precheck)

    p_comp = sub.add_parser(
        "precompile",
        help="compile the Neuron graphs for every world size of the elastic range (neuron-xla, on a trn node)",
        description="neuron-xla: run neuron_parallel_compile (graph extraction, then parallel compile into the job's "
        "neuron.compile_cache) once per world size that min_workers..max_workers can take at node granularity, "
        "so an elastic resize never waits for a compile. --dry-run prints the plan and commands. neuron "
        "(TorchNeuron) has no ahead-of-time compile tool: prints the warm-up runs that fill its cache instead, exit 2.",
    )
    p_comp.add_argument("job", metavar="JOB.yaml")
    add_set_option(p_comp)
    p_comp.add_argument("--dry-run", action="store_true", help="print the plan and commands without running them")
    p_comp.set_defaults(func=_cmd_precompile)

    register_cluster(sub)

    register_submit(sub)
    register_estimate(sub, check_job=_check_job_without_data)

    register_sweep(sub)

    register_runs(sub)
    register_models(sub)

    register_mlflow(sub)

    p_data = sub.add_parser("data", help="dataset tools", description="Dataset tools.")
    data_sub = p_data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    data_sub.required = True
    p_prep = data_sub.add_parser(
        "prepare",
        help="tokenize and pack text into fixed-length Parquet shards",
        description="Tokenize text files, JSONL (field 'text') and Parquet (column 'text') with a HF "
        "`tokenizers` tokenizer (given, or a byte-level BPE trained on the input), append EOS between "
        "documents, pack into rows of exactly seq_len+1 token ids (no padding), and write Parquet shards "
        "plus manifest.json. Runs as a Ray Data job, parallel over files; deterministic for the same input.",
    )
    p_prep.add_argument(
        "--input",
        dest="inputs",
        action="append",
        required=True,
        metavar="DIR|GLOB",
        help="a directory (searched recursively for .txt/.md/.rst/.py/.jsonl/.parquet) or a glob; repeatable",
    )
    p_prep.add_argument("--output", required=True, metavar="PATH", help="output directory for shards + manifest.json")
    p_prep.add_argument("--seq-len", type=integer, required=True, metavar="N", help="tokens per training sequence")
    tok = p_prep.add_mutually_exclusive_group(required=True)
    tok.add_argument(
        "--tokenizer",
        metavar="DIR|tokenizer.json",
        help="an existing tokenizer: a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json with its "
        "special tokens and chat template; the model's own, for fine-tuning) or a tokenizers JSON file",
    )
    tok.add_argument("--vocab-size", type=integer, metavar="V", help="train a byte-level BPE of this size on the input")
    p_prep.add_argument(
        "--shard-size-mb", type=number, default=64.0, metavar="MB", help="upper bound on a shard's token payload"
    )
    p_prep.add_argument(
        "--overwrite", action="store_true", help="replace an output directory that holds a different dataset"
    )
    p_prep.add_argument(
        "--format",
        choices=("text", "prompt-completion", "chat"),
        default="text",
        help="text: documents packed into rows, every token trained on (default); prompt-completion: JSONL "
        '{"prompt", "completion"}; chat: JSONL {"messages": [{"role", "content"}, ...]} rendered with the tokenizer\'s '
        "chat template. Instruction rows carry a loss mask (only completions / assistant turns are trained on) and "
        "segment ids",
    )
    p_prep.add_argument(
        "--no-packing",
        dest="packing",
        action="store_false",
        help="instruction data: one example per row, padded (default: several whole examples per row, kept apart "
        "by document masking)",
    )
    p_prep.add_argument(
        "--validation-fraction",
        type=number,
        default=0.0,
        metavar="F",
        help="put this fraction of the documents (examples) in a validation split (validation.json next to the "
        "manifest), chosen by a hash of file and position: the same split on every run",
    )
    p_prep.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="instruction data: skip (and count) lines that are not an example, instead of stopping at the first",
    )
    p_prep.add_argument("--no-progress", action="store_true", help="do not show progress")
    p_prep.set_defaults(func=_cmd_data_prepare)
    return parser


def _version() -> str:
    return f"raytrn {__version__}"


def _cmd_train(args: argparse.Namespace) -> int:
    from raytrn.train.trainer import run_training

    job = load_job(args.job, args.overrides, resolve=False)
    check_paths_for_ray_job(job)  # under `ray job submit`: no path into the job's temporary working dir
    job = resolve_paths(job, os.getcwd())
    route_ray_output(job.run_name, verbose=args.verbose)
    use_ray_dashboard_option(args)
    summary = run_training(job, live_progress=not args.no_progress, take_over=args.take_over)
    print(summary.render())
    if summary.mlflow_run_id and job.tracking.mlflow_uri:  # `raytrn runs compare`'s default experiment here
        record_last_run(job.tracking.mlflow_uri, job.tracking.experiment, summary.mlflow_run_id)
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    from raytrn.runtime import connect
    from raytrn.train.stopping import request_stop

    if args.at_step is not None and args.at_step < 1:
        raise RaytrnError(f"--at-step {args.at_step}: a step is 1 or more")
    connect(args.address)
    answer = request_stop(args.run, args.at_step)
    when = "at its next step" if answer.stop_at < 0 else f"at step {answer.stop_at}"
    print(f"raytrn: {args.run} asked to stop {when} (it had trained {answer.step_reached} steps)")
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from raytrn import storage

    with storage.quick_checks():  # an unreachable S3 endpoint: one line in ~10 s, not a minute of retries
        return _validate(args)


def _validate(args: argparse.Namespace) -> int:
    from raytrn.train.checks import check_job

    raw, sweep = read_job_file(args.job)
    job = load_job(args.job, args.overrides, raw=raw)
    lines = check_job(job, data=not args.no_data)
    if sweep is not None:
        lines.append(f"sweep: a search space over this job: `raytrn sweep {args.job} --dry-run` checks every trial")
    if args.cluster:
        validate_cluster_file(args.cluster, template=True)  # what the job needs of it; placeholders: noted
        lines += check_job_fits(job, get_backend(job.scaling.accelerator).worker_resources(job), args.cluster)
        from raytrn.estimate.job import check_fits

        lines.append(check_fits(job))
    for line in lines:
        print(line)
    print(f"{args.job}: OK")
    return 0


def _check_job_without_data(job: JobSpec) -> list[str]:
    """``raytrn validate --no-data``'s checks: ``raytrn estimate`` runs them first."""
    from raytrn.train.checks import check_job

    return check_job(job, data=False)


def _cmd_precheck(args: argparse.Namespace) -> int:
    from raytrn.train.precheck import precheck

    job = load_job(args.job, args.overrides)
    steps = args.steps or max(12, 2 * job.run.log_every + 1, args.warmup + 2)
    cap = int(args.max_memory_gb * (1 << 30)) if args.max_memory_gb else None
    report = precheck(
        job, steps=steps, warmup_steps=args.warmup, small=args.small, tiny=args.tiny, max_memory_bytes=cap
    )
    print(report.render())
    return 0 if report.ok else 1


def _cmd_precompile(args: argparse.Namespace) -> int:
    from raytrn.xla.neuron_compile import precompile  # the frozen XLA path: loaded for this command only

    return precompile(load_job(args.job, args.overrides), dry_run=args.dry_run, overrides=args.overrides)


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from raytrn.data.prepare import prepare_dataset

    manifest = prepare_dataset(
        inputs=args.inputs,
        output=args.output,
        seq_len=args.seq_len,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        shard_size_mb=args.shard_size_mb,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        format=args.format,
        packing=args.packing,
        validation_fraction=args.validation_fraction,
        skip_bad_lines=args.skip_bad_lines,
    )
    print(manifest.describe())
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``raytrn`` command (the console script's and ``python -m raytrn``'s entry): its exit code."""
    try:
        args = build_parser().parse_args(argv)
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not as Python's "Exception ignored" at exit
        return code
    except RaytrnError as e:
        print(f"raytrn: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("raytrn: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `raytrn ... | head`: the reader has what it wanted; end quietly, as `git log | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
