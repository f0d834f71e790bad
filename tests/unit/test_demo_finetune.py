"""``make demo-finetune``'s pieces (raytrn/demos/finetune.py): the standard library as prompt/completion pairs, and
finding the model ``make demo`` logged. The whole demo runs in minutes; `make demo-finetune` is the end to end."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from raytrn.demos.finetune import demo_model, function_examples
from raytrn.errors import ConfigError
from tests.conftest import mlflow_store

pytestmark = pytest.mark.unit


def test_the_standard_library_gives_signature_docstring_pairs() -> None:
    examples = function_examples(limit=500)
    assert len(examples) == 500 and examples == function_examples(limit=500)  # deterministic
    for e in examples:
        assert e["prompt"].startswith("def ") and e["prompt"].endswith('):\n    """')
        assert e["completion"].endswith('"""') and 10 <= len(e["completion"]) - 3 <= 300
        ast.parse(e["prompt"] + e["completion"] + "\n    pass\n")  # a function with its docstring


def test_the_demo_model_is_the_newest_finished_demo_run_with_a_model(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = mlflow_store(tmp_path / "mlflow.db")
    with pytest.raises(ConfigError, match="run `make demo` first"):
        demo_model(uri, tmp_path / "model")
    client = MlflowClient(uri)
    exp = client.create_experiment("raytrn-demo", artifact_location=(tmp_path / "artifacts").as_uri())
    src = tmp_path / "export"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    for name, with_model in (("old", True), ("new", True), ("failed", True), ("newest-no-model", False)):
        run_id = client.create_run(exp, run_name=name).info.run_id
        if with_model:
            (src / "which").write_text(name)
            client.log_artifacts(run_id, str(src), "model")
        client.set_terminated(run_id, "FAILED" if name == "failed" else "FINISHED")
    out = demo_model(uri, tmp_path / "model")
    assert (out / "which").read_text() == "new" and (out / "config.json").exists()
    assert demo_model(uri, tmp_path / "model") == out  # the same run: not copied again
    (out / "precious.txt").write_text("x")  # a file of the user's: never deleted
    import json

    from raytrn.errors import RaytrnError

    stamp = json.loads((out / ".raytrn-demo.json").read_text())
    (out / ".raytrn-demo.json").write_text(json.dumps({**stamp, "run_id": "an older run"}))
    with pytest.raises(RaytrnError, match=r"holds files this demo did not write \(precious.txt\)"):
        demo_model(uri, out)
    assert (out / "precious.txt").exists()
    (out / "precious.txt").unlink()
    assert (demo_model(uri, out) / "which").read_text() == "new"  # replaced: only what it wrote was there
    (tmp_path / "theirs").mkdir()
    with pytest.raises(RaytrnError, match="was not written by this demo"):
        demo_model(uri, tmp_path / "theirs")
    assert (tmp_path / "theirs").exists()
