"""The commands of docs/vllm.md ("Run it"), so the tests run what the page tells people to run.

`doc_command("encoder-service serve")` -> argv of that line; `doc_ec_transfer_config()` -> the JSON given to
`vllm serve --ec-transfer-config`; `with_values(argv, {"--port": "9"})` -> argv with those flags' values
replaced (each flag must be in the documented command); DOC_URL / DOC_TOKEN: the encoder URL and token the
page uses, for the tests to swap with their own.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
DOC_URL, DOC_TOKEN = "http://127.0.0.1:8000", "secret-token"


def doc_command(prefix: str) -> list[str]:
    """argv of the one line of the page that starts with `prefix` (an `ENV=value` in front is skipped)."""
    found = []
    for line in DOC.read_text().splitlines():
        command = re.sub(r"^([A-Z_]+=\S+\s+)*", "", line.strip())
        if command.startswith(prefix + " "):
            found.append(shlex.split(command))
    if len(found) != 1:
        raise AssertionError(f"docs/vllm.md has {len(found)} lines starting with {prefix!r}, expected 1")
    return found[0]


def doc_ec_transfer_config() -> dict:
    argv = doc_command("vllm serve")
    return json.loads(argv[argv.index("--ec-transfer-config") + 1])


def with_values(argv: list[str], values: dict[str, str]) -> list[str]:
    out = list(argv)
    for flag, value in values.items():
        if flag not in out:
            raise AssertionError(f"{flag} is not in the documented command {' '.join(argv)}")
        out[out.index(flag) + 1] = str(value)
    return out
