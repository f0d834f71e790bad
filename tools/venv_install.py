"""Install packages into a venv: with uv where the Makefile could get it, with pip otherwise.

    python3 tools/venv_install.py VENV_PYTHON [pip install arguments...]

uv installs the same packages at the same versions as pip, 3-10x faster here (docs/testing.md: `.venv` 15 s
against pip's ~40 s; the torch-xla venv's CUDA build of torch 2.9 38 s against pip's ~90 s). It reads none of
pip's settings, though: without the machine's wheel directory and file indexes that pip's configuration names,
it would take a multi-GB CUDA build of torch where pip takes the CPU wheel. So this script reads pip's
configuration (`pip config list`: its files and its PIP_* variables) and hands uv the same indexes, wheel
directories and certificate bundle, with pip's rule for several indexes (the best version over all of them:
uv's `unsafe-best-match`). Where uv is missing or fails, pip installs instead (after upgrading itself), with
`--no-compile`: the Makefile byte-compiles on every core afterwards (uv never byte-compiles by default).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

UV = Path(__file__).resolve().parent.parent / ".uv" / "bin" / "uv"

# pip's setting -> uv's option; each value of a setting may hold several space-separated entries.
_LISTS = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "trusted-host": "--allow-insecure-host"}


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective settings (`pip config list`): its environment beats its `install` section beats `global`."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    if listed.returncode != 0:  # a venv without pip: the same configuration, read by the Python running this
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    rank = {"global": 0, "install": 1, ":env:": 2}
    found: dict[str, tuple[int, str]] = {}
    for line in listed.stdout.splitlines():  # section.key='value', the value as Python's repr prints it
        name, sep, quoted = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not sep or not dot or section not in rank:
            continue
        try:
            value = str(ast.literal_eval(quoted))
        except (SyntaxError, ValueError):
            value = quoted.strip("'\"")
        if value.strip() and (key not in found or rank[section] >= found[key][0]):  # pip skips an empty value
            found[key] = (rank[section], value)
    return {key: value for key, (_, value) in found.items()}


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's command-line options and environment for pip's settings."""
    args: list[str] = []
    if "index-url" in settings:
        args += ["--index-url", settings["index-url"]]
    for key, option in _LISTS.items():
        for entry in settings.get(key, "").split():
            args += [option, entry]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    if "--find-links" in args or "--extra-index-url" in args:
        args += ["--index-strategy", "unsafe-best-match"]
    env = {"SSL_CERT_FILE": settings["cert"]} if "cert" in settings else {}
    return args, env


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    python, packages = argv[0], argv[1:]
    if UV.exists():
        args, env = uv_arguments(pip_settings(python))
        cmd = [str(UV), "pip", "install", "-q", "--python", python, *args, *packages]
        rc = subprocess.run(cmd, env={**os.environ, **env}, check=False).returncode
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
