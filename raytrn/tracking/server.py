"""``raytrn mlflow serve``: an MLflow tracking server for local use, and the command line it runs.

:func:`build_server_command` turns the options into the exact ``mlflow server`` command, its extra
environment and the basic-auth ini to write; it is pure (no files, no network) so the CLI, the test
fixture and the unit tests share one definition. The operator's script for a team server,
``mlflow/serve.sh``, does the same in bash for machines without raytrn (see ``mlflow/README.md``).
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from raytrn.cli_args import integer
from raytrn.config import resolve_mlflow_uri
from raytrn.errors import ConfigError
from raytrn.tracking.client import redact_uri

#: The store ``raytrn train`` writes by default (``raytrn.config.resolve_mlflow_uri``), relative to the cwd.
DEFAULT_BACKEND_STORE_URI = "sqlite:///mlruns/mlflow.db"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5000
#: Basic auth needs both: MLflow has no default admin password, and the secret key signs the UI's CSRF tokens.
AUTH_ENV_VARS = ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY")
MIN_PASSWORD_LEN = 12  # MLflow's password policy (mlflow.utils.validation)
_AUTH_ENV_EXAMPLES = {
    "MLFLOW_AUTH_ADMIN_PASSWORD": f"export MLFLOW_AUTH_ADMIN_PASSWORD='<at least {MIN_PASSWORD_LEN} characters>'",
    "MLFLOW_FLASK_SERVER_SECRET_KEY": "export MLFLOW_FLASK_SERVER_SECRET_KEY=\"$(python -c 'import secrets; "
    "print(secrets.token_hex(32))')\"",
}
#: SQLAlchemy dialects MLflow's tracking store supports (``dialect+driver://``), plus its file store.
BACKEND_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "file")
#: Where the server may proxy artifacts to (``--artifacts-destination``); a bare path is a local directory.
ARTIFACT_SCHEMES = ("s3", "gs", "wasbs", "hdfs", "file")
#: Postgres drivers SQLAlchemy picks for ``postgresql://`` (no ``+driver``): psycopg2 first.
_PG_DRIVERS = {"postgresql": "psycopg2", "postgresql+psycopg2": "psycopg2", "postgresql+psycopg": "psycopg"}
_STOP_TIMEOUT_S = 15.0
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(kw_only=True, frozen=True)
class ServerCommand:
    """What to run: ``argv`` with ``env`` added to the environment, after writing ``files``."""

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # absolute path -> content (the auth ini)
    url: str  # the tracking URI clients use
    backend_store_uri: str
    artifacts_destination: str

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` (usually ``os.environ``) with this server's variables added."""
        return {**base, **self.env}


def default_backend_store_uri(base_dir: str = ".") -> str:
    """``sqlite:///<abs base_dir>/mlruns/mlflow.db``: the same store ``raytrn train`` writes by default."""
    return resolve_mlflow_uri(DEFAULT_BACKEND_STORE_URI, base_dir)


def check_backend_store_uri(uri: str, base_dir: str = ".") -> str:
    """The URI with a relative sqlite path made absolute; ConfigError for a scheme MLflow cannot store runs in."""
    m = _SCHEME.match(uri)
    if not m:
        raise ConfigError(
            f"--backend-store-uri {redact_uri(uri)!r}: not a database URI. Use sqlite:///PATH/mlflow.db (local) or "
            "postgresql://USER@HOST:5432/mlflow (team server)"
        )
    dialect = m.group(1).lower().split("+", 1)[0]
    if dialect not in BACKEND_SCHEMES:
        hint = (
            " (that is a tracking server: clients use it as tracking.mlflow_uri)"
            if dialect in ("http", "https")
            else ""
        )
        raise ConfigError(
            f"--backend-store-uri {redact_uri(uri)!r}: unsupported scheme '{m.group(1)}'{hint}. "
            f"Use one of {', '.join(s + '://' for s in BACKEND_SCHEMES)}, e.g. sqlite:///PATH/mlflow.db"
        )
    if dialect == "sqlite" and not uri.startswith("sqlite:///"):
        raise ConfigError(f"--backend-store-uri {redact_uri(uri)!r}: a sqlite URI is sqlite:///PATH (three slashes)")
    return resolve_mlflow_uri(uri, base_dir) if dialect == "sqlite" else uri


