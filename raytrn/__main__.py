"""``python -m raytrn``: the ``raytrn`` command (pyproject.toml's console script, ``raytrn.cli:main``)."""

import sys

from raytrn.cli import main

if __name__ == "__main__":
    sys.exit(main())
