"""Run the ``lm-eval`` harness (EleutherAI, 0.4.13) on a local Hugging Face model directory, offline.

:func:`build_task` writes one of :data:`SHIPPED_TASKS` into a directory: an lm-eval task YAML and the local JSONL
dataset it reads (``dataset_path: json``), built from the running Python's standard library, so nothing is
downloaded. :func:`run_lm_eval` scores a model directory on such tasks (that directory is the ``include_path``) and
returns flat scores keyed for MLflow, e.g. ``{"stdlib_next_line/acc": 0.31, "stdlib_next_line/acc_stderr": 0.07}``.

The task ``stdlib_next_line`` (multiple choice): a source line of a top-level standard library module (the demo
corpus, ``make demo``), with the two lines before it, is the context; the choices are the true next line and three
lines drawn from other modules. Blank lines and comment lines are skipped; a model trained on the demo corpus has
seen these lines, so the task measures how well it learned that corpus, not how it generalizes. The rows depend on
``seed`` and on this Python's standard library only (another Python version gives other rows).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raytrn.errors import RaytrnError


@dataclass(frozen=True)
class ShippedTask:
    """A task raytrn writes for lm-eval: its rows (``make_rows(rows, seed)``) and the YAML fields that read them."""

    description: str
    make_rows: Callable[[int, int], list[dict[str, Any]]]
    config: dict[str, Any]


_MIN_CHARS, _MAX_CHARS = 20, 120  # a line fit to be a context's last line, an answer or a distractor
_LINES_BEFORE = 2
_DISTRACTORS = 3


def _source_lines(path: Path) -> list[str]:
    """The file's non-blank lines, trailing whitespace removed, indentation kept."""
    lines = (line.rstrip() for line in path.read_text(encoding="utf-8", errors="replace").split("\n"))
    return [line for line in lines if line]


def _fits(line: str) -> bool:
    return _MIN_CHARS <= len(line) <= _MAX_CHARS and not line.lstrip().startswith("#")


def _stdlib_next_line_rows(rows: int, seed: int) -> list[dict[str, Any]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if len(files) < 2:
        raise RaytrnError(
            f"stdlib_next_line: found {len(files)} .py files in {stdlib} (this Python's standard library); the task "
            "needs the library's source: run with a Python installed with its .py files"
        )
    lines: dict[Path, list[str]] = {}
    fitting: dict[Path, list[int]] = {}  # indices of fitting lines whose next line fits too

    def scan(path: Path) -> list[int]:
        if path not in fitting:
            src = lines[path] = _source_lines(path)
            fitting[path] = [i for i in range(len(src) - 1) if _fits(src[i]) and _fits(src[i + 1])]
        return fitting[path]

    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    seen: set[tuple[Path, int]] = set()
    for _ in range(rows * 20):  # bounded: a standard library has far more lines than any sensible ``rows``
        if len(out) == rows:
            break
        path = rng.choice(files)
        picks = scan(path)
        if not picks:
            continue
        i = rng.choice(picks)
        if (path, i) in seen:
            continue
        seen.add((path, i))
        answer = lines[path][i + 1]
        choices: list[str] = []
        for _ in range(_DISTRACTORS * 20):
            if len(choices) == _DISTRACTORS:
                break
            other = rng.choice(files)
            other_picks = scan(other) if other != path else []
            if other_picks:
                line = lines[other][rng.choice(other_picks) + 1]
                if line != answer and line not in choices:
                    choices.append(line)
        if len(choices) < _DISTRACTORS:
            continue
        label = rng.randrange(_DISTRACTORS + 1)
        choices.insert(label, answer)
        context = "\n".join(lines[path][max(0, i - _LINES_BEFORE) : i + 1])
        out.append({"context": context, "choices": choices, "label": label})
    if len(out) < rows:
        raise RaytrnError(f"stdlib_next_line: only {len(out)} of {rows} rows found in {stdlib}; ask for fewer rows")
    return out


SHIPPED_TASKS: dict[str, ShippedTask] = {
    "stdlib_next_line": ShippedTask(
        description="pick a standard library line's true next line among 4 (3 from other modules)",
        make_rows=_stdlib_next_line_rows,
        config={
            "output_type": "multiple_choice",
            "test_split": "test",
            "doc_to_text": "context",  # a field name: taken verbatim (no Jinja rendering of the source text)
            "doc_to_choice": "choices",
            "doc_to_target": "label",
            "target_delimiter": "\n",  # each choice continues the context on the next line
            "metric_list": [
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
            ],
            "metadata": {"version": 1.0},
        },
    ),
}


class _Dumper(yaml.SafeDumper):
    """Strings with a newline (``target_delimiter``) double-quoted, ``"\\n"``, not folded over lines."""


_Dumper.add_representer(
    str, lambda dumper, s: dumper.represent_scalar("tag:yaml.org,2002:str", s, style='"' if "\n" in s else None)
)


def build_task(name: str, out_dir: str, *, rows: int = 200, seed: int = 0) -> str:
    """Write the shipped task ``name`` into ``out_dir``: ``<name>.jsonl`` (``rows`` rows, chosen by ``seed``) and
    ``<name>.yaml`` reading it. Returns the directory to pass as :func:`run_lm_eval`'s ``include_path``."""
    task = SHIPPED_TASKS.get(name)
    if task is None:
        raise RaytrnError(
            f"unknown shipped task {name!r} (raytrn.evals.harness.build_task); the tasks raytrn ships: "
            f"{', '.join(sorted(SHIPPED_TASKS))}"
        )
    if rows < 1:
        raise RaytrnError(f"build_task({name!r}): rows={rows}; ask for at least 1 row")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in task.make_rows(rows, seed)), encoding="utf-8")
    config = {
        "task": name,
        "dataset_path": "json",  # the datasets library's packaged JSON builder: reads local files only
        # the Arrow cache beside the data, not in ~/.cache/huggingface: nothing outlives out_dir
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(out / ".hf_datasets")},
        **task.config,
    }
    header = f"# {name}: {task.description}. Written by raytrn.evals.harness.build_task(rows={rows}, seed={seed}).\n"
    text = yaml.dump(config, Dumper=_Dumper, sort_keys=False)
    (out / f"{name}.yaml").write_text(header + text, encoding="utf-8")
    return str(out)


