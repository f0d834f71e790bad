"""``make demo-finetune``: fine-tune the model ``make demo`` trained, on instruction data made from this machine's
Python standard library, fully and with LoRA, and compare the two by validation loss. No download.

1. The demo model: the newest finished run of the ``raytrn-demo`` experiment logged its model in Hugging Face format
   (with its tokenizer); it is copied to ``data/demo-model`` (the ``model.init_from`` of ``jobs/finetune-tiny.yaml``).
2. The data: every documented function of the standard library's top-level modules as a prompt/completion pair,
   the prompt its signature and the docstring's opening quotes, the completion the docstring's first paragraph
   (``data/stdlib-sft/functions.jsonl``), prepared with the demo model's tokenizer and a 5% validation split.
3. Two runs of ``jobs/finetune-tiny.yaml``: all weights, then LoRA adapters only. Each committed checkpoint is an
   MLflow LoggedModel; each is scored off the training loop by lm-eval on the shipped ``stdlib_next_line`` task; each
   run registers its best checkpoint (``demo-finetune-full``, ``demo-finetune-lora``, alias ``candidate``).
4. ``raytrn runs compare``: the two runs' val_loss beside the task's score, then every checkpoint ranked.

    python -m raytrn.demos.finetune [--tracking-uri URI] [--steps N]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from raytrn import jsonfile
from raytrn.cli_args import integer
from raytrn.config import resolve_mlflow_uri
from raytrn.errors import ConfigError, RaytrnError
from raytrn.tracking.client import mlflow_client, redact_uri

MODEL_DIR = Path("data/demo-model")
DATA_DIR = Path("data/stdlib-sft")
JOB = "jobs/finetune-tiny.yaml"
STAMP = ".raytrn-demo.json"  # which run the copy came from, and the files it wrote
LORA = "{rank: 16, alpha: 32, targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"


def demo_model(tracking_uri: str, out: Path = MODEL_DIR) -> Path:
    """The newest finished ``raytrn-demo`` run's logged model, copied to ``out`` (again only when the run changed)."""
    from mlflow.artifacts import download_artifacts

    client = mlflow_client(tracking_uri)
    exp = client.get_experiment_by_name("raytrn-demo")
    runs = [] if exp is None else client.search_runs(
        [exp.experiment_id], filter_string="attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"]
    )  # fmt: skip
    for run in runs:
        if not any(a.path == "model" for a in client.list_artifacts(run.info.run_id)):
            continue
        stamp = out / STAMP
        try:
            previous = jsonfile.loads(stamp.read_text()) if stamp.exists() else None
        except ValueError:  # not a stamp this demo wrote
            previous = None
        previous = previous if isinstance(previous, dict) else None
        if previous and previous.get("run_id") == run.info.run_id:
            return out
        if out.exists():
            if previous is None:
                raise RaytrnError(f"{out} exists and was not written by this demo: move it away")
            theirs = sorted(set(os.listdir(out)) - set(previous.get("files", [])) - {STAMP})
            if theirs:
                raise RaytrnError(f"{out} holds files this demo did not write ({', '.join(theirs)}): move them away")
        tmp = out.with_name(out.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        download_artifacts(run_id=run.info.run_id, artifact_path="model", tracking_uri=tracking_uri, dst_path=str(tmp))
        if out.exists():
            shutil.rmtree(out)  # only the files the last download wrote (checked above)
        (tmp / "model").rename(out)
        tmp.rmdir()
        files = sorted(os.listdir(out))
        stamp.write_text(json.dumps({"run_id": run.info.run_id, "files": files}))
        print(f"demo-finetune: the model of run {run.info.run_name} ({run.info.run_id[:8]}) -> {out}", flush=True)
        return out
    raise ConfigError(
        f"no finished run of the raytrn-demo experiment with a logged model at {redact_uri(tracking_uri)}: run `make demo` first"
    )


def function_examples(stdlib: str | None = None, *, limit: int = 4000) -> list[dict[str, str]]:
    """Prompt/completion pairs from the standard library's top-level modules: a documented function's signature
    with the docstring's opening quotes as the prompt, the docstring's first paragraph as the completion."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    out: list[dict[str, str]] = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or node.name.startswith("_"):
                continue
            first = doc.strip().split("\n\n", 1)[0].strip()
            if not 10 <= len(first) <= 300:
                continue
            prompt = f'def {node.name}({ast.unparse(node.args)}):\n    """'
            out.append({"prompt": prompt, "completion": first + '"""'})
            if len(out) >= limit:
                return out
    return out


#: The shipped lm-eval task's score (jobs/finetune-tiny.yaml's eval.tasks), shown beside val_loss.
SCORE = "stdlib_next_line/acc"


def _run(*args: str) -> None:
    print("$ raytrn " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "raytrn.cli", *args], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raytrn.demos.finetune", description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default=None, help="where make demo logged (default: as raytrn train)")
    parser.add_argument("--steps", type=integer, default=60, help="steps of each fine-tune")
    args = parser.parse_args(argv)
    uri = resolve_mlflow_uri(args.tracking_uri)
    try:
        model = demo_model(uri)
        DATA_DIR.mkdir(parents=True, exist_ok=True)
        jsonl = DATA_DIR.parent / "stdlib-sft-input" / "functions.jsonl"
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        examples = function_examples()
        text = "".join(json.dumps(e) + "\n" for e in examples)
        if not jsonl.exists() or jsonl.read_text() != text:
            jsonl.write_text(text)
        print(
            f"demo-finetune: {len(examples)} prompt/completion pairs from the standard library -> {jsonl}", flush=True
        )
    except RaytrnError as e:
        print(f"raytrn: error: {e}", file=sys.stderr)
        return e.exit_code
    try:
        _run("data", "prepare", "--input", str(jsonl), "--output", str(DATA_DIR), "--format", "prompt-completion",
             "--tokenizer", str(model), "--seq-len", "128", "--validation-fraction", "0.05", "--overwrite")  # fmt: skip
        steps, stamp = f"run.max_steps={args.steps}", time.strftime("%Y%m%d-%H%M%S")
        _run("train", JOB, "--no-progress", "--set", steps, "--set", f"tracking.run_name=full-{stamp}",
             "--set", "tracking.registered_model=demo-finetune-full")  # fmt: skip
        _run("train", JOB, "--no-progress", "--set", steps, "--set", f"tracking.run_name=lora-{stamp}",
             "--set", f"model.lora={LORA}", "--set", "optim.lr=1e-2",
             "--set", "tracking.registered_model=demo-finetune-lora")  # fmt: skip
        _run("runs", "compare", "--experiment", "raytrn-finetune", "--max-runs", "2", "--metrics",
             f"val_loss,{SCORE},loss,tokens_per_s", "--plot", "mlruns/finetune.png")  # fmt: skip
        _run("runs", "compare", "--experiment", "raytrn-finetune", "--models", "--rank-by", "val_loss")
    except subprocess.CalledProcessError as e:
        return e.returncode
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
