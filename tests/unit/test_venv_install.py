"""tools/venv_install.py: pip's settings carried over to uv (read from a real `pip config list`), and a real uv
install into a new venv from a wheel directory that only pip's settings name."""

from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from tools import venv_install

pytestmark = pytest.mark.unit


def _only_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip reads no configuration file (PIP_CONFIG_FILE=/dev/null: not the machine's either), only what the test sets."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in [name for name in os.environ if name.startswith(("PIP_", "UV_")) and name != "PIP_CONFIG_FILE"]:
        monkeypatch.delenv(name)


def test_pips_settings_environment_over_install_over_global():
    # Lines as `pip config list` prints a config file's multi-line value, an empty variable and the sections.
    listing = (
        ":env:.cert='/env.pem'\n"
        ":env:.find-links=''\n"
        "global.cert='/global.pem'\n"
        "global.extra-index-url='\\nfile:///a\\nfile:///b'\n"
        "global.find-links='/global'\n"
        "install.find-links='/install'\n"
        "install.pre='yes'\n"
    )
    settings = venv_install.settings_from_listing(listing)
    assert settings == {
        "cert": "/env.pem",
        "extra-index-url": "\nfile:///a\nfile:///b",
        "find-links": "/install",  # the empty variable is no setting: the files' one stands
        "pre": "yes",
    }
    assert venv_install.uv_arguments(settings)[0] == [
        "--extra-index-url", "file:///a", "--extra-index-url", "file:///b", "--find-links", "/install",
        "--prerelease", "allow", "--index-strategy", "unsafe-best-match",
    ]  # fmt: skip


def test_pips_own_listing_is_read(monkeypatch):
    _only_environment(monkeypatch)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///a file:///b")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "180")
    settings = venv_install.pip_settings(venv_install.sys.executable)
    # --default-timeout is --timeout under its other name
    assert settings == {"config-file": os.devnull, "extra-index-url": "file:///a file:///b", "timeout": "180"}


def test_uv_gets_pips_indexes_wheel_directories_constraints_and_rule_for_several_indexes():
    args, env = venv_install.uv_arguments(
        {
            "index-url": "https://mirror.example/simple",
            "extra-index-url": "file:///a file:///b",
            "find-links": "/wheels",
            "trusted-host": "mirror.example",
            "constraint": "/etc/c.txt",
            "only-binary": ":all:",
            "pre": "t",
            "require-hashes": "off",
            "cert": "/ca.pem",
            "client-cert": "/client.pem",
            "timeout": "15.5",
            "retries": "3",
            "proxy": "http://proxy:3128",
            "disable-pip-version-check": "1",
        }
    )
    assert args == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///a",
        "--extra-index-url", "file:///b",
        "--find-links", "/wheels",
        "--allow-insecure-host", "mirror.example",
        "--constraints", "/etc/c.txt",
        "--only-binary", ":all:",
        "--prerelease", "allow",
        "--index-strategy", "unsafe-best-match",
    ]  # fmt: skip
    assert env == {
        "SSL_CERT_FILE": "/ca.pem",
        "SSL_CLIENT_CERT": "/client.pem",
        "UV_HTTP_TIMEOUT": "16",  # uv takes whole seconds only
        "UV_HTTP_RETRIES": "3",
        "HTTP_PROXY": "http://proxy:3128",
        "HTTPS_PROXY": "http://proxy:3128",
    }
    assert venv_install.uv_arguments({}) == ([], {})
    assert venv_install.uv_arguments({"no-index": "Y"}) == (["--no-index"], {})
    for bad in ("soon", "inf"):
        with pytest.raises(venv_install.UvCannot, match="timeout"):
            venv_install.uv_arguments({"timeout": bad})


def test_uv_reads_none_of_its_own_variables_but_its_cache():
    machine = {"PATH": "/bin", "UV_TORCH_BACKEND": "cu128", "UV_INDEX": "https://x", "UV_CACHE_DIR": "/c", "UV": "1"}
    assert venv_install.uv_environment(machine) == {"PATH": "/bin", "UV_CACHE_DIR": "/c", "UV": "1"}


