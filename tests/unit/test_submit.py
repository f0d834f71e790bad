"""raytrn.submit without a cluster: what is uploaded, forwarded and recorded, and failing before submitting."""

from __future__ import annotations

import http.server
import shlex
import threading
from pathlib import Path

import pathspec
import pytest

from raytrn import submit as sub
from raytrn.compat import JobRequestError
from raytrn.errors import RaytrnError
from raytrn.runtime import forwarded_env
from tests.conftest import REPO, _free_port


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray matches excludes with gitwildmatch too
def test_excludes_skip_envs_data_results_but_keep_packages() -> None:
    spec = pathspec.PathSpec.from_lines("gitwildmatch", sub.WORKING_DIR_EXCLUDES)
    for skipped in [".venv/bin/python", ".venv-xla/lib/x.py", ".git/HEAD", "data/stdlib/manifest.json",
                    "mlruns/mlflow.db", "checkpoints/tiny/checkpoint_00000001/state.pt", "raytrn/__pycache__/a.pyc",
                    "raytrn.egg-info/PKG-INFO"]:  # fmt: skip
        assert spec.match_file(skipped), skipped
    for kept in [
        "raytrn/data/prepare/command.py",
        "jobs/tiny.yaml",
        "cluster/local-sim.yaml",
        "tests/fixtures/corpus/x",
    ]:
        assert not spec.match_file(kept), kept


def test_runtime_env(tmp_path: Path) -> None:
    env = sub.runtime_env(tmp_path, {"A": "1"})
    assert env == {"working_dir": str(tmp_path), "excludes": list(sub.WORKING_DIR_EXCLUDES), "env_vars": {"A": "1"}}
    assert "env_vars" not in sub.runtime_env(tmp_path, {})
    with pytest.raises(RaytrnError, match="not a directory"):
        sub.runtime_env(tmp_path / "missing", {})


def test_forwarded_env_takes_mlflow_aws_hf_not_local_files() -> None:
    environ = {
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "MLFLOW_TRACKING_TOKEN": "t",
        "AWS_REGION": "us-west-2",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_PROFILE": "dev",
        "AWS_SHARED_CREDENTIALS_FILE": "/home/me/.aws/credentials",
        "HF_TOKEN": "hf",
        "HOME": "/home/me",
        "PATH": "/usr/bin",
        "RAY_AUTH_TOKEN": "secret",
        # The MLflow server's own secrets (set in a shell that also ran `raytrn mlflow serve --auth`): never sent.
        "MLFLOW_AUTH_ADMIN_PASSWORD": "admin-pw",
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "flask-key",
        "MLFLOW_AUTH_CONFIG_PATH": "/home/me/basic_auth.ini",
        "MLFLOW_BACKEND_STORE_URI": "postgresql://mlflow:db-pw@db/mlflow",
    }
    env = forwarded_env(environ, {"AWS_REGION": "us-east-1", "EXTRA": "x"})
    assert env == {
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "MLFLOW_TRACKING_TOKEN": "t",
        "AWS_REGION": "us-east-1",  # explicit --env wins
        "AWS_ACCESS_KEY_ID": "k",
        "HF_TOKEN": "hf",
        "EXTRA": "x",
    }


def test_metadata_records_user_commit_and_job(tmp_path: Path) -> None:
    meta = sub.job_metadata("jobs/tiny.yaml", "tiny-run", REPO)
    assert meta["raytrn.job_file"] == "jobs/tiny.yaml" and meta["raytrn.run_name"] == "tiny-run"
    assert meta["user"] and all(isinstance(v, str) for v in meta.values())
    assert len(meta["git.commit"].removesuffix("-dirty")) == 40
    assert "git.commit" not in sub.job_metadata("j.yaml", "r", tmp_path)  # not a repository


