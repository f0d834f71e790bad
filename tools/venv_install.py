"""Install packages into a venv: with uv where the Makefile could get it, with pip otherwise.

    python3 tools/venv_install.py VENV_PYTHON [pip install arguments...]

uv installs the same packages at the same versions as pip, 3-10x faster here (docs/testing.md: `.venv` 15 s
against pip's ~40 s; the torch-xla venv's CUDA build of torch 2.9 38 s against pip's ~90 s). It reads none of
pip's settings, though: without the machine's wheel directory and file indexes that pip's configuration names,
it would take a multi-GB CUDA build of torch where pip takes the CPU wheel. So this script reads pip's
configuration (`pip config list`: its files and its PIP_* variables) and hands uv the same indexes, wheel
directories, constraints, binary rules, certificate bundle, proxy and timeout, with pip's rule for several
indexes (the best version over all of them: uv's `unsafe-best-match`), and none of uv's own configuration files.
Where pip's settings hold something without a counterpart below, where uv is missing or where it fails, pip
installs instead (after upgrading itself), with `--no-compile`: the Makefile byte-compiles on every core
afterwards (uv never byte-compiles by default).
"""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

UV = Path(__file__).resolve().parent.parent / ".uv" / "bin" / "uv"

# pip's setting -> uv's option. A list's value may hold several entries (space- or newline-separated).
_SINGLE = {"index-url": "--index-url"}
_LISTS = {
    "find-links": "--find-links",
    "extra-index-url": "--extra-index-url",
    "trusted-host": "--allow-insecure-host",
    "constraint": "--constraints",
    "only-binary": "--only-binary",
    "no-binary": "--no-binary",
}
_FLAGS = {"no-index": ["--no-index"], "pre": ["--prerelease", "allow"], "require-hashes": ["--require-hashes"]}
# pip's setting -> the environment variables that carry it to uv.
_ENVIRONMENT = {
    "cert": ("SSL_CERT_FILE",),
    "client-cert": ("SSL_CLIENT_CERT",),
    "timeout": ("UV_HTTP_TIMEOUT",),
    "retries": ("UV_HTTP_RETRIES",),
    "proxy": ("HTTP_PROXY", "HTTPS_PROXY"),
}
# uv takes whole numbers where pip takes a float (timeout) or an int: UV_HTTP_TIMEOUT=15.5 makes uv exit 2.
_WHOLE = {"timeout": lambda value: str(math.ceil(float(value))), "retries": lambda value: str(int(float(value)))}
# One pip option under two names (`--timeout`, `--default-timeout`): the later in pip's precedence wins.
_ALIASES = {"default-timeout": "timeout"}
# pip's settings that change how pip talks, not what it installs.
_NO_EFFECT = {
    "config-file", "disable-pip-version-check", "no-cache-dir", "cache-dir", "progress-bar", "quiet", "verbose",
    "no-color", "root-user-action", "require-virtualenv", "no-input", "no-compile", "compile", "log", "log-file", "local-log",
    "no-python-version-warning",
}  # fmt: skip
_TRUE, _FALSE = {"y", "yes", "t", "true", "on", "1"}, {"n", "no", "f", "false", "off", "0"}  # pip's strtobool


class UvCannot(Exception):
    """pip's settings hold something this script cannot hand to uv: pip installs instead."""


def settings_from_listing(listing: str) -> dict[str, str]:
    """pip's effective settings from `pip config list`'s lines (`section.key='value'`, the value as Python's repr
    prints it): its environment beats its `install` section beats `global`; an empty value is no setting."""
    rank = {"global": 0, "install": 1, ":env:": 2}
    found: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, sep, quoted = line.partition("=")
        section, dot, key = name.rpartition(".")
        key = _ALIASES.get(key, key)
        if not sep or not dot or section not in rank:
            continue
        try:
            value = str(ast.literal_eval(quoted))
        except (SyntaxError, ValueError):
            value = quoted.strip("'\"")
        if value.strip() and (key not in found or rank[section] >= found[key][0]):  # pip skips an empty value
            found[key] = (rank[section], value)
    return {key: value for key, (_, value) in found.items()}


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective settings (its files and its PIP_* variables), read by the venv's pip or, where the venv has
    none, by the pip of the Python running this."""
    for interpreter in (python, sys.executable):
        listed = subprocess.run([interpreter, "-m", "pip", "config", "list"], capture_output=True, text=True)
        if listed.returncode == 0:
            return settings_from_listing(listed.stdout)
    raise UvCannot(f"`pip config list` failed (exit {listed.returncode}): pip's settings are unknown")


def _flag(key: str, value: str) -> bool:
    if value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise UvCannot(f"pip's setting {key}={value!r} is neither true nor false")


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's command-line options and environment for pip's settings; UvCannot for a setting with no counterpart."""
    args: list[str] = []
    env: dict[str, str] = {}
    for key, value in settings.items():
        if key in _SINGLE:
            args += [_SINGLE[key], value.strip()]
        elif key in _LISTS:
            for entry in value.split():
                args += [_LISTS[key], entry]
        elif key in _FLAGS:
            args += _FLAGS[key] if _flag(key, value) else []
        elif key in _ENVIRONMENT:
            try:
                value = _WHOLE.get(key, str.strip)(value.strip())
            except (ValueError, OverflowError):
                raise UvCannot(f"pip's setting {key}={value!r} is not a finite number") from None
            env.update(dict.fromkeys(_ENVIRONMENT[key], value))
        elif key not in _NO_EFFECT:
            raise UvCannot(f"pip's setting {key!r} has no uv counterpart in this script")
    if "--find-links" in args or "--extra-index-url" in args:
        args += ["--index-strategy", "unsafe-best-match"]  # pip's rule: the best version over every index
    return args, env


def uv_environment(environ: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    """The environment uv runs in: the machine's, less uv's own settings (UV_INDEX, UV_TORCH_BACKEND, UV_OFFLINE,
    UV_CONSTRAINT...), which pip would not read; its cache directory stays (where things go, not what)."""
    return {name: value for name, value in environ.items() if not name.startswith("UV_") or name == "UV_CACHE_DIR"}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    python, packages = argv[0], argv[1:]
    if UV.exists():
        try:
            args, env = uv_arguments(pip_settings(python))
        except UvCannot as why:
            print(f"venv_install: {why}; installing with pip", file=sys.stderr)
        else:  # pip's settings only: no uv.toml (--no-config) nor UV_* variable that pip would not read
            cmd = [str(UV), "pip", "install", "-q", "--no-config", "--python", python, *args, *packages]
            rc = subprocess.run(cmd, env={**uv_environment(os.environ), **env}, check=False).returncode
            if rc == 0:
                return 0
            print(f"venv_install: uv failed (exit {rc}); installing with pip instead", file=sys.stderr)
    rc = subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=False).returncode
    if rc != 0:
        print(f"venv_install: {python} -m pip failed (exit {rc}); nothing installed", file=sys.stderr)
        return rc
    return subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", *packages], check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