def check_artifacts_destination(dest: str, base_dir: str = ".") -> str:
    """An absolute local path or a URI of a supported store; ConfigError otherwise."""
    m = _SCHEME.match(dest)
    if not m or len(m.group(1)) == 1:  # no scheme (or a Windows drive letter): a local directory
        return os.path.abspath(os.path.join(base_dir, os.path.expanduser(dest)))
    scheme = m.group(1).lower()
    if scheme not in ARTIFACT_SCHEMES:
        raise ConfigError(
            f"--artifacts-destination {dest!r}: unsupported scheme '{scheme}'. Use s3://BUCKET/PREFIX "
            "(artifacts proxied by the server: clients need no S3 credentials) or a local directory"
        )
    if scheme == "s3" and not urlparse(dest).netloc:
        raise ConfigError(f"--artifacts-destination {dest!r}: no bucket. Use s3://BUCKET/PREFIX")
    return dest


def client_url(host: str, port: int) -> str:
    """The tracking URI to give clients: a wildcard bind address is replaced by this host's name."""
    host = host.strip()
    if is_wildcard_host(host):
        host = socket.gethostname()
    host = host.removeprefix("[").removesuffix("]")
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"


#: What the C library reads as an IPv4 address besides dotted quads (``inet_aton``: ``0``, ``0x0``, ``0.0``,
#: ``0177.1``), and a server bound to such a host listens on it.
_INET_ATON = re.compile(r"[0-9a-fA-FxX.]+")


def listen_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address a server told to listen on ``host`` binds, in any spelling the socket layer takes
    (``[::]``, ``0:0:0:0:0:0:0:0``, ``0``, ``0x0``, an IPv6 zone), an IPv4-mapped IPv6 address as its IPv4
    (``::ffff:0.0.0.0`` is 0.0.0.0); None for a host name."""
    text = host.strip().removeprefix("[").removesuffix("]").partition("%")[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        if not _INET_ATON.fullmatch(text):
            return None
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_wildcard_host(host: str) -> bool:
    """Whether listening on ``host`` means every interface: 0.0.0.0 or ``::`` however spelled (``::ffff:0.0.0.0``,
    ``[::]``, ``0``, ``0x0``...), or empty."""
    ip = listen_address(host)
    return not host.strip() or (ip is not None and ip.is_unspecified)


def is_private_host(host: str) -> bool:
    """Whether listening on ``host`` stays off the internet: this machine (127.0.0.0/8, ::1, localhost) or one
    of its private-network addresses (10/8, 172.16/12, 192.168/16, fc00::/7: a VPC, whose security group then
    decides), however spelled (:func:`listen_address`). Not a wildcard (:func:`is_wildcard_host`: every
    interface), a public address or a host name."""
    if host.strip() == "localhost":
        return True
    ip = listen_address(host)
    return ip is not None and not ip.is_unspecified and (ip.is_loopback or ip.is_private)


def render_auth_ini(database_uri: str, default_permission: str = "READ") -> str:
    """The basic-auth config (read via MLFLOW_AUTH_CONFIG_PATH): users database and default permission.

    ``admin_password`` is left out on purpose: it comes from MLFLOW_AUTH_ADMIN_PASSWORD, never a file.
    """
    return (
        "[mlflow]\n"
        f"default_permission = {default_permission}\n"
        f"database_uri = {database_uri}\n"
        "admin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )


def check_auth_env(environ: Mapping[str, str]) -> None:
    """ConfigError naming every missing basic-auth variable (and a too-short admin password)."""
    missing = [v for v in AUTH_ENV_VARS if not environ.get(v)]
    if missing:
        raise ConfigError(
            f"--auth: {' and '.join(missing)} not set. Basic auth needs the admin user's password (MLflow has no "
            "default) and a secret key for the UI's sessions, e.g. " + "; ".join(_AUTH_ENV_EXAMPLES[v] for v in missing)
        )
    if len(environ["MLFLOW_AUTH_ADMIN_PASSWORD"]) < MIN_PASSWORD_LEN:
        raise ConfigError(
            f"--auth: MLFLOW_AUTH_ADMIN_PASSWORD is shorter than {MIN_PASSWORD_LEN} characters "
            "(MLflow's password policy). Set a longer one"
        )


def build_server_command(
    *,
    backend_store_uri: str | None = None,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    artifacts_destination: str | None = None,
    workers: int = 1,
    auth: bool = False,
    data_dir: str | None = None,
    environ: Mapping[str, str] | None = None,
    mlflow_argv: list[str] | None = None,
    base_dir: str = ".",
    insecure: bool = False,
) -> ServerCommand:
    """The ``mlflow server`` command for these options (pure: writes nothing, starts nothing).

    - ``backend_store_uri``: default ``sqlite:///<base_dir>/mlruns/mlflow.db`` (``raytrn train``'s store).
    - ``artifacts_destination``: where the server proxies artifacts to (clients upload through it and need
      no store credentials); default ``<sqlite dir>/artifacts``, next to the database like ``raytrn train``.
    - ``auth``: basic auth; needs :data:`AUTH_ENV_VARS` in ``environ``. The users database and the ini
      (``files``) go to ``data_dir`` (default: the sqlite database's directory, else ``<base_dir>/mlruns``).
    - ``mlflow_argv``: how to call MLflow's CLI; default this interpreter's ``python -m mlflow``.
    - ``host`` beyond loopback and private addresses (a wildcard, a public address) needs ``auth`` (or
      ``insecure``). A backend URI with a password is
      passed in the server's environment, not its command line (which every user of the machine can list).
    """
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port}: not a TCP port (1-65535)")
    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be at least 1")
    backend = check_backend_store_uri(backend_store_uri or DEFAULT_BACKEND_STORE_URI, base_dir)
    sqlite_dir = os.path.dirname(backend[len("sqlite:///") :]) if backend.startswith("sqlite:///") else None
    if artifacts_destination:
        artifacts = check_artifacts_destination(artifacts_destination, base_dir)
    else:
        artifacts = os.path.join(sqlite_dir or os.path.abspath(os.path.join(base_dir, "mlruns")), "artifacts")
    if not (auth or insecure or is_private_host(host)):
        raise ConfigError(
            f"--host {host} without --auth: the server would be reachable beyond this machine and its private "
            f"network, and anyone who can reach port {port} could read, change and delete every run and model. "
            "Add --auth (basic auth), or listen on 127.0.0.1 (the default; an SSH tunnel) or a private address; "
            "--insecure serves it open anyway"
        )
    argv = [*(mlflow_argv or [sys.executable, "-m", "mlflow"]), "server"]
    # The job-execution worker (MLflow 3.x) roughly doubles the server's memory; raytrn does not use it.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    if redact_uri(backend) != backend:  # a database password: through the environment, never on `ps`'s list
        env["MLFLOW_BACKEND_STORE_URI"] = backend
    else:
        argv += ["--backend-store-uri", backend]
    argv += ["--artifacts-destination", artifacts]
    argv += ["--host", host, "--port", str(port), "--workers", str(workers)]
    files: dict[str, str] = {}
    if auth:
        check_auth_env(environ if environ is not None else {})
        auth_dir = os.path.abspath(data_dir or sqlite_dir or os.path.join(base_dir, "mlruns"))
        ini = os.path.join(auth_dir, "basic_auth.ini")
        files[ini] = render_auth_ini("sqlite:///" + os.path.join(auth_dir, "basic_auth.db"))
        env["MLFLOW_AUTH_CONFIG_PATH"] = ini
        argv += ["--app-name", "basic-auth"]
    return ServerCommand(
        argv=argv,
        env=env,
        files=files,
        url=client_url(host, port),
        backend_store_uri=backend,
        artifacts_destination=artifacts,
    )


def check_port_free(host: str, port: int) -> None:
    """ConfigError when something already listens on ``host:port`` (checked before starting the server)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"--port {port}: {host}:{port} is already in use (another MLflow server?). "
                    f"Pick a free port with --port, or use the running server: {client_url(host, port)}"
                ) from None
            raise ConfigError(f"--host {host}: cannot listen on {host}:{port}: {e.strerror}") from None


