"""Credentials inside URIs (``scheme://user:password@host``): read once, masked everywhere the same way.

Below every other raytrn module (it imports nothing of raytrn), so that anything that prints an address or a URI
(the Ray address in :mod:`raytrn.runtime`, a tracking URI in :mod:`raytrn.tracking.client`) masks it alike.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

#: Credentials in a URI, from just after its ``://``: a user (no ``:`` or ``/``; it may hold ``@``), then
#: optionally ``:`` and a password running to the last ``@`` before whitespace, whatever it holds (``/``, ``#``,
#: ``?``, ``@`` unencoded: the user meant the host after the last ``@``). Any scheme: ``http``, ``HTTP``,
#: ``postgresql``, ``mysql+pymysql``. A path holding ``@`` after a ``host:port`` reads as credentials too: masking
#: too much is safe, too little is not.
_CREDENTIALS = re.compile(r"(?P<user>[^\s:/]*)(?::(?P<password>\S*))?@")
_AFTER_SCHEME = re.compile(r"(?<=://)")


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """``scheme://user:password@host...`` (any scheme) -> (the URI without them, user, password); a URI without
    credentials as it is. The password runs to the URI's last ``@`` (:data:`_CREDENTIALS`): it may hold ``@``,
    ``:``, ``/``, ``#`` or ``?`` unencoded. The one reading of credentials that :func:`redact_uri` masks too."""
    scheme_end = uri.find("://")
    m = _CREDENTIALS.match(uri, scheme_end + 3) if scheme_end > 0 else None
    if m is None or any(c.isspace() for c in uri[:scheme_end]):
        return uri, None, None
    clean = uri[: m.start()] + uri[m.end() :]
    password = m.group("password")
    return clean, unquote(m.group("user")), unquote(password) if password is not None else None


def redact_uri(text: str) -> str:
    """``text`` with the password of every URI in it masked: ``scheme://user:pass@host`` ->
    ``scheme://user:***@host`` (what :func:`split_credentials` reads as the password)."""
    out, done = [], 0
    for start in (m.end() for m in _AFTER_SCHEME.finditer(text)):
        if start < done:
            continue
        m = _CREDENTIALS.match(text, start)
        if m is None or m.group("password") is None:
            continue
        out.append(text[done : m.start("password")] + "***")
        done = m.end("password")
    return "".join(out) + text[done:]
