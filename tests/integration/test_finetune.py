"""Fine-tuning end to end on a real local Ray: instruction data prepared with Ray Data (prompt-completion and chat,
masked, packed, a validation split), then a tiny Hugging Face Llama (made here) fine-tuned from ``model.init_from``,
fully and with LoRA, evaluated on the validation split. Everything is made by the tests: no download."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from raytrn.data.manifest import load_manifest
from raytrn.data.prepare import prepare_dataset
from raytrn.errors import DataError
from tests.conftest import FIXTURE_CORPUS, mlflow_store

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SEQ = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Hugging Face Llama with its tokenizer (a BPE with ChatML's special tokens) and chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in sorted(FIXTURE_CORPUS.rglob("*")) if p.is_file()]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def _examples(n: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa"]
    out = []
    for _ in range(n):
        a, b = rng.integers(0, 50, 2)
        out.append((f"add {a} and {b} {words[a % 8]}:", f" {a + b} {words[b % 8]}"))
    return out


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("examples")
    examples = _examples(240)
    with open(d / "pc.jsonl", "w") as f:
        for p, c in examples:
            f.write(json.dumps({"prompt": p, "completion": c}) + "\n")
    with open(d / "chat.jsonl", "w") as f:
        for p, c in examples:
            messages = [{"role": "system", "content": "be terse"}, {"role": "user", "content": p},
                        {"role": "assistant", "content": c.strip()}]  # fmt: skip
            f.write(json.dumps({"messages": messages}) + "\n")
    return d


def _rows(dataset: Path, prefix: str = "shard") -> dict[str, np.ndarray]:
    table = pq.read_table(sorted(dataset.glob(f"{prefix}-*.parquet")))
    return {c: np.asarray(table.column(c).to_pylist()) for c in table.column_names}


def _tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_prompt_completion_rows_train_on_completions_only(ray_session, model_dir, jsonl, tmp_path) -> None:
    out = tmp_path / "pc"
    m = prepare_dataset(inputs=[str(jsonl / "pc.jsonl")], output=str(out), seq_len=SEQ, tokenizer=str(model_dir),
                        format="prompt-completion", validation_fraction=0.1, progress=False)  # fmt: skip
    assert m.kind == "prompt-completion" and m.extra_columns == ["loss_mask", "segment_ids"] and m.packing
    assert m.tokenizer.config_file == "tokenizer_config.json" and m.tokenizer.eos_token == "<|im_end|>"
    rows, tok = _rows(out), _tokenizer(model_dir)
    completions = {c for _, c in _examples(240)}
    trained_texts = []
    for ids, mask, seg in zip(rows["input_ids"], rows["loss_mask"], rows["segment_ids"], strict=True):
        assert len(ids) == SEQ + 1 and seg.max() >= 2  # packed: several examples a row
        for s in range(1, seg.max() + 1):
            span = seg == s
            trained = ids[span & (mask == 1)]
            assert mask[np.argmax(span)] == 0  # an example's first token: never a target
            text = tok.decode(trained.tolist(), skip_special_tokens=False)
            assert text.endswith("<|im_end|>")
            trained_texts.append(text.removesuffix("<|im_end|>"))
        assert (mask[seg == 0] == 0).all()  # padding: never
    assert set(trained_texts) <= completions and len(trained_texts) == m.examples["examples"]
    val = load_manifest(str(out / "validation.json"))
    assert m.validation["num_rows"] == val.num_rows > 0 and val.examples["examples"] > 10
    assert m.examples["examples"] + val.examples["examples"] == 240  # every example in one split or the other
    # The split is deterministic: the same again in another directory
    again = prepare_dataset(inputs=[str(jsonl / "pc.jsonl")], output=str(tmp_path / "pc2"), seq_len=SEQ,
                            tokenizer=str(model_dir), format="prompt-completion", validation_fraction=0.1,
                            progress=False)  # fmt: skip
    assert again.validation == m.validation
    assert (_rows(tmp_path / "pc2", "val")["input_ids"] == _rows(out, "val")["input_ids"]).all()
    unpacked = prepare_dataset(inputs=[str(jsonl / "pc.jsonl")], output=str(tmp_path / "pad"), seq_len=SEQ,
                               tokenizer=str(model_dir), format="prompt-completion", packing=False,
                               progress=False)  # fmt: skip
    assert unpacked.num_rows == 240 and (_rows(tmp_path / "pad")["segment_ids"].max(axis=1) == 1).all()
    # A job refuses: a validation split smaller than one global batch; a dataset of another tokenizer than init_from's
    from raytrn.train.checks import check_data, validation_set

    big = _job(model_dir, out, tmp_path, "x", f"data.global_batch_size={4 * (val.num_rows + 1)}")
    with pytest.raises(DataError, match="the validation set has .* rows, fewer than one global batch"):
        validation_set(big, check_data(big))
    from tokenizers import Tokenizer, normalizers

    other_dir = tmp_path / "other-tok"
    other_dir.mkdir()
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.normalizer = normalizers.Lowercase()  # another tokenizer of the same size: other ids for the same text
    tok.save(str(other_dir / "tokenizer.json"))
    prepare_dataset(inputs=[str(jsonl / "pc.jsonl")], output=str(tmp_path / "other"), seq_len=SEQ,
                    tokenizer=str(other_dir), format="prompt-completion", progress=False)  # fmt: skip
    with pytest.raises(DataError, match="tokenized with another tokenizer than model.init_from's"):
        check_data(_job(model_dir, tmp_path / "other", tmp_path, "y"))


def test_chat_rows_train_on_the_assistant_turns(ray_session, model_dir, jsonl, tmp_path) -> None:
    out = tmp_path / "chat"
    m = prepare_dataset(inputs=[str(jsonl / "chat.jsonl")], output=str(out), seq_len=SEQ, tokenizer=str(model_dir),
                        format="chat", packing=False, progress=False)  # fmt: skip
    rows, tok = _rows(out), _tokenizer(model_dir)
    answers = [c.strip() for _, c in _examples(240)]
    for k, (ids, mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"], strict=True)):
        trained = tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
        assert trained == f"{answers[k]}<|im_end|>\n"  # the assistant's turn, as the template ends it
        context = tok.decode(ids[(mask == 0) & (rows["segment_ids"][k] > 0)].tolist(), skip_special_tokens=False)
        assert context.startswith("<|im_start|>system\nbe terse<|im_end|>") and "<|im_start|>user" in context
    assert m.examples["skipped"] == 0


def test_bad_examples_name_their_line(ray_session, model_dir, tmp_path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    lines = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
             {"text": "no messages here"}] * 5  # fmt: skip
    (bad / "c.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(DataError, match=r'c.jsonl:2: --format chat needs a non-empty "messages" list'):
        prepare_dataset(inputs=[str(bad)], output=str(tmp_path / "o1"), seq_len=SEQ, tokenizer=str(model_dir),
                        format="chat", progress=False)  # fmt: skip
    m = prepare_dataset(inputs=[str(bad)], output=str(tmp_path / "o2"), seq_len=SEQ, tokenizer=str(model_dir),
                        format="chat", skip_bad_lines=True, progress=False)  # fmt: skip
    assert m.examples["bad_lines"] == 5 and m.examples["examples"] == 5
    broken = tmp_path / "broken-template"
    broken.mkdir()
    for name in ("tokenizer.json",):
        (broken / name).write_bytes((model_dir / name).read_bytes())
    (broken / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ raise_exception('no system role') }}"})
    )
    with pytest.raises(DataError, match=r"c.jsonl:1: the chat template failed to render: .*no system role"):
        prepare_dataset(inputs=[str(bad)], output=str(tmp_path / "o3"), seq_len=SEQ, tokenizer=str(broken),
                        format="chat", progress=False)  # fmt: skip
    with pytest.raises(DataError, match="--format chat needs a tokenizer with a chat template"):
        prepare_dataset(inputs=[str(bad)], output=str(tmp_path / "o4"), seq_len=SEQ,
                        tokenizer=str(model_dir / "tokenizer.json"), format="chat", progress=False)  # fmt: skip


def _job(model_dir: Path, data: Path, tmp: Path, name: str, *extra: str) -> Any:
    from raytrn.config import load_job

    return load_job(
        REPO / "jobs" / "tiny.yaml",
        ["model.preset=null", "model.hidden_size=null", "model.intermediate_size=null", "model.num_layers=null",
         "model.num_attention_heads=null", "model.vocab_size=null", f"model.init_from={model_dir}",
         f"data.manifest={data}", f"data.seq_len={SEQ}", "data.micro_batch_size=4", "data.grad_accum=null",
         "data.global_batch_size=8", "optim.lr=1e-3", "optim.warmup_steps=2", "scaling.min_workers=1",
         "scaling.max_workers=1", f"checkpoint.storage={tmp / 'ckpt'}", "checkpoint.every_n_steps=4",
         f"tracking.mlflow_uri={mlflow_store(tmp / 'mlflow.db')}", "tracking.experiment=raytrn-finetune",
         f"tracking.run_name={name}", "tracking.system_metrics=false", "run.max_steps=8", "run.log_every=1",
         "run.eval_batches=2", *extra],
    )  # fmt: skip


def _history(job: Any, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(job.tracking.mlflow_uri)
    exp = client.get_experiment_by_name("raytrn-finetune")
    [run] = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{job.run_name}'")
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def _run(job: Any) -> Any:
    from mlflow.tracking import MlflowClient

    from raytrn.train.trainer import run_training

    summary = run_training(job, live_progress=False)
    return MlflowClient(job.tracking.mlflow_uri).get_run(summary.mlflow_run_id)


def test_fine_tune_with_validation_then_lora(ray_session, model_dir, jsonl, tmp_path) -> None:
    """init_from + chat data + val_loss every 4 steps; evaluation never changes the training (a run without it has
    the same losses); LoRA logs its merged model, which transformers loads; the best checkpoint is tagged."""
    from transformers import AutoModelForCausalLM

    data = tmp_path / "chat"
    prepare_dataset(inputs=[str(jsonl / "chat.jsonl")], output=str(data), seq_len=SEQ, tokenizer=str(model_dir),
                    format="chat", validation_fraction=0.15, progress=False)  # fmt: skip
    full = _job(model_dir, data, tmp_path, "full", "run.eval_every=4", "tracking.log_model=false",
                "checkpoint.keep_best=true")  # fmt: skip
    run = _run(full)
    assert run.info.status == "FINISHED"
    val = _history(full, "val_loss")
    assert [s for s, _ in val] == [4, 8] and val[1][1] < val[0][1] < 10  # it learns the format
    # Each checkpoint's manifest records the val_loss evaluated at its step (checkpoint.keep_best ranks by it).
    from raytrn.checkpoint.manifest import read_commit
    from raytrn.checkpoint.rundir import RunDir

    recorded = {s: read_commit(RunDir.of(full).dcp_step(s)).val_loss for s in RunDir.of(full).dcp_steps()}
    assert recorded == pytest.approx(dict(val)), (recorded, val)
    assert [s for s, _ in _history(full, "val_perplexity")] == [4, 8]
    assert run.data.tags["best_val_step"] == "8" and run.data.tags["best_checkpoint"].endswith("checkpoint_00000008")
    losses = _history(full, "loss")
    # The same run without validation: the same losses, to the bit (eval draws no random numbers, moves no data)
    plain = _job(model_dir, data, tmp_path, "no-eval", "data.validation=none", "tracking.log_model=false")
    _run(plain)
    assert _history(plain, "loss") == losses and not _history(plain, "val_loss")
    # tokens_seen counts trained (assistant) tokens, not row tokens
    seen = _history(full, "tokens_seen")[-1][1]
    assert 0 < seen < 8 * 8 * SEQ

    lora = _job(model_dir, data, tmp_path, "lora", "run.eval_every=4", "model.lora={rank: 8, alpha: 16}")
    run = _run(lora)
    assert run.info.status == "FINISHED" and run.data.params["model.lora.rank"] == "8"
    assert [s for s, _ in _history(lora, "val_loss")] == [4, 8]
    from mlflow.artifacts import download_artifacts

    model = download_artifacts(run_id=run.info.run_id, artifact_path="model", tracking_uri=lora.tracking.mlflow_uri,
                               dst_path=str(tmp_path / "lora-model"))  # fmt: skip
    merged = AutoModelForCausalLM.from_pretrained(model)
    assert not any("lora" in n for n in merged.state_dict())
