"""``python -m tensorx ...``: the same as the ``tensorx`` command."""

from __future__ import annotations

import sys

from tensorx.cli import main

if __name__ == "__main__":
    sys.exit(main())
