"""``python -m fastembed info``: what fastembed can use on this machine, and why not."""
from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastembed", description=__doc__)
    parser.add_argument("command", choices=["info"], help="info: versions, backends and why, hardware")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    arguments = parser.parse_args(argv)
    from .info import format_report, printable, report

    facts = report()
    try:
        print(printable(json.dumps(facts, indent=2) if arguments.json else format_report(facts), sys.stdout), flush=True)
    except BrokenPipeError:  # piped into head: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError as error:  # a full disk, say
        print(f"python -m fastembed: cannot write to the standard output: {error.strerror or error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