def check_backend_driver(uri: str) -> None:
    """ConfigError when the database driver a PostgreSQL URI needs is not installed."""
    scheme = uri.split(":", 1)[0].lower()
    module = _PG_DRIVERS.get(scheme)
    if module and importlib.util.find_spec(module) is None:
        package = "psycopg2-binary" if module == "psycopg2" else "'psycopg[binary]'"
        raise ConfigError(
            f"--backend-store-uri {scheme}://...: the driver {module} is not installed: pip install {package}"
        )


def prepare(cmd: ServerCommand) -> None:
    """Create what the server expects to exist: the sqlite and local artifact directories, the auth ini."""
    if cmd.backend_store_uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(cmd.backend_store_uri[len("sqlite:///") :]), exist_ok=True)
    if not _SCHEME.match(cmd.artifacts_destination):
        os.makedirs(cmd.artifacts_destination, exist_ok=True)
    for path, text in cmd.files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Path(path).write_text(text)


def start(cmd: ServerCommand, **popen_kwargs: Any) -> subprocess.Popen:
    """Start the server in its own process group (so :func:`stop` reaches uvicorn's workers too)."""
    prepare(cmd)
    return subprocess.Popen(cmd.argv, env=cmd.environ(os.environ), start_new_session=True, **popen_kwargs)


