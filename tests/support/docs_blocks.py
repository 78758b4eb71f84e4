"""The commands, values and examples that README.md, docs/sglang.md and docs/vllm.md show, read back so that the
tests run exactly those: a fenced block right after a `<!-- sglang-tier: NAME ... -->` (`vllm-tier: NAME`: run by
that engine tier; `docs-test: NAME`: by the main suite) comment. Stdlib only (the engine tiers' venvs and the
main venv all import it)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SGLANG_DOC = ROOT / "docs" / "sglang.md"
VLLM_DOC = ROOT / "docs" / "vllm.md"


def block(name: str, doc: Path = SGLANG_DOC) -> str:
    """The fenced block following the `<!-- sglang-tier: name ... -->` (or `vllm-tier:`, `docs-test:`) marker."""
    m = re.search(r"<!--\s*[a-z]+-(?:tier|test):\s*" + re.escape(name) + r"\b[^>]*-->\s*\n```[a-z]*\n(.*?)\n```",
                  doc.read_text(), re.S)
    if m is None:
        raise AssertionError(f"{doc}: no fenced block after <!-- ...-tier: {name} --> or <!-- docs-test: {name} -->")
    return m.group(1)


@dataclass
class Command:
    env: dict[str, str]  # VAR=value assignments before the program
    argv: list[str]  # the program and its arguments

    def value(self, flag: str) -> str:
        return self.argv[self.argv.index(flag) + 1]

    def replaced(self, values: dict[str, str | list[str]]) -> list[str]:
        """argv with each `flag`'s value(s) replaced (every flag must be there: the docs show it)."""
        out = list(self.argv)
        for flag, new in values.items():
            if flag not in out:
                raise AssertionError(f"the documented command has no {flag}: {shlex.join(self.argv)}")
            at = out.index(flag) + 1
            end = at
            while end < len(out) and not out[end].startswith("--"):
                end += 1
            out[at:end] = [new] if isinstance(new, str) else list(new)
        return out


def command(name: str, doc: Path = SGLANG_DOC) -> Command:
    """A documented shell command (backslash continuations joined, `$VARS` kept as written)."""
    words = shlex.split(block(name, doc).replace("\\\n", " "), comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return Command(env, words)
