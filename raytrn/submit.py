"""Submitting ``raytrn train`` to a Ray cluster as a Ray job, and looking after submitted jobs.

``raytrn submit JOB.yaml --address http://HEAD:8265`` validates the job spec here, uploads the working
dir (without environments, local data or results), forwards the MLflow/AWS settings of this shell to the
job, records who submitted what (user, git commit) as job metadata, and follows the job's logs. An
unreachable cluster fails before anything is uploaded.

The job runs in a temporary copy of the working dir, so local paths relative to it would point at nothing:
for the local simulator (``raytrn cluster up --local``, which shares this filesystem) they are made absolute;
for any other cluster they are refused (exit 2, nothing submitted). The run name is fixed here, so the name
printed is the one the cluster's driver uses.
"""

from __future__ import annotations

import argparse
import getpass
import os
import shlex
import sys
import uuid
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any

from raytrn.cli_args import add_set_option
from raytrn.cluster.local import running
from raytrn.compat import JobRequestError, job_client
from raytrn.config import absolute_overrides, load_job, relative_local_paths, resolve_paths
from raytrn.errors import RaytrnError
from raytrn.runtime import forwarded_env, git_commit, relative_paths_error, unforwarded_paths
from raytrn.tracking.client import basic_auth, is_http, is_secret_key, redact_uri, split_credentials

# Never uploaded with the working dir: environments, local datasets and results, caches, git history.
# gitignore syntax, relative to the working dir: a leading "/" anchors at its top, so "/data" skips the
# local datasets but keeps the raytrn/data package.
WORKING_DIR_EXCLUDES: tuple[str, ...] = (
    "/.venv",
    "/.venv-*",
    "/.git",
    "/data",
    "/mlruns",
    "/checkpoints",
    "__pycache__",
    "*.egg-info",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
)

ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")  # the variables `ray job submit` reads too


def runtime_env(working_dir: str | os.PathLike[str], env_vars: Mapping[str, str]) -> dict[str, Any]:
    """Ray runtime env: the working dir minus :data:`WORKING_DIR_EXCLUDES`, and the job's variables."""
    wd = Path(working_dir).resolve()
    if not wd.is_dir():
        raise RaytrnError(f"--working-dir {working_dir}: not a directory")
    out: dict[str, Any] = {"working_dir": str(wd), "excludes": list(WORKING_DIR_EXCLUDES)}
    if env_vars:
        out["env_vars"] = dict(env_vars)
    return out


