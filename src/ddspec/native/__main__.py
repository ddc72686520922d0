"""``python -m ddspec.native``: compile ddspec's CPU kernels into this Python environment now (what
``make setup`` runs beside pip), so that no first command waits for the compiler."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m ddspec.native",
        description="Compile ddspec's C kernels for this CPU into <python environment>/share/ddspec/native "
                    "(about 20 s on two cores; nothing to do when they are built). Without this, the first "
                    "ddspec command compiles them into its cache.").parse_args(argv)
    from ddspec import native

    try:
        where = native.prebuild()
    except (OSError, RuntimeError) as e:
        print(f"ddspec: could not build the CPU kernels ({e}); the first ddspec command will try again", file=sys.stderr)
        return 1
    if where is not None:
        print(f"ddspec: CPU kernels ready: {where}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
