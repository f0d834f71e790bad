"""Every spelling of "all interfaces" is a wildcard, not a private address (`raytrn mlflow serve --host`, the
dashboard check of `raytrn cluster validate`), and that check reads whether `ray start` really gets
RAY_AUTH_MODE=token from its command, not whether the text appears somewhere."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from raytrn.cli import main
from raytrn.cluster.validate import validate_cluster_config
from raytrn.errors import ConfigError
from raytrn.tracking.server import build_server_command, is_private_host, is_wildcard_host

REPO = Path(__file__).resolve().parents[2]
TRN1 = REPO / "cluster" / "aws-trn1.yaml"

WILDCARDS = ["::ffff:0.0.0.0", "::ffff:0:0", "[::ffff:0.0.0.0]", "::", "[::]", "0:0:0:0:0:0:0:0", "::0.0.0.0",
             "0.0.0.0", "0", "0x0", "0.0", "000.000.000.000", " 0.0.0.0 ", ""]  # fmt: skip


@pytest.mark.parametrize("host", WILDCARDS)
def test_every_spelling_of_all_interfaces_is_a_wildcard(host: str) -> None:
    assert is_wildcard_host(host) and not is_private_host(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost", "10.0.1.5", "::ffff:10.0.1.5",
                                  "::ffff:127.0.0.1", "192.168.0.2", "fd00::5"])  # fmt: skip
def test_loopback_and_private_addresses_stay_private(host: str) -> None:
    assert is_private_host(host) and not is_wildcard_host(host)


@pytest.mark.parametrize("host", ["::ffff:8.8.8.8", "54.12.0.7", "mlflow.example.com"])
def test_public_addresses_and_names_are_neither(host: str) -> None:
    assert not is_private_host(host) and not is_wildcard_host(host)


@pytest.mark.parametrize("host", [h for h in WILDCARDS if h.strip()])
def test_mlflow_serve_refuses_a_wildcard_without_auth(host: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"without --auth: the server would be reachable beyond this machine"):
        build_server_command(host=host)
    assert main(["mlflow", "serve", "--host", host, "--port", "1"]) == 2
    assert "without --auth" in capsys.readouterr().err
    # with --insecure, clients are given this machine's name, not the wildcard
    assert build_server_command(host=host, insecure=True).url == f"http://{socket.gethostname()}:5000"


def _trn1(head: list[str]) -> dict[str, Any]:
    config = yaml.safe_load(TRN1.read_text())
    config["head_start_ray_commands"] = head
    return config


def _problems(config: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        validate_cluster_config(config, source="c.yaml")
    return str(e.value)


START = "ray start --head --port=6379 --dashboard-host={host}"


@pytest.mark.parametrize("host", ["::ffff:0.0.0.0", "'[::]'", "0", "0x0", '"::ffff:0:0"'])
def test_cluster_validate_refuses_a_wildcard_dashboard_without_auth(host: str) -> None:
    msg = _problems(_trn1(["ray stop", START.format(host=host)]))
    assert "head_start_ray_commands: the dashboard listens on" in msg and "token authentication off" in msg
    notes = validate_cluster_config(_trn1(["ray stop", "RAY_AUTH_MODE=token " + START.format(host=host)]))
    assert any("(all interfaces)" in n for n in notes)


@pytest.mark.parametrize(
    "head",
    [
        ["echo RAY_AUTH_MODE=token", START],
        ["echo RAY_AUTH_MODE=token; " + START],
        ["echo 'export RAY_AUTH_MODE=token' >> ~/.bashrc && " + START],
        ["RAY_AUTH_MODE=token echo hi; " + START],  # the assignment is echo's, not ray's
        ["RAY_AUTH_MODE=token; " + START],  # a shell variable, never exported
        ["export RAY_AUTH_MODE=token; unset RAY_AUTH_MODE; " + START],
        ["RAY_AUTH_MODE=disabled " + START + "  # RAY_AUTH_MODE=token"],
        [START + " --labels=RAY_AUTH_MODE=token"],
        ["export RAY_AUTH_MODE=token", START],  # each command of the list runs in its own shell
        ["bash -c 'echo RAY_AUTH_MODE=token; " + START + "'"],
        ["eval 'RAY_AUTH_MODE=token " + START + "'"],  # not followed: auth unseen
    ],
)
def test_the_text_RAY_AUTH_MODE_token_is_not_token_auth(head: list[str]) -> None:  # noqa: N802
    msg = _problems(_trn1([cmd.format(host="0.0.0.0") for cmd in head]))
    assert "the dashboard listens on 0.0.0.0" in msg and "token authentication off" in msg


@pytest.mark.parametrize(
    "head",
    [
        ["ulimit -n 65536; RAY_AUTH_MODE=token " + START],
        ["export RAY_AUTH_MODE=token; " + START],
        ["export RAY_AUTH_MODE=token && ulimit -n 65536 && " + START],
        ['RAY_AUTH_MODE="token" ' + START],
        ["env RAY_AUTH_MODE=token " + START],
        ["RAY_AUTH_MODE=token; export RAY_AUTH_MODE\n" + START],
        ["export RAY_AUTH_MODE=token\nulimit -n 65536\n" + START.replace("--dashboard-host=", "--dashboard-host ")],
        ["RAY_AUTH_MODE=token ~/venv/bin/ray start --head --dashboard-host {host}"],
        ["export RAY_AUTH_MODE=token; bash -c '" + START + "'"],
        ["RAY_AUTH_MODE=token bash -lc 'exec " + START + "'"],
    ],
)
def test_a_real_RAY_AUTH_MODE_token_for_ray_start_is_token_auth(head: list[str]) -> None:  # noqa: N802
    notes = validate_cluster_config(_trn1([cmd.format(host="0.0.0.0") for cmd in head]))
    assert any("the dashboard listens on 0.0.0.0 (all interfaces)" in n for n in notes), notes
    assert not any("token authentication is off" in n for n in notes)


def test_other_verdicts_stay() -> None:
    """Auth off with the dashboard on loopback: a note; no `ray start` at all: nothing said; an unreadable command
    (an unclosed quote, which the shell refuses too): one problem naming it."""
    notes = validate_cluster_config(_trn1([START.format(host="127.0.0.1")]))
    assert "head_start_ray_commands: Ray token authentication is off (no RAY_AUTH_MODE=token)" in notes
    notes = validate_cluster_config(_trn1(["echo ray start is elsewhere"]))
    assert not any(n.startswith("head_start_ray_commands") for n in notes)
    msg = _problems(_trn1(["ray stop", "RAY_AUTH_MODE=token ray start --head --dashboard-host='0.0.0.0"]))
    assert re.search(r"head_start_ray_commands\[1\]: .*quot", msg), msg
