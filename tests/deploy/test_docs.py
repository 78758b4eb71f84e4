"""The install commands the docs, the chart, the image and the service's own messages give: the package is not
published, so they install from this repository (`pip install -e '.[vllm]'` in a checkout, `"/src[sglang]"` in
the Dockerfile), and every extra they name is one pyproject.toml defines."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.deploy.chart import CHART, ROOT, render

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


# ---- the Secrets the docs create, against the chart that reads them ---------------------------------------
SECRET_DOCS = (ROOT / "deploy" / "README.md", ROOT / "docs" / "vllm.md")
# What a user's values say to use the docs' Secrets, keys left to the chart's defaults (deploy/README.md).
BY_NAME = ("model.hfToken.existingSecret=hf-token", "auth.enabled=true", "auth.existingSecret=encoder-auth",
           "redis.mode=external", "redis.external.existingSecret=encoder-redis")


def documented_secrets() -> dict[str, set[str]]:
    """Secret name -> its keys, from every `kubectl ... create secret generic NAME --from-literal=KEY=...` (or
    `--from-file=[KEY=]PATH`: the key, else the file's name) the docs show."""
    made: dict[str, set[str]] = {}
    for doc in SECRET_DOCS:
        for line in doc.read_text().splitlines():
            if "create secret generic" not in line:
                continue
            words = shlex.split(line, comments=True)
            name = words[words.index("generic") + 1]
            keys = made.setdefault(name, set())
            keys.update(w.partition("=")[2].partition("=")[0] for w in words if w.startswith("--from-literal="))
            for source in (w.partition("=")[2] for w in words if w.startswith("--from-file=")):
                key, eq, path = source.partition("=")
                keys.add(key if eq else Path(path or key).name)
    return made


def secret_refs(node) -> list[dict]:
    """Every Secret reference in rendered objects: a key's (env secretKeyRef, the ServiceMonitor's
    bearerTokenSecret, ...): {name, key}; a whole Secret's (a secret volume): {name}."""
    if isinstance(node, list):
        return [ref for item in node for ref in secret_refs(item)]
    if not isinstance(node, dict):
        return []
    refs = [v for k, v in node.items() if k in ("secretKeyRef", "bearerTokenSecret")]
    if isinstance(node.get("secret"), dict) and "secretName" in node["secret"]:
        refs.append({"name": node["secret"]["secretName"]})
    return refs + [ref for v in node.values() for ref in secret_refs(v)]


def test_documented_secrets_have_the_keys_the_chart_reads():
    """Following the docs (their kubectl commands, then values naming those Secrets, as the ci/ examples do) gives
    pods whose every Secret reference finds its key: the docs once made `token` while the chart read `hf-token`
    and `auth-token`, and such pods cannot start."""
    made = documented_secrets()
    assert set(made) == {"hf-token", "encoder-auth", "encoder-redis", "encoder-redis-tls"}, made
    scenarios = [("default", BY_NAME, ("monitoring.coreos.com/v1/ServiceMonitor",))]
    scenarios += [(p.stem, (), ()) for p in sorted((CHART / "ci").glob("*.yaml"))]
    referenced = set()
    for scenario, sets, apis in scenarios:
        for ref in secret_refs(render(scenario, sets, apis)):
            if ref["name"] in made:
                assert "key" not in ref or ref["key"] in made[ref["name"]], (scenario, ref, made)
                referenced.add(ref["name"])
    assert referenced == set(made)  # every Secret the docs make is one the chart reads