def test_entrypoint_quotes_overrides() -> None:
    cmd = sub.entrypoint("jobs/tiny.yaml", ["scaling.resources_per_worker={neuron_cores: 1}", "run.max_steps=5"])
    assert shlex.split(cmd) == [
        "python", "-m", "raytrn.cli", "train", "jobs/tiny.yaml", "--no-progress",
        "--set", "scaling.resources_per_worker={neuron_cores: 1}", "--set", "run.max_steps=5",
    ]  # fmt: skip


def test_submit_take_over_reaches_raytrn_train() -> None:
    """`raytrn submit --take-over` runs `raytrn train --take-over` on the cluster: the real CLI parses both."""
    from raytrn.cli import build_parser

    args = build_parser().parse_args(["submit", "jobs/tiny.yaml", "--take-over", "--address", "http://127.0.0.1:8265"])
    assert args.take_over
    cmd = shlex.split(sub.entrypoint("jobs/tiny.yaml", ["run.max_steps=5"], take_over=args.take_over))
    assert cmd[3:7] == ["train", "jobs/tiny.yaml", "--no-progress", "--take-over"]
    train = build_parser().parse_args(cmd[3:])
    assert train.take_over and train.job == "jobs/tiny.yaml" and train.overrides == ["run.max_steps=5"]
    assert "--take-over" not in sub.entrypoint("jobs/tiny.yaml", [])


def test_resolve_token_order(tmp_path: Path) -> None:
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("home-token\n")
    (tmp_path / "tok").write_text("file-token\n")
    assert sub.resolve_token("given", {"RAY_AUTH_TOKEN": "env"}, tmp_path) == "given"
    assert sub.resolve_token(None, {"RAY_AUTH_TOKEN": "env"}, tmp_path) == "env"
    assert sub.resolve_token(None, {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "tok")}, tmp_path) == "file-token"
    assert sub.resolve_token(None, {}, tmp_path) == "home-token"
    assert sub.resolve_token(None, {}, tmp_path / "nowhere") is None
    with pytest.raises(RaytrnError, match="cannot read"):
        sub.resolve_token(None, {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}, tmp_path)
    assert sub.auth_headers("abc") == {"Authorization": "Bearer abc"} and sub.auth_headers(None) == {}


def test_normalize_address() -> None:
    assert sub.normalize_address("127.0.0.1:8265", {}) == "http://127.0.0.1:8265"
    assert sub.normalize_address(None, {"RAY_ADDRESS": "http://h:8265/"}) == "http://h:8265"
    with pytest.raises(RaytrnError, match="no cluster to submit to"):
        sub.normalize_address(None, {"RAY_ADDRESS": "10.0.0.1:6379"})  # a GCS address is not a dashboard
    with pytest.raises(RaytrnError, match="Ray Client address"):
        sub.normalize_address("ray://h:10001", {})


def test_unreachable_address_fails_before_submitting(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_client(*a, **k):
        raise AssertionError("a client was created for an unreachable cluster")

    monkeypatch.setattr(sub, "job_client", no_client)
    monkeypatch.chdir(REPO)
    port = _free_port()  # nothing listens there
    with pytest.raises(
        RaytrnError, match=rf"cannot reach the Ray dashboard at http://127.0.0.1:{port}.*nothing was submitted"
    ):
        paths = ["data.manifest=/data/stdlib", "checkpoint.storage=s3://bkt/ckpt"]
        sub.submit("jobs/tiny.yaml", address=f"127.0.0.1:{port}", overrides=paths, follow=False, token="")


def test_job_file_outside_working_dir(tmp_path: Path) -> None:
    job = tmp_path / "tiny.yaml"
    job.write_text((REPO / "jobs" / "tiny.yaml").read_text())
    with pytest.raises(RaytrnError, match="must be inside the uploaded working dir"):
        sub.submit(job, address="http://127.0.0.1:1", working_dir=REPO, follow=False)


class _AuthDashboard(http.server.BaseHTTPRequestHandler):
    """Answers like a token-protected dashboard: 401 without a token, 403 with a wrong one."""

    def do_GET(self) -> None:  # noqa: N802
        auth = self.headers.get("Authorization")
        code = 401 if not auth else 200 if auth == "Bearer right" else 403
        self.send_response(code)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_token_errors_are_clear() -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), _AuthDashboard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(RaytrnError, match="requires an auth token and none was found"):
            sub.check_reachable(url, {})
        with pytest.raises(RaytrnError, match="rejected the auth token"):
            sub.check_reachable(url, sub.auth_headers("wrong"))
        sub.check_reachable(url, sub.auth_headers("right"))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_register_adds_submit_and_jobs() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    sub.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["submit", "jobs/tiny.yaml", "--set", "a=1", "--env", "K=V", "--no-follow"])
    assert args.overrides == ["a=1"] and sub._parse_env(args.env) == {"K": "V"} and args.no_follow
    assert parser.parse_args(["jobs", "logs", "raytrn-x", "-f"]).follow
    with pytest.raises(RaytrnError, match="expected KEY=VALUE"):
        sub._parse_env(["novalue"])


