"""JSON as raytrn reads it from files others may have written: every way a text can fail to be JSON is a
``json.JSONDecodeError`` (a ``ValueError``), which each reader already turns into its one-line error.

``json.loads`` itself lets two escape as other exceptions: nesting deeper than Python's parser can follow
(``RecursionError``: ``[[[[…`` a hundred thousand deep) and an integer of more than 4,300 digits (a plain
``ValueError`` that is not a ``JSONDecodeError``, so readers catching that missed it)."""

from __future__ import annotations

import json
from typing import IO, Any


def loads(text: str | bytes) -> Any:
    """``json.loads``; anything that is not JSON raytrn can hold is a ``json.JSONDecodeError``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
    except ValueError as e:  # an integer of over 4,300 digits; bytes that are not UTF-8
        raise json.JSONDecodeError(str(e).split(";")[0], "", 0) from None


def load(stream: IO[str] | IO[bytes]) -> Any:
    """:func:`loads` of a file's whole text."""
    return loads(stream.read())
