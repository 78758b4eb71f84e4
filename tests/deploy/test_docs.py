"""The install commands the docs, the chart, the image and the service's own messages give: the package is not
published, so they install from this repository (`pip install -e '.[vllm]'` in a checkout, `"/src[sglang]"` in
the Dockerfile), and every extra they name is one pyproject.toml defines."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {".md", ".py", ".sh", ".yaml", ".tpl", ".txt"}


def sources() -> list[Path]:
    """Where a user reads an install command: the docs, the chart, the image, the scripts, the package."""
    files = [ROOT / "README.md", ROOT / "Dockerfile"]
    for folder in ("docs", "deploy", "scripts", "benchmarks", "encoder_service"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES and p.is_file()]
    return files


def defined_extras() -> set[str]:
    section = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", (ROOT / "pyproject.toml").read_text(),
                        re.S | re.M).group(1)
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*=", section, re.M))


def test_nothing_installs_the_unpublished_package_by_name():
    by_name = re.compile(r"encoder[-_]service\[|pip install\s+['\"]?encoder[-_]service\b")
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in sources()
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if by_name.search(line)]
    assert not hits, "install from this repository instead (pip install -e '.[extra]'):\n" + "\n".join(hits)


def test_every_extra_named_exists():
    extras = defined_extras()
    assert {"sglang", "vllm", "fa4", "test"} <= extras
    named = {(path.relative_to(ROOT), extra) for path in sources()
             for group in re.findall(r"(?:\.|/src)\[([A-Za-z0-9_,-]+)\]", path.read_text(errors="replace"))
             for extra in group.split(",")}
    assert {extra for _, extra in named} >= {"sglang", "vllm", "fa4"}  # the docs do name them
    assert not {(str(p), e) for p, e in named if e not in extras}
