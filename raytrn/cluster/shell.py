"""What a cluster file's shell commands run, read as the shell reads them (quotes, ``;``/``&&``/newlines, comments,
``VAR=value cmd``, ``export``/``unset``), not searched as text: ``echo RAY_AUTH_MODE=token`` sets nothing.

Enough of the shell for ``raytrn cluster validate``'s rules about ``ray start``: ``bash -c '...'`` (``sh``) is
followed with the environment it is given; ``$(...)`` and ``eval`` are not. Ray's cluster launcher runs each command of a list in its own
shell, so an ``export`` reaches the commands after it in the same string only.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
from dataclasses import dataclass

#: Tokens the shell ends a simple command at (shlex's punctuation; newlines too).
_PUNCTUATION = ";&|()\n"
#: Commands that run the rest of their words as a command (``env`` also takes ``VAR=value`` words).
_WRAPPERS = frozenset({"env", "exec", "nohup", "command", "time"})
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)


@dataclass(frozen=True)
class RayStart:
    """One ``ray start`` of a command: the variables the command gives its environment, and its arguments."""

    env: dict[str, str]
    args: list[str]

    def option(self, name: str) -> list[str]:
        """The values of ``--name=VALUE`` / ``--name VALUE`` among the arguments."""
        out = []
        for i, arg in enumerate(self.args):
            if arg.startswith(f"{name}="):
                out.append(arg[len(name) + 1 :])
            elif arg == name and i + 1 < len(self.args):
                out.append(self.args[i + 1])
        return out


def ray_starts(command: str, environ: dict[str, str] | None = None) -> list[RayStart]:
    """Each ``ray start`` that the shell command ``command`` runs (in a shell given ``environ``). ValueError when it
    cannot be read (an unclosed quote: the shell refuses it too)."""
    lex = shlex.shlex(_strip_comments(command.replace("\\\n", " ")), posix=True, punctuation_chars=_PUNCTUATION)
    lex.whitespace = " \t\r"
    lex.whitespace_split = True
    lex.commenters = ""
    words: list[str] = []
    shell = dict(environ or {})  # the shell's variables, and which of them are exported
    exported = set(shell)
    out: list[RayStart] = []
    for token in [*lex, ";"]:
        if token and all(c in _PUNCTUATION for c in token):
            out += _simple_command(words, shell, exported)
            words = []
        else:
            words.append(token)
    return out


def _simple_command(words: list[str], shell: dict[str, str], exported: set[str]) -> list[RayStart]:
    """Apply one simple command's effect on the shell's variables; the ``ray start`` it runs, if any."""
    local: dict[str, str] = {}
    while words and (m := _ASSIGNMENT.fullmatch(words[0])):
        local[m.group(1)] = m.group(2)
        words = words[1:]
    if not words:  # VAR=value alone: a shell variable (exported only if it was already)
        shell.update(local)
        return []
    name, rest = words[0], words[1:]
    if name == "export":
        for word in rest:
            m = _ASSIGNMENT.fullmatch(word)
            if m:
                shell[m.group(1)] = m.group(2)
            exported.add(m.group(1) if m else word)
        return []
    if name == "unset":
        for word in rest:
            shell.pop(word, None)
            exported.discard(word)
        return []
    while name in _WRAPPERS and rest:
        if name == "env":
            while rest and (m := _ASSIGNMENT.fullmatch(rest[0])):
                local[m.group(1)] = m.group(2)
                rest = rest[1:]
        while rest and rest[0].startswith("-"):
            rest = rest[1:]
        if not rest:
            return []
        name, rest = rest[0], rest[1:]
    env = {**{k: v for k, v in shell.items() if k in exported}, **local}
    if os.path.basename(name) in ("bash", "sh"):
        options = list(itertools.takewhile(lambda w: w.startswith("-"), rest))
        if any(not o.startswith("--") and "c" in o for o in options) and len(rest) > len(options):
            return ray_starts(rest[len(options)], env)  # bash -c 'COMMAND' (-lc, -ec...)
    if os.path.basename(name) != "ray" or rest[:1] != ["start"]:
        return []
    return [RayStart(env=env, args=rest[1:])]


def _strip_comments(command: str) -> str:
    """``command`` without its comments: from a ``#`` that starts a word, outside quotes, to the end of its line."""
    out: list[str] = []
    quote: str | None = None
    i = 0
    while i < len(command):
        c = command[i]
        if c == "\\" and quote != "'":
            out.append(command[i : i + 2])
            i += 2
            continue
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (not out or out[-1][-1] in " \t\n" + _PUNCTUATION):
            end = command.find("\n", i)
            i = len(command) if end < 0 else end
            continue
        out.append(c)
        i += 1
    return "".join(out)
