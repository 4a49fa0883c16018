"""A script that stops with its own short message and exit code, as examples/imagenette.py does
without data: the launcher must pass the code on and add no traceback noise."""

import sys

import pardist


def main() -> None:
    pardist.init()
    pardist.print0("clean_exit.py: error: no data in /nonexistent", file=sys.stderr)
    pardist.shutdown()
    sys.exit(2)


if __name__ == "__main__":
    main()