def move_uri_credentials(overrides: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``tracking.mlflow_uri=http://user:pw@host`` -> the URI without them, and MLflow's own variables for the
    job's environment: the command line (shown on the dashboard, in ``ray job list``) never carries a password.
    A database's URI (``postgresql://user:pw@db/mlflow``) cannot lose its password: it goes whole, as
    ``MLFLOW_TRACKING_URI``, and the override becomes ``null`` (the job then reads that variable)."""
    out, env = [], {}
    for kv in overrides:
        key, _, value = kv.partition("=")
        if key == "tracking.mlflow_uri":
            clean, user, password = split_credentials(value)
            if password is not None and not is_http(value):
                env["MLFLOW_TRACKING_URI"] = value
                clean = "null"
            else:
                if user:
                    env["MLFLOW_TRACKING_USERNAME"] = user
                if password is not None:
                    env["MLFLOW_TRACKING_PASSWORD"] = password
            kv = f"{key}={clean}"
        out.append(kv)
    return out, env


def secret_overrides(overrides: Sequence[str]) -> list[str]:
    """A warning for each ``--set KEY=VALUE`` that looks like it carries a secret (a secret-sounding key, a
    password in a URI): the job's command line is shown on the cluster's dashboard to whoever can reach it."""
    out = []
    for kv in overrides:
        key, _, value = kv.partition("=")
        if is_secret_key(key) or redact_uri(value) != value:
            out.append(
                f"--set {key}=... looks like it holds a secret, and the job's command line is shown on the cluster's "
                "dashboard: pass credentials as environment variables instead (MLFLOW_TRACKING_USERNAME/PASSWORD, "
                "AWS_*, HF_TOKEN: forwarded from this shell or given with --env)"
            )
    return out


def job_metadata(job_file: str, run_name: str, working_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Who submitted what: shown by ``raytrn jobs list`` and the dashboard (values must be strings)."""
    meta = {"raytrn.job_file": job_file, "raytrn.run_name": run_name, "user": _user()}
    commit = git_commit(working_dir)
    if commit:
        meta["git.commit"] = commit
    return meta


def entrypoint(
    job_file: str, overrides: Sequence[str], command: Sequence[str] | None = None, *, take_over: bool = False
) -> str:
    """The shell command the job runs in the unpacked working dir: ``raytrn train JOB`` (``take_over``: with
    ``--take-over``) or ``raytrn <command...>``, e.g. a sweep's driver, with the ``--set`` overrides."""
    train = ["train", job_file, "--no-progress", *(["--take-over"] if take_over else [])]
    args = ["python", "-m", "raytrn.cli", *(command or train)]
    for kv in overrides:
        args += ["--set", kv]
    return shlex.join(args)


def resolve_token(
    explicit: str | None = None,
    environ: Mapping[str, str] | None = None,
    home: Path | None = None,
    *,
    address: str | None = None,
) -> str | None:
    """The Ray auth token, looked up in Ray's own order: given, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, then the
    local simulator's token when ``address`` is its dashboard, then ~/.ray/auth_token."""
    environ = os.environ if environ is None else environ
    if explicit:
        return explicit.strip()
    if environ.get("RAY_AUTH_TOKEN"):
        return environ["RAY_AUTH_TOKEN"].strip()
    path = Path(environ["RAY_AUTH_TOKEN_PATH"]) if environ.get("RAY_AUTH_TOKEN_PATH") else None
    if path is None and address is not None:
        local = _local_cluster(address)
        if local is not None and local.token_path:
            path = Path(local.token_path)
    if path is None:
        path = (home or Path.home()) / ".ray" / "auth_token"
        if not path.is_file():
            return None
    try:
        if path.stat().st_mode & 0o077:  # readable by others: the token runs code on the cluster
            path.chmod(0o600)
            print(
                f"raytrn: {path} was readable by other users: made it 0600 (the Ray token runs code)", file=sys.stderr
            )
        return path.read_text().strip() or None
    except OSError as e:
        raise RaytrnError(f"RAY_AUTH_TOKEN_PATH={path}: cannot read the Ray auth token ({e})") from None


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def normalize_address(address: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The dashboard URL to submit to: given, or RAY_API_SERVER_ADDRESS / RAY_ADDRESS when those are URLs."""
    environ = os.environ if environ is None else environ
    if not address:
        address = next((environ[k] for k in ADDRESS_ENV if environ.get(k, "").startswith(("http://", "https://"))), "")
    if not address:
        raise RaytrnError(
            "no cluster to submit to: pass --address http://HEAD:8265 (the Ray dashboard; through an SSH tunnel, "
            "`ray dashboard cluster.yaml`), or set RAY_API_SERVER_ADDRESS"
        )
    if address.startswith("ray://"):
        raise RaytrnError(
            f"--address {redact_uri(address)}: that is a Ray Client address; jobs go to the dashboard, http://HEAD:8265"
        )
    if "://" not in address:
        address = f"http://{address}"
    return address.rstrip("/")


def dashboard_address(address: str | None, environ: Mapping[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """:func:`normalize_address`, with a ``user:password@`` written in it split off as basic-auth headers (a proxy
    in front of the dashboard; the Ray token, when there is one, is sent instead): the URL raytrn prints and
    hands to Ray's client never holds the password."""
    clean, user, password = split_credentials(normalize_address(address, environ))
    return clean, basic_auth(user or "", password or "") if user or password is not None else {}


def check_reachable(
    address: str, headers: Mapping[str, str], timeout_s: float = 5.0, *, outcome: str = "nothing was submitted"
) -> None:
    """Fail fast and clearly (``outcome``: nothing submitted) when the dashboard is down or refuses our credentials."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{address}/api/jobs/", headers=dict(headers))
    try:
        urllib.request.urlopen(req, timeout=timeout_s).close()
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise RaytrnError(
                f"the Ray cluster at {address} requires an auth token and none was found: set RAY_AUTH_TOKEN, "
                f"RAY_AUTH_TOKEN_PATH or --token-file (on the head: `ray get-auth-token`); {outcome}"
            ) from None
        if e.code == 403:
            raise RaytrnError(
                f"the Ray cluster at {address} rejected the auth token; check RAY_AUTH_TOKEN / --token-file "
                f"(on the head: `ray get-auth-token`); {outcome}"
            ) from None
        # Anything else is the dashboard answering: let the client report it.
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise RaytrnError(
            f"cannot reach the Ray dashboard at {address} ({reason}); check the address and the SSH tunnel "
            f"(`ray dashboard cluster.yaml`); {outcome}"
        ) from None


def submit(
    job_path: str | os.PathLike[str],
    *,
    address: str | None,
    overrides: Sequence[str] = (),
    follow: bool = True,
    env: Mapping[str, str] | None = None,
    working_dir: str | os.PathLike[str] = ".",
    token: str | None = None,
    submission_id: str | None = None,
    command: Sequence[str] | None = None,
    mapping: dict[str, Any] | None = None,
    name: str | None = None,
    take_over: bool = False,
) -> str:
    """Submit ``raytrn train JOB`` as a Ray job and return its submission id (following its logs if asked).

    The job spec is validated here first (with ``overrides``; data checks happen on the cluster). ``env``
    adds to the forwarded MLflow/AWS variables of this process. ``command`` (with the job file's path as the
    working dir has it, see :func:`job_file_in`) replaces ``train JOB``: a sweep's driver, whose job file
    ``mapping`` is given without its ``sweep:`` section, and ``name`` is the sweep's. ``take_over``: the job
    replaces a stale lease on its run (``raytrn train --take-over``).
    """
    base_dir = os.getcwd()
    raw = load_job(str(job_path), list(overrides), base_dir=base_dir, resolve=False, raw=mapping)
    job = resolve_paths(raw, base_dir)
    from raytrn.estimate.job import check_fits  # refuses a job whose workers cannot fit their devices

    print(f"raytrn: {check_fits(raw)}", flush=True)
    wd = Path(working_dir).resolve()
    job_file = job_file_in(job_path, wd)
    address, basic = dashboard_address(address)
    local = _local_cluster(address)
    fixed = [*overrides, *frozen_overrides(raw, job, local=local is not None, address=address, base_dir=base_dir)]
    if command is not None:  # a sweep names its trials' runs itself
        fixed = [kv for kv in fixed if not kv.startswith("tracking.run_name=")]
    fixed, credentials = move_uri_credentials(fixed)
    env = {**credentials, **(env or {})}
    if "MLFLOW_TRACKING_URI" in credentials:  # --set's URI wins over --env's, as over $MLFLOW_TRACKING_URI
        env["MLFLOW_TRACKING_URI"] = credentials["MLFLOW_TRACKING_URI"]
    for warning in secret_overrides(fixed):
        print(f"raytrn: WARNING: {warning}", file=sys.stderr)
    token = resolve_token(token, address=address)
    headers = auth_headers(token) or basic
    check_reachable(address, headers)

    client = job_client(address, headers)
    run_name = name or job.run_name
    submission_id = submission_id or f"raytrn-{run_name}-{uuid.uuid4().hex[:6]}"
    # Ray hands the driver its submission id only inside RAY_JOB_CONFIG_JSON_ENV_VAR; the trainer tags the
    # MLflow run with RAY_JOB_SUBMISSION_ID.
    # RAY_JOB_STOP_WAIT_TIME_S: after `ray job stop`'s SIGTERM the driver marks its MLflow run KILLED and
    # flushes; Ray's default 3 s before SIGKILL is short for a remote tracking server.
    same_machine = local is not None  # the local simulator shares this filesystem
    job_env = {
        "RAY_JOB_STOP_WAIT_TIME_S": "15",
        **forwarded_env(os.environ, env, same_machine=same_machine),
        "RAY_JOB_SUBMISSION_ID": submission_id,
    }
    if left := unforwarded_paths(os.environ, env, same_machine=same_machine):
        print(
            f"raytrn: not forwarded to the cluster: {', '.join(left)} (paths on this machine, which the cluster does "
            "not have); to forward one anyway: --env NAME=VALUE",
            file=sys.stderr,
        )
    job_id = client.submit_job(
        entrypoint=entrypoint(job_file, fixed, command, take_over=take_over),
        submission_id=submission_id,
        runtime_env=runtime_env(wd, job_env),
        metadata=job_metadata(job_file, run_name, wd),
    )
    what = "sweep" if command is not None else "run"
    print(f"raytrn: submitted {job_id} to {address} ({what} {run_name})", flush=True)
    if follow:
        follow_logs(client, job_id)
    else:
        print(f"  logs  raytrn jobs logs {job_id} --address {address}")
        print(f"  stop  raytrn jobs stop {job_id} --address {address}")
    return job_id


def job_file_in(job_path: str | os.PathLike[str], working_dir: Path) -> str:
    """The job file's path inside the uploaded working dir (as the cluster's driver sees it)."""
    try:
        return Path(job_path).resolve().relative_to(working_dir).as_posix()
    except ValueError:
        raise RaytrnError(
            f"{job_path}: the job file must be inside the uploaded working dir {working_dir} (run from the repository, "
            "or pass --working-dir)"
        ) from None


def frozen_overrides(raw: Any, job: Any, *, local: bool, address: str, base_dir: str | None = None) -> list[str]:
    """The ``--set`` values that make the submitted job the one checked here: the run name (the cluster's
    driver would otherwise stamp its own time into a new one) and, for the local simulator, relative local
    paths made absolute against ``base_dir`` (default: the cwd, as :func:`submit` resolves them). Relative
    paths for any other cluster are a RaytrnError (nothing is submitted). Which fields are paths:
    :data:`raytrn.config.PATH_FIELDS`."""
    relative = relative_local_paths(raw)
    if relative and not local:
        raise relative_paths_error(
            f"{raw.source}: the job would run on the cluster at {address}",
            relative,
            "(e.g. --set data.manifest=/fsx/data/stdlib), and an MLflow server for tracking.mlflow_uri; nothing was "
            "submitted",
        )
    # The simulator shares this filesystem.
    out = [f"{key}={value}" for key, value in absolute_overrides(raw, base_dir or os.getcwd()).items()]
    if raw.tracking.run_name is None:
        out.append(f"tracking.run_name={job.run_name}")
    return out


def _local_cluster(address: str) -> Any:
    """The running local simulator serving ``address``, or None (any other cluster)."""
    return running(address)


def follow_logs(client: Any, job_id: str) -> str:
    """Print the job's logs as they come until it ends; return its final status."""
    import asyncio

    async def _tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    try:
        asyncio.run(_tail())
    except KeyboardInterrupt:
        print(f"\nraytrn: stopped following; the job keeps running (raytrn jobs stop {job_id})", file=sys.stderr)
        raise
    status = str(client.get_job_status(job_id))
    print(f"raytrn: job {job_id} {status}", flush=True)
    return status


# --- command line --------------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    """Add ``submit`` and ``jobs list|logs|stop`` to the ``raytrn`` command line."""

    def _address(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--address",
            metavar="URL",
            help="the cluster's Ray dashboard, e.g. http://127.0.0.1:8265 (default: $RAY_API_SERVER_ADDRESS)",
        )
        p.add_argument("--token-file", metavar="PATH", help="Ray auth token file (default: Ray's own lookup)")

    p = subparsers.add_parser(
        "submit",
        help="run a training job on a Ray cluster (as a Ray job)",
        description="Validate JOB.yaml, upload the working dir (without .venv*, .git, data/, mlruns/, "
        "checkpoints/), forward MLFLOW_*/AWS_*/HF_TOKEN, and run `raytrn train` on the cluster as a Ray job; "
        "follows its logs unless --no-follow.",
    )
    p.add_argument("job", metavar="JOB.yaml")
    add_set_option(p)
    _address(p)
    p.add_argument("--working-dir", default=".", metavar="DIR", help="directory uploaded with the job (default .)")
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment variable for the job"
    )
    p.add_argument("--no-follow", action="store_true", help="print the job id and return")
    p.add_argument(
        "--take-over",
        action="store_true",
        help="the job replaces a stale lease on its run (`raytrn train --take-over`: the run's last driver stopped "
        "renewing it)",
    )
    p.set_defaults(func=_cmd_submit)

    p_jobs = subparsers.add_parser("jobs", help="list, follow or stop submitted jobs")
    jobs_sub = p_jobs.add_subparsers(dest="jobs_command", metavar="SUBCOMMAND")
    jobs_sub.required = True
    p_list = jobs_sub.add_parser("list", help="jobs on the cluster, newest last")
    _address(p_list)
    p_list.set_defaults(func=_cmd_jobs_list)
    p_logs = jobs_sub.add_parser("logs", help="print (or --follow) a job's logs")
    p_logs.add_argument("job_id", metavar="JOB_ID")
    p_logs.add_argument("--follow", "-f", action="store_true")
    _address(p_logs)
    p_logs.set_defaults(func=_cmd_jobs_logs)
    p_stop = jobs_sub.add_parser("stop", help="stop a running job")
    p_stop.add_argument("job_id", metavar="JOB_ID")
    _address(p_stop)
    p_stop.set_defaults(func=_cmd_jobs_stop)


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RaytrnError(f"--env {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _token_arg(args: argparse.Namespace) -> str | None:
    if not args.token_file:
        return None
    try:
        return Path(args.token_file).read_text().strip()
    except OSError as e:
        raise RaytrnError(f"--token-file {args.token_file}: {e}") from None


def _client(args: argparse.Namespace) -> tuple[Any, str]:
    """A job-submission client for ``--address`` (checked reachable, with the token), and that address."""
    address, basic = dashboard_address(args.address)
    headers = auth_headers(resolve_token(_token_arg(args), address=address)) or basic
    check_reachable(address, headers, outcome="nothing was done")
    return job_client(address, headers), address


def _on_job(address: str, job_id: str, call: Any) -> Any:
    """``call()`` on a job of the cluster; an id the cluster does not know is one clear RaytrnError."""
    try:
        return call()
    except JobRequestError as e:  # the dashboard's 404: "Job ... does not exist."
        if e.status_code != HTTPStatus.NOT_FOUND:
            raise
        raise RaytrnError(
            f"no job {job_id!r} on the cluster at {address}; `raytrn jobs list --address {address}` shows its jobs"
        ) from None


def _cmd_submit(args: argparse.Namespace) -> int:
    job_id = submit(
        args.job,
        address=args.address,
        overrides=args.overrides,
        follow=False,
        env=_parse_env(args.env),
        working_dir=args.working_dir,
        token=_token_arg(args),
        take_over=args.take_over,
    )
    if args.no_follow:
        return 0
    return 0 if follow_logs(_client(args)[0], job_id) == "SUCCEEDED" else 1


def _cmd_jobs_list(args: argparse.Namespace) -> int:
    client, _ = _client(args)
    jobs = sorted(client.list_jobs(), key=lambda j: j.start_time or 0)
    for j in jobs:
        meta = j.metadata or {}
        print(
            f"{j.submission_id or j.job_id:40} {str(j.status):10} {meta.get('user', '-'):12} {meta.get('raytrn.run_name', '-')}"
        )
    return 0


def _cmd_jobs_logs(args: argparse.Namespace) -> int:
    client, address = _client(args)
    logs = _on_job(address, args.job_id, lambda: client.get_job_logs(args.job_id))
    if args.follow:
        follow_logs(client, args.job_id)
    else:
        print(logs, end="")
    return 0


def _cmd_jobs_stop(args: argparse.Namespace) -> int:
    client, address = _client(args)
    stopped = _on_job(address, args.job_id, lambda: client.stop_job(args.job_id))
    print(f"raytrn: {args.job_id} {'stopping' if stopped else 'was not running'}")
    return 0


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
