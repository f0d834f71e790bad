"""raytrn.evals.harness: the shipped ``stdlib_next_line`` task, written by build_task, scored by lm-eval on a tiny
Hugging Face Llama made here (a byte-level BPE tokenizer trained on three standard library modules), with the
network blocked: scores in [0, 1] under MLflow-safe keys, repeatable, equal to a plain ``lm_eval.simple_evaluate``
call's, and clear errors for an unknown task or a directory that is no model. One process, ~30 s on 2 cores."""

from __future__ import annotations

import json
import os
import socket
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from raytrn.errors import RaytrnError
from raytrn.evals.harness import build_task, run_lm_eval

pytestmark = pytest.mark.unit

TASK = "stdlib_next_line"
ROWS = 40


def tiny_llama(out: Path) -> Path:
    """A 2-layer Llama (random weights) and a PreTrainedTokenizerFast saved as raytrn's export saves them."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(stdlib / name) for name in ("abc.py", "bisect.py", "heapq.py")], trainer)
    unk, bos, eos, pad = specials
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, bos_token=bos, eos_token=eos, pad_token=pad)
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.token_to_id(bos),
        eos_token_id=tok.token_to_id(eos),
        pad_token_id=tok.token_to_id(pad),
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_llama(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_task(TASK, str(tmp_path_factory.mktemp("tasks")), rows=ROWS)


@pytest.fixture
def network(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every host lookup fails (and is recorded): nothing in these tests may reach the network."""
    tried: list[Any] = []

    def refuse(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        tried.append((host, port))
        raise OSError(f"network blocked by the test: {host}:{port}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return tried


def test_build_task_writes_a_deterministic_local_task(tmp_path: Path) -> None:
    a = Path(build_task(TASK, str(tmp_path / "a"), rows=ROWS, seed=3))
    b = Path(build_task(TASK, str(tmp_path / "b"), rows=ROWS, seed=3))
    c = Path(build_task(TASK, str(tmp_path / "c"), rows=ROWS, seed=4))
    data = (a / f"{TASK}.jsonl").read_text()
    assert data == (b / f"{TASK}.jsonl").read_text() != (c / f"{TASK}.jsonl").read_text()
    rows = [json.loads(line) for line in data.splitlines()]
    assert len(rows) == ROWS
    for row in rows:
        assert set(row) == {"context", "choices", "label"}
        assert len(row["choices"]) == len(set(row["choices"])) == 4 and 0 <= row["label"] < 4
        assert all(20 <= len(line) <= 120 for line in [row["context"].split("\n")[-1], *row["choices"]])
    yaml_text = (a / f"{TASK}.yaml").read_text()
    assert "dataset_path: json" in yaml_text and str(a / f"{TASK}.jsonl") in yaml_text


def test_scores_are_repeatable_offline_and_mlflow_keyed(
    model_dir: str,
    task_dir: str,
    network: list[Any],
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import huggingface_hub.constants
    import lm_eval.evaluator

    hub_offline = huggingface_hub.constants.HF_HUB_OFFLINE
    env = {key: os.environ.get(key) for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    probes = (lm_eval.evaluator.get_git_commit_hash, lm_eval.evaluator.add_env_info)
    monkeypatch.chdir(task_dir)  # where the evaluator's task runs it: no git repository
    capfd.readouterr()
    scores = run_lm_eval(model_dir, [TASK], include_path=task_dir, limit=ROWS)
    err = capfd.readouterr().err  # fd 2: what a subprocess of lm-eval's printed too
    assert "not a git repository" not in err and "fatal:" not in err, err
    assert (lm_eval.evaluator.get_git_commit_hash, lm_eval.evaluator.add_env_info) == probes  # put back
    assert set(scores) == {f"{TASK}/acc", f"{TASK}/acc_stderr", f"{TASK}/acc_norm", f"{TASK}/acc_norm_stderr"}
    assert all(0.0 <= value <= 1.0 for value in scores.values())
    assert run_lm_eval(model_dir, [TASK], include_path=task_dir, limit=ROWS) == scores
    assert network == []  # the datasets library's download-count ping included
    assert {key: os.environ.get(key) for key in env} == env  # the offline switches are put back
    assert huggingface_hub.constants.HF_HUB_OFFLINE == hub_offline


def test_same_accuracy_as_the_plain_harness(model_dir: str, task_dir: str, network: list[Any]) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    plain = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},dtype=float32",
        tasks=[TASK],
        task_manager=TaskManager(include_path=task_dir),
        limit=ROWS,
        batch_size=8,
        device="cpu",
    )
    assert plain is not None
    ours = run_lm_eval(model_dir, [TASK], include_path=task_dir, limit=ROWS)
    assert ours[f"{TASK}/acc"] == plain["results"][TASK]["acc,none"]
    assert ours[f"{TASK}/acc_norm"] == plain["results"][TASK]["acc_norm,none"]


def test_clear_errors(model_dir: str, task_dir: str, tmp_path: Path, network: list[Any]) -> None:
    with pytest.raises(RaytrnError, match=r"unknown lm-eval task\(s\) \['no_such_task'\].*stdlib_next_line"):
        run_lm_eval(model_dir, ["no_such_task"], include_path=task_dir, limit=2)
    with pytest.raises(RaytrnError, match=r"unknown shipped task 'no_such_task'.*stdlib_next_line"):
        build_task("no_such_task", str(tmp_path))
    with pytest.raises(RaytrnError, match=r"no config.json in .*Hugging Face model directory"):
        run_lm_eval(str(tmp_path), [TASK], include_path=task_dir)