def stop(proc: subprocess.Popen, timeout_s: float = _STOP_TIMEOUT_S) -> None:
    """SIGTERM the server's process group (its PID), wait (bounded), then SIGKILL what is left.

    Nothing when the server was already reaped (stopped before, or waited for): its PID, the group's id, may be
    another process's by now. (While any member of the group lives, the kernel does not reuse the id.)"""
    if proc.returncode is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)  # any member of the group left (workers outlive a dead master)?
            except ProcessLookupError:
                if proc.returncode is not None:
                    return
            time.sleep(0.1)
    proc.wait(timeout=timeout_s)


def serve(cmd: ServerCommand) -> int:
    """Run the server in the foreground until it exits or Ctrl-C; returns its exit code (130 on Ctrl-C)."""

    def _terminate(signum: int, frame: Any) -> None:  # `kill PID` stops the server like Ctrl-C does
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _terminate)
    proc = start(cmd)
    print(
        f"raytrn: MLflow server (pid {proc.pid}) starting on {cmd.url}\n"
        f"  store      {redact_uri(cmd.backend_store_uri)}\n"
        f"  artifacts  {cmd.artifacts_destination} (proxied: clients need no storage credentials)\n"
        f"  jobs:      tracking.mlflow_uri: {cmd.url}   (or export MLFLOW_TRACKING_URI={cmd.url})\n"
        "  stop:      Ctrl-C",
        flush=True,
    )
    try:
        return proc.wait()
    except KeyboardInterrupt:
        print("raytrn: stopping the MLflow server", file=sys.stderr, flush=True)
        stop(proc)
        return 130
    finally:
        if proc.returncode is None:  # any other exception: never leave the server behind
            stop(proc)
        signal.signal(signal.SIGTERM, previous)


def register(subparsers: Any) -> None:
    """Add ``mlflow serve`` to the ``raytrn`` command line."""
    p_mlflow = subparsers.add_parser("mlflow", help="MLflow tracking server")
    mlflow_sub = p_mlflow.add_subparsers(dest="mlflow_command", metavar="SUBCOMMAND")
    mlflow_sub.required = True
    p = mlflow_sub.add_parser(
        "serve",
        help="run an MLflow tracking server in the foreground (local use; team servers: mlflow/serve.sh)",
        description="Run this venv's `mlflow server` in the foreground until Ctrl-C, on the store `raytrn train` "
        "writes by default, and print the URI to put in tracking.mlflow_uri. Artifacts are proxied by the server "
        "(clients need no S3 credentials). A port in use, a bad URI or missing auth variables exit 2 before "
        "anything starts.",
    )
    p.add_argument(
        "--backend-store-uri",
        metavar="URI",
        help="runs database (default sqlite:///<cwd>/mlruns/mlflow.db, the store of `raytrn train`; "
        "postgresql://USER@HOST/DB for a team server)",
    )
    p.add_argument(
        "--artifacts-destination",
        metavar="URI|DIR",
        help="where artifacts go, e.g. s3://BUCKET/mlflow (default: artifacts/ next to the sqlite database)",
    )
    p.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST}: this machine only)"
    )
    p.add_argument("--port", type=integer, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--workers", type=integer, default=1, metavar="N", help="server worker processes (default 1)")
    p.add_argument(
        "--auth",
        action="store_true",
        help="basic auth (needs MLFLOW_AUTH_ADMIN_PASSWORD and MLFLOW_FLASK_SERVER_SECRET_KEY in the environment; "
        "clients set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD)",
    )
    p.add_argument(
        "--data-dir", metavar="DIR", help="where the auth ini and users database go (default: the sqlite dir)"
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a --host other than loopback without --auth (anyone who reaches the port can change every run)",
    )
    p.set_defaults(func=_cmd_mlflow_serve)


def _cmd_mlflow_serve(args: argparse.Namespace) -> int:
    cmd = build_server_command(
        backend_store_uri=args.backend_store_uri,
        host=args.host,
        port=args.port,
        artifacts_destination=args.artifacts_destination,
        workers=args.workers,
        auth=args.auth,
        data_dir=args.data_dir,
        environ=os.environ,
        insecure=args.insecure,
    )
    check_backend_driver(cmd.backend_store_uri)
    if args.auth and importlib.util.find_spec("flask_wtf") is None:
        raise ConfigError("--auth: MLflow's basic auth needs Flask-WTF: pip install 'mlflow[auth]'")
    check_port_free(args.host, args.port)
    return serve(cmd)
