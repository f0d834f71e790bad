"""tools/venv_install.py: pip's settings carried over to uv (read from a real `pip config list`), and a real uv
install into a new venv from a wheel directory that only pip's settings name."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from tools import venv_install

pytestmark = pytest.mark.unit


def _pip_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    config = tmp_path / "pip.conf"
    config.write_text(text)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))  # replaces the machine's own pip.conf
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CERT", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)


def test_pips_settings_environment_over_install_over_global(tmp_path, monkeypatch):
    _pip_config(
        tmp_path,
        monkeypatch,
        "[global]\nextra-index-url =\n    file:///a\n    file:///b\nfind-links = /global\ncert = /global.pem\n"
        "[install]\nfind-links = /install\n",
    )
    monkeypatch.setenv("PIP_CERT", "/env.pem")
    monkeypatch.setenv("PIP_FIND_LINKS", "")  # empty: pip skips it, and the files' setting stands
    settings = venv_install.pip_settings(venv_install.sys.executable)
    assert settings["extra-index-url"].split() == ["file:///a", "file:///b"]
    assert settings["find-links"] == "/install"
    assert settings["cert"] == "/env.pem"


def test_uv_gets_pips_indexes_wheel_directories_and_rule_for_several_indexes():
    args, env = venv_install.uv_arguments(
        {
            "index-url": "https://mirror.example/simple",
            "extra-index-url": "file:///a file:///b",
            "find-links": "/wheels",
            "trusted-host": "mirror.example",
            "cert": "/ca.pem",
        }
    )
    assert args == [
        "--index-url",
        "https://mirror.example/simple",
        "--find-links",
        "/wheels",
        "--extra-index-url",
        "file:///a",
        "--extra-index-url",
        "file:///b",
        "--allow-insecure-host",
        "mirror.example",
        "--index-strategy",
        "unsafe-best-match",
    ]
    assert env == {"SSL_CERT_FILE": "/ca.pem"}
    assert venv_install.uv_arguments({}) == ([], {})
    assert venv_install.uv_arguments({"no-index": "true"}) == (["--no-index"], {})


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
    _pip_config(tmp_path, monkeypatch, "[global]\nno-index = true\n")
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