# -- relative paths and the run name (the README's laptop path: tests/integration/test_laptop_path.py) -------


BASE = "/home/me/raytrn"  # where `raytrn submit` runs


def _jobs(*overrides: str, job: str = "tiny.yaml"):
    from raytrn.config import load_job, resolve_paths

    raw = load_job(REPO / "jobs" / job, list(overrides), resolve=False)
    return raw, resolve_paths(raw, BASE)


def test_a_remote_cluster_refuses_relative_local_paths() -> None:
    raw, job = _jobs()
    with pytest.raises(RaytrnError) as e:
        sub.frozen_overrides(raw, job, local=False, address="http://127.0.0.1:8265")
    msg = str(e.value)
    assert "data.manifest: data/stdlib\n  checkpoint.storage: checkpoints\n" in msg
    assert "s3://BUCKET/PREFIX or an absolute path on the cluster's shared filesystem" in msg
    assert msg.endswith("nothing was submitted")
    raw, job = _jobs("data.manifest=/fsx/data", "checkpoint.storage=s3://bkt/ckpt", "tracking.run_name=r1")
    assert sub.frozen_overrides(raw, job, local=False, address="http://h:8265") == []


def test_the_local_simulator_gets_absolute_paths_and_the_run_name_printed() -> None:
    raw, job = _jobs("tracking.mlflow_uri=sqlite:///mlruns/mlflow.db")
    sets = sub.frozen_overrides(raw, job, local=True, address="http://127.0.0.1:8265", base_dir=BASE)
    assert sets == [
        "data.manifest=/home/me/raytrn/data/stdlib",
        "checkpoint.storage=/home/me/raytrn/checkpoints",
        "tracking.mlflow_uri=sqlite:////home/me/raytrn/mlruns/mlflow.db",
        f"tracking.run_name={job.run_name}",  # the cluster's driver uses the name printed here
    ]
    assert job.run_name.startswith("tiny-")


#: A relative local value for every path field of the job spec (raytrn.config.PATH_FIELDS).
RELATIVE = {
    "model.init_from": "models/hf",
    "data.manifest": "data/train",
    "data.validation": "data/val",
    "checkpoint.storage": "ckpt",
    "neuron.compile_cache": "neuron-cache",
    "tracking.mlflow_uri": "sqlite:///mlruns/mlflow.db",
    "eval.include_path": "eval-tasks",
}


def _hf_checkpoint_config(directory: Path) -> None:
    """The config.json of a Hugging Face checkpoint of the tiny preset's sizes (what loading a job reads of it)."""
    import json

    from raytrn.config import PRESETS

    tiny = PRESETS["tiny"]
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "num_hidden_layers": tiny["num_layers"]}
    config |= {k: v for k, v in tiny.items() if k != "num_layers"}
    (directory / "config.json").write_text(json.dumps(config))


def test_relative_covers_every_path_field() -> None:
    from raytrn.config import PATH_FIELDS

    assert set(RELATIVE) == {f.key for f in PATH_FIELDS}


