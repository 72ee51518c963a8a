"""``python -m kvferry.testing.serve ARGS``: ``kvferry ARGS`` (normally ``serve ...``) with the
test faults its environment names installed first (``kvferry.testing.faults``). Tests start
faulty sidecars through this entry point; the product's own (``kvferry.cli``) knows of none."""

from __future__ import annotations

import os
import sys

from kvferry import cli
from kvferry.testing import faults


def main(argv: list[str] | None = None) -> int:
    installed = faults.install_from_environment(os.environ)
    if installed:
        print(f"kvferry.testing.serve: faults installed: {', '.join(installed)}", file=sys.stderr)
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
