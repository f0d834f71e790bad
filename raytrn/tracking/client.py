"""The one place raytrn builds MLflow clients: which tracking URI, how it is shown, how requests fail.

Every module that talks to MLflow (the job's tracking actor and its run, rank 0's model upload, the sweep
driver, ``raytrn runs compare``, the fine-tuning demo) asks :func:`mlflow_client` for its client, so a change
to how raytrn reaches MLflow (credentials, retries, a store's set-up) is one edit here. Alongside:

- :func:`unreachable`: a quick check that an http(s) server answers (MLflow's own client retries for minutes);
- :func:`redact_uri` / :func:`redact`: what raytrn prints or logs of a URI or a setting (passwords masked,
  secret-looking keys redacted);
- credentials come from MLflow's own variables (``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``/``_TOKEN``), which
  the tracking actor and a submitted job receive with the driver's environment
  (:func:`raytrn.runtime.forwarded_env`); raytrn never writes them anywhere.
"""

from __future__ import annotations

import base64
import os
import re
import socket
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from raytrn.config import JobSpec
from raytrn.errors import ConfigError
from raytrn.uris import redact_uri, split_credentials

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

REDACTED = "***redacted***"
#: Per-request limits for a client that must not block (the tracking actor retries on its own, with backoff).
FAIL_FAST_TIMEOUT_S = 10


def tracking_uri(target: str | JobSpec) -> str:
    """The tracking URI of ``target``: a URI as it is, or a job's ``tracking.mlflow_uri`` (resolved by
    :func:`raytrn.config.resolve_paths`; a ConfigError when it is not)."""
    if isinstance(target, str):
        return target
    uri = target.tracking.mlflow_uri
    if not uri:
        raise ConfigError(f"{target.source}: tracking.mlflow_uri is not resolved (load the job with resolve=True)")
    return uri


def mlflow_client(target: str | JobSpec, *, fail_fast: bool = False, create_store: bool = False) -> MlflowClient:
    """An ``MlflowClient`` for ``target`` (a tracking URI or a job).

    ``fail_fast``: each REST call to an http(s) server fails after one try within
    :data:`FAIL_FAST_TIMEOUT_S` instead of MLflow's ~2 minutes of in-request retries (this process; values
    the user set win). For a caller that retries on its own and must never block: the tracking actor.
    ``create_store``: make the directory of a local ``sqlite:///`` store (the run's writer; readers must not
    create an empty database).
    """
    # mlflow lazily: importing it costs ~1 s, off the driver's path to the first step (only the tracking
    # actor, rank 0's upload and the reading commands need a client).
    from mlflow.tracking import MlflowClient

    uri = use_credentials(tracking_uri(target))
    # MLflow prints "View run ... / View experiment ..." to stdout as a run on a server ends, from whichever process
    # ends it (the tracking actor: into a Ray job's log); raytrn's summary gives the link once (the user's value wins)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if fail_fast and is_http(uri):
        quiet_http_retries()
    if create_store and (db := sqlite_path(uri)):
        os.makedirs(os.path.dirname(db) or ".", exist_ok=True)
    return MlflowClient(uri)


def use_credentials(uri: str) -> str:
    """The URI MLflow's client is given: credentials written into an http(s) URI move to MLflow's own variables
    (``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD``, this process), where its client sends them as basic auth and
    no log line, error or file ever shows them (MLflow would otherwise fail on the URI)."""
    if not is_http(uri):  # a database's URI keeps its credentials: they are its driver's
        return uri
    clean, user, password = split_credentials(uri)
    if user:
        os.environ["MLFLOW_TRACKING_USERNAME"] = user
    if password is not None:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password
    return clean


def auth_header(uri: str) -> dict[str, str]:
    """The Authorization header a request to ``uri``'s server carries: the URI's credentials, else MLflow's
    variables (basic auth, or a bearer token)."""
    _, user, password = split_credentials(uri)
    user = user or os.environ.get("MLFLOW_TRACKING_USERNAME")
    password = password if password is not None else os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password is not None:
        return basic_auth(user, password)
    if token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
        return {"Authorization": f"Bearer {token}"}
    return {}


def basic_auth(user: str, password: str) -> dict[str, str]:
    """The Authorization header of HTTP basic auth."""
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def quiet_http_retries(timeout_s: int = FAIL_FAST_TIMEOUT_S) -> None:
    """Make each MLflow REST call fail fast (this process): the caller retries on its own, without blocking
    for MLflow's default ~2 minutes of in-request retries. Values the user set win."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))


def is_http(uri: str) -> bool:
    return uri.lower().startswith(("http://", "https://"))


def sqlite_path(uri: str) -> str | None:
    """The database file of a ``sqlite:///PATH`` tracking URI (None for other stores)."""
    return uri[len("sqlite:///") :] if uri.startswith("sqlite:///") else None


def unreachable(uri: str, timeout_s: float = 3.0) -> str | None:
    """Why an http(s) tracking server cannot be reached (None when it answers, or for local stores).

    A TCP connect and GET /health: quick, unlike MLflow's client, which retries for minutes.
    """
    if not is_http(uri):
        return None
    clean = split_credentials(uri)[0]
    try:
        parts = urlsplit(clean)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:  # a port that is not a number
        return f"{redact_uri(uri)} is not a usable URL ({e})"
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return f"cannot connect to {host}:{port} ({e.strerror or e})"
    request = urllib.request.Request(clean.rstrip("/") + "/health", headers=auth_header(uri))
    try:
        urllib.request.urlopen(request, timeout=timeout_s).close()
    except urllib.error.HTTPError as e:
        if e.code >= 500:
            return f"the server answered /health with HTTP {e.code}"
    except OSError as e:
        return f"no answer from {redact_uri(uri)} ({e})"
    return None


# -- secrets ----------------------------------------------------------------------------------------

_SECRET_WORDS = frozenset({"secret", "password", "passwd", "pwd", "credential", "credentials", "apikey"})
_SECRET_PARTS = ("secret", "password", "api_key", "apikey", "access_key", "private_key", "auth_token")


def is_secret_key(key: str) -> bool:
    """Whether a param/tag/env name looks like it holds a secret (``tracking.hf_token``, ``DB_PASSWORD``...).

    Words are split on ``_ - .``; ``tokenizer``, ``tokens_per_s`` or ``flops_per_token`` are not secrets.
    """
    name = key.lower()
    words = re.split(r"[_\-.\s]+", name)
    # "token" names a credential as a name's last word (HF_TOKEN, auth.token), not in "flops_per_token".
    token = words[-1] == "token" and (len(words) < 2 or words[-2] != "per")
    return token or bool(set(words) & _SECRET_WORDS) or any(part in name for part in _SECRET_PARTS)


def redact(key: str, value: Any) -> str:
    """The text to log for ``key``: redacted when the key looks secret, passwords in URIs masked."""
    if is_secret_key(key):
        return REDACTED
    return redact_uri(str(value))
