"""The ``kestrel`` command's entry point: the CLI imported inside a Ctrl-C guard."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from kestrel_core.cli import main as cli_main
    except KeyboardInterrupt:  # while the CLI's modules load
        print("interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
