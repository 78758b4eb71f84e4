"""test_children.py's helper process: each command line back as JSON, "boom" a command that fails (answered as
`children.failure` says; the process stays up for the next line); it exits when its input ends."""

from __future__ import annotations

import json
import sys

from benchmarks.common import children


def main() -> int:
    for line in sys.stdin:
        try:
            if line.strip() == "boom":
                raise ValueError("pins are full")
            print(json.dumps({"echo": line.strip()}), flush=True)
        except Exception as exc:
            print(children.failure(exc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