@pytest.mark.parametrize("key", sorted(RELATIVE))
def test_frozen_overrides_make_every_path_field_absolute(key: str, tmp_path: Path) -> None:
    """Each path field, relative, is made absolute for the simulator and refused for another cluster (a relative
    model.init_from or data.validation used to end in a KeyError traceback)."""
    from raytrn.config import load_job, resolve_paths

    _hf_checkpoint_config(tmp_path / "models" / "hf")
    base = str(tmp_path)
    sets = ["data.manifest=/abs/data", "checkpoint.storage=/abs/ckpt", "tracking.run_name=r1"]
    sets.append(f"{key}={RELATIVE[key]}")
    raw = load_job(REPO / "jobs" / "tiny.yaml", sets, base_dir=base, resolve=False)
    job = resolve_paths(raw, base)
    frozen = sub.frozen_overrides(raw, job, local=True, address="http://127.0.0.1:8265", base_dir=base)
    value = RELATIVE[key]
    expected = f"sqlite:///{base}/mlruns/mlflow.db" if value.startswith("sqlite:///") else f"{base}/{value}"
    assert frozen == [f"{key}={expected}"]
    with pytest.raises(RaytrnError) as e:
        sub.frozen_overrides(raw, job, local=False, address="http://h:8265", base_dir=base)
    assert f"\n  {key}: {value}\n" in str(e.value)


def test_the_shipped_fine_tuning_job_submits_to_the_simulator(tmp_path: Path) -> None:
    """jobs/finetune-tiny.yaml names its model relatively (data/demo-model): frozen, not a KeyError."""
    from raytrn.config import load_job, resolve_paths

    _hf_checkpoint_config(tmp_path / "data" / "demo-model")
    raw = load_job(REPO / "jobs" / "finetune-tiny.yaml", [], base_dir=str(tmp_path), resolve=False)
    job = resolve_paths(raw, str(tmp_path))
    frozen = sub.frozen_overrides(raw, job, local=True, address="http://127.0.0.1:8265", base_dir=str(tmp_path))
    assert frozen == [
        f"model.init_from={tmp_path}/data/demo-model",
        f"data.manifest={tmp_path}/data/stdlib-sft",
        f"checkpoint.storage={tmp_path}/checkpoints",
        f"tracking.run_name={job.run_name}",
    ]


def test_a_driver_in_a_ray_job_refuses_relative_paths(tmp_path: Path) -> None:
    """`ray job submit --working-dir . -- raytrn train jobs/tiny.yaml`: the same paths, caught on the cluster."""
    import json

    from raytrn.runtime import check_paths_for_ray_job, ray_job_working_dir

    in_job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"}})}
    assert ray_job_working_dir(in_job) is not None and ray_job_working_dir({}) is None
    raw, _ = _jobs()
    with pytest.raises(RaytrnError) as e:
        check_paths_for_ray_job(raw, in_job)
    msg = str(e.value)
    assert "data.manifest: data/stdlib" in msg and "checkpoint.storage: checkpoints" in msg
    assert "tracking.mlflow_uri: null with no MLFLOW_TRACKING_URI here" in msg
    check_paths_for_ray_job(raw, {})  # not in a Ray job: `raytrn train` resolves them where it runs
    ok, _ = _jobs("data.manifest=/fsx/d", "checkpoint.storage=s3://bkt/c")
    check_paths_for_ray_job(ok, {**in_job, "MLFLOW_TRACKING_URI": "http://head:5000"})


def test_unknown_job_ids_are_one_clear_error() -> None:
    def missing() -> None:
        raise JobRequestError(404, "Job nope does not exist")

    with pytest.raises(RaytrnError, match=r"^no job 'nope' on the cluster at http://h:8265; `raytrn jobs list"):
        sub._on_job("http://h:8265", "nope", missing)

    def broken() -> None:
        raise JobRequestError(500, "boom")

    with pytest.raises(JobRequestError, match="500"):  # anything else is not the user's mistake
        sub._on_job("http://h:8265", "x", broken)


