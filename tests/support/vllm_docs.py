"""The commands of docs/vllm.md ("Run it"), so the tests run what the page tells people to run: the blocks
marked `<!-- vllm-tier: encoder | vllm | proxy -->` (tests/support/docs_blocks.py reads them).

`documented(name)` -> that command (`.argv`, `.env`, `.value(flag)`, `.replaced({flag: value})`);
`doc_ec_transfer_config()` -> the JSON given to `vllm serve --ec-transfer-config`; DOC_URL / DOC_TOKEN: the
encoder URL and token the page uses, for the tests to swap with their own.
"""

from __future__ import annotations

import json

from tests.support.docs_blocks import VLLM_DOC, Command, command

DOC_URL, DOC_TOKEN = "http://127.0.0.1:8000", "secret-token"


def documented(name: str) -> Command:
    return command(name, VLLM_DOC)


def doc_ec_transfer_config() -> dict:
    return json.loads(documented("vllm").value("--ec-transfer-config"))