#: Set while lm-eval runs; ``huggingface_hub`` and ``datasets`` read them once, at import, so their module
#: constants are switched too (and everything restored after).
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


@contextlib.contextmanager
def _attributes(changes: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each ``(object, name, value)`` set for the block, and every old value put back after."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    import datasets.config
    import huggingface_hub.constants

    consts = [(huggingface_hub.constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE")]
    consts += [(datasets.config, "HF_DATASETS_OFFLINE")] if hasattr(datasets.config, "HF_DATASETS_OFFLINE") else []
    saved_env = {key: os.environ.get(key) for key in _OFFLINE_ENV}
    try:
        os.environ.update(dict.fromkeys(_OFFLINE_ENV, "1"))
        with _attributes([(module, attr, True) for module, attr in consts]):
            yield
    finally:
        for key, old in saved_env.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _no_provenance_probes() -> contextlib.AbstractContextManager[None]:
    """lm-eval's ``simple_evaluate`` without its provenance probes, whose results raytrn discards (it keeps
    ``results["results"]``; the run already records the job's code commit): ``git describe`` in the working directory
    (an evaluation runs in its task directory, no repository: git printed "fatal: not a git repository" on the
    terminal once per evaluation) and torch's ``collect_env`` (``pip list`` and other subprocesses, ~0.7 s a call
    here). Each name is swapped only where lm-eval's evaluator has it, and put back after;
    ``tests/unit/test_evals_harness.py`` fails when the git line comes back."""
    import lm_eval.evaluator as evaluator

    probes = {"get_git_commit_hash": lambda: None, "add_env_info": lambda results: None}
    return _attributes([(evaluator, name, fn) for name, fn in probes.items() if hasattr(evaluator, name)])


def _task_manager(tasks: list[str], include_path: str | None) -> Any:
    """lm-eval's TaskManager that knows every name in ``tasks``: ``include_path`` alone when it has them all (its
    own built-in tasks take ~5 s to index), else with the built-ins too (whose datasets must be in the local cache)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise RaytrnError(
                f"include_path {include_path!r} is not a directory; pass the directory build_task returned"
            )
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in manager.all_tasks for t in tasks):
            return manager
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        shipped = [t for t in unknown if t in SHIPPED_TASKS]
        hint = (
            f"build {', '.join(shipped)} first: include_path=raytrn.evals.harness.build_task(name, out_dir)"
            if shipped
            else f"use a task raytrn ships ({', '.join(sorted(SHIPPED_TASKS))}, written by build_task), one in "
            "include_path, or an lm-eval built-in task (`lm-eval ls tasks`)"
        )
        raise RaytrnError(f"unknown lm-eval task(s) {unknown} (include_path={include_path!r}); {hint}")
    return manager


def _metric_key(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-./]", "_", name)


def flat_scores(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's ``results["results"]`` (``{task: {"acc,none": 0.3, "acc_stderr,none": 0.07, "alias": ...}}``) as
    MLflow metrics: ``{"task/acc": 0.3, "task/acc_stderr": 0.07}``; a filter other than ``none`` is kept as a
    suffix (``exact_match.strict-match``); non-numbers (aliases, "N/A" stderrs) are dropped."""
    scores: dict[str, float] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            scores[_metric_key(f"{task}/{metric if filt == 'none' else f'{metric}.{filt}'}")] = float(value)
    return scores


def run_lm_eval(
    model_dir: str,
    tasks: list[str],
    *,
    include_path: str | None,
    limit: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
) -> dict[str, float]:
    """Score the Hugging Face model in ``model_dir`` on the lm-eval ``tasks`` (names; raytrn's from
    :func:`build_task`'s ``include_path``), at most ``limit`` documents each (the first ones), in float32, with
    the Hugging Face Hub and datasets offline. Returns :func:`flat_scores` of lm-eval's results."""
    model = Path(model_dir).resolve()
    if not (model / "config.json").is_file():
        raise RaytrnError(
            f"no config.json in {model_dir}: run_lm_eval needs a Hugging Face model directory (config.json, "
            "weights, tokenizer files), e.g. the `model` artifact a raytrn run logs; pass that directory, not a "
            "raytrn training checkpoint"
        )
    if not tasks:
        raise RaytrnError(f"run_lm_eval: no tasks given; e.g. tasks={sorted(SHIPPED_TASKS)} with build_task")
    with _offline(), _no_provenance_probes():
        import lm_eval

        manager = _task_manager(list(tasks), include_path)
        results = lm_eval.simple_evaluate(
            model="hf",
            # a dict, not "pretrained=...,dtype=float32": lm-eval splits that string at commas and "="
            model_args={"pretrained": str(model), "dtype": "float32"},
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            batch_size=batch_size,
            device=device,
            log_samples=False,
        )
    if results is None:  # only on a non-zero rank of a distributed lm-eval run
        return {}
    return flat_scores(results["results"])