@pytest.mark.parametrize("settings", [{"upgrade-strategy": "eager"}, {"no-index": "maybe"}])
def test_a_setting_uv_cannot_take_means_pip_installs(settings, tmp_path, monkeypatch, capsys):
    with pytest.raises(venv_install.UvCannot, match=next(iter(settings))):
        venv_install.uv_arguments(settings)
    # main() says so and goes to pip: here a venv without pip, so pip's failure is the exit status.
    _only_environment(monkeypatch)
    monkeypatch.setenv("PIP_" + next(iter(settings)).upper().replace("-", "_"), next(iter(settings.values())))
    monkeypatch.setattr(venv_install, "UV", Path(venv_install.sys.executable))  # "uv exists"; it must not run
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 3\n")
    python.chmod(0o755)
    assert venv_install.main([str(python), "anything"]) == 3
    assert f"{next(iter(settings))}" in capsys.readouterr().err


def _wheel(directory: Path, name: str, version: str) -> None:
    """A minimal pure-Python wheel: one module that knows its version."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


@pytest.mark.skipif(not venv_install.UV.exists(), reason="no uv in .uv/ (make uv): the installs use pip")
def test_uv_installs_from_the_wheel_directory_only_pips_settings_name(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "raytrn_probe", "1.0")
    _wheel(wheels, "raytrn_probe", "2.0")
    _only_environment(monkeypatch)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    venv = tmp_path / "venv"
    subprocess.run([str(venv_install.UV), "venv", "-q", str(venv)], check=True, timeout=60)
    python = str(venv / "bin" / "python")
    assert venv_install.main([python, "raytrn_probe<2"]) == 0
    out = subprocess.run([python, "-c", "import raytrn_probe; print(raytrn_probe.VERSION)"], capture_output=True)
    assert out.stdout.decode().strip() == "1.0"
    # Without pip's settings uv would find no package of that name: the wheel directory came from them.
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    assert venv_install.main([python, "raytrn_probe==2.0"]) != 0


def _make_uv(directory: Path, pin: str) -> subprocess.CompletedProcess[str]:
    makefile = Path(__file__).resolve().parents[2] / "Makefile"
    python = f"PYTHON={directory / 'python'}"
    command = ["make", "-s", "-f", str(makefile), "uv", f"UV_PIN={pin}", python]
    env = {name: value for name, value in os.environ.items() if name not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=60, env=env)


def test_make_uv_tries_each_pin_once(tmp_path):
    """`make uv` with a stand-in for pip's download: it succeeds for one pin and fails for another."""
    calls = tmp_path / "calls"
    (tmp_path / "python").write_text(
        f'#!/bin/sh\ncase "$*" in *"pip install"*) echo "$*" >> {calls};; *) exit 0;; esac\n'
        'case "$*" in *fail*) exit 1;; esac\nmkdir -p .uv/bin && echo "$*" > .uv/bin/uv\n'
    )
    (tmp_path / "python").chmod(0o755)
    uv = tmp_path / ".uv" / "bin" / "uv"
    assert _make_uv(tmp_path, "uv==1.0").returncode == 0
    assert uv.read_text().endswith("--target .uv uv==1.0\n")
    assert _make_uv(tmp_path, "uv==1.0").returncode == 0
    assert len(calls.read_text().splitlines()) == 1  # installed: not fetched again
    failed = _make_uv(tmp_path, "uv==fail")
    assert failed.returncode == 0 and "uv could not be installed" in failed.stderr
    assert not uv.exists()  # the old pin's uv is gone: the installs use pip, as the message says
    again = _make_uv(tmp_path, "uv==fail")
    assert again.returncode == 0 and again.stderr == ""
    assert len(calls.read_text().splitlines()) == 2  # the failed download is not retried at every make
    assert _make_uv(tmp_path, "uv==1.0").returncode == 0 and uv.exists()
    assert _make_uv(tmp_path, "uv >=1.0, <2").returncode == 0  # a range is a pin too
    assert uv.read_text().endswith("--target .uv uv >=1.0, <2\n")