def test_only_the_dashboards_404_means_no_such_job() -> None:
    """It read "404" or "does not exist" in the message: a server error naming a job id with 404 in it, or saying
    some file "does not exist", was reported as an unknown job. Now the status code, from the error."""

    def server_error() -> None:
        raise JobRequestError(500, "job raysubmit_4041: runtime_env working_dir does not exist on the head node")

    with pytest.raises(JobRequestError) as e:
        sub._on_job("http://h:8265", "raysubmit_4041", server_error)
    assert e.value.status_code == 500

    def other() -> None:
        raise RuntimeError("Job 404 does not exist")  # not the SDK's answer: never read as one

    with pytest.raises(RuntimeError, match="Job 404"):
        sub._on_job("http://h:8265", "404", other)


def test_the_job_clients_failed_requests_keep_their_status_code() -> None:
    """The SDK's error hook (a private name, resolved by test_compat) raises the typed error; it pickles as it is."""
    import pickle
    from types import SimpleNamespace

    from raytrn import compat

    cls = compat.job_client_class()
    client = cls.__new__(cls)  # (no dashboard: only the hook is called)
    with pytest.raises(JobRequestError) as e:
        client._raise_error(SimpleNamespace(status_code=404, text="Job x does not exist"))
    assert (e.value.status_code, e.value.text) == (404, "Job x does not exist")
    assert str(e.value) == "Request failed with status code 404: Job x does not exist."  # the SDK's own message
    again = pickle.loads(pickle.dumps(e.value))
    assert isinstance(again, RuntimeError) and (again.status_code, str(again)) == (404, str(e.value))


def test_the_local_simulators_token_is_found_by_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    token = tmp_path / "local-cluster.token"
    token.write_text("sim-token\n")
    sim = SimpleNamespace(token_path=str(token))
    monkeypatch.setattr(sub, "_local_cluster", lambda address: sim if address == "http://127.0.0.1:8265" else None)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("another-clusters-token")
    assert sub.resolve_token(None, {}, tmp_path, address="http://127.0.0.1:8265") == "sim-token"
    assert sub.resolve_token(None, {}, tmp_path, address="http://10.0.0.1:8265") == "another-clusters-token"
    assert sub.resolve_token(None, {"RAY_AUTH_TOKEN": "env"}, tmp_path, address="http://127.0.0.1:8265") == "env"


def test_a_set_value_that_looks_like_a_secret_is_warned_about_without_showing_it() -> None:
    ok = ["run.max_steps=4", "tracking.mlflow_uri=http://mlflow:5000", "data.tokenizer=tok/tokenizer.json"]
    assert sub.secret_overrides(ok) == []
    warned = sub.secret_overrides(["tracking.mlflow_uri=http://me:s3cr3t@mlflow:5000", "x.api_key=abc", *ok])
    assert len(warned) == 2 and all("dashboard" in w and "environment variables" in w for w in warned)
    assert not any("s3cr3t" in w or "abc" in w for w in warned)
    assert warned[0].startswith("--set tracking.mlflow_uri=... looks like it holds a secret")


def test_a_token_file_readable_by_others_is_made_0600_when_read(tmp_path: Path, capsys) -> None:
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("tok\n")
    token.chmod(0o644)
    assert sub.resolve_token(environ={}, home=tmp_path) == "tok"
    assert token.stat().st_mode & 0o777 == 0o600
    assert "was readable by other users: made it 0600" in capsys.readouterr().err
    assert sub.resolve_token(environ={}, home=tmp_path) == "tok"  # already 0600: said once
    assert capsys.readouterr().err == ""


def test_the_cluster_files_make_the_copied_token_0600() -> None:
    for name in ("aws-trn1.yaml", "aws-trn2.yaml"):
        text = (REPO / "cluster" / name).read_text()
        assert "~/.ray/auth_token: ~/.ray/auth_token" in text and "- chmod 600 ~/.ray/auth_token" in text, name
