"""The image tier: ./Dockerfile built for real and run the way the Helm chart runs it, checked from outside.

scripts/tiers/image.sh builds the image with buildah (no Docker daemon; a local Debian 12 base and CPU torch,
see the script) and runs this module from the main venv with ENCODER_IMAGE naming it. In the main suite it is
skipped. The container runs what the chart's encoder container runs, read from `helm template` of a CPU
configuration (the demo model, device cpu, float32, no GPU, no Redis): the image's ENTRYPOINT with the chart's
args and env, as the chart's runAsUser:runAsGroup with every capability dropped, and a tmpfs at each of the
chart's emptyDir mounts (/tmp and the HF cache). buildah's chroot isolation shares the host's network and PID
namespace: the service is told to bind 127.0.0.1 (not the chart's 0.0.0.0) on free ports, and its process
is seen from here.

Checked: the image's config against the Dockerfile and the chart (user, ports, env, labels, HEALTHCHECK);
nothing of the build left in the runtime stage; the chart's probes answer; an encode and a fetch over HTTP
and gRPC return the demo checkpoint's rows; the process runs as the chart's user and writes nothing outside
the chart's volumes (so readOnlyRootFilesystem holds); the HEALTHCHECK command passes while it serves and
fails once it is down; SIGTERM stops it with exit status 0 within the chart's grace period; and a Dockerfile
with a broken step fails the tier's build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encoder_service.client import EncoderClient
from tests.deploy import dockerfile
from tests.deploy.chart import ROOT, encoder_container, encoder_deployment, env_of, render
from tests.support.images import image_bytes
from tests.support.ports import free_port
from tests.support.waits import wait_for
from tests.support.reference import assert_close, reference_rows

IMAGE = os.environ.get("ENCODER_IMAGE", "")
pytestmark = pytest.mark.skipif(not IMAGE, reason="runs in its tier: bash scripts/tiers/image.sh")

DEMO = "demo:qwen2_5_vl"
READY_TIMEOUT_S = 180  # the demo checkpoint is built and loaded on start (about 10 s alone, more on a busy CPU)
BUILD_TOOLS = ("gcc", "cc", "c++", "g++", "make", "ld")
BUILD_PACKAGES = {"python3-venv", "python3-pip", "python3-dev", "build-essential", "gcc", "libc6-dev"}


def buildah(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0 or not check, f"buildah {' '.join(args)}: {p.stderr}"
    return p


@pytest.fixture(scope="module")
def image_config() -> dict:
    """The image's Docker config (User, Env, ExposedPorts, Entrypoint, Cmd, Healthcheck, Labels, ...)."""
    return json.loads(buildah("inspect", "--type", "image", IMAGE).stdout)["Docker"]["config"]


def image_env(config: dict) -> dict[str, str]:
    return dict(e.split("=", 1) for e in config["Env"])


class Running:
    """One container of the image serving as the chart's encoder container (see the module docstring)."""

    def __init__(self, config: dict, log_path: Path):
        self.http_port, self.grpc_port = free_port(), free_port()
        self.docs = render(sets=(f"model.id={DEMO}", "server.device=cpu", "server.dtype=float32", "gpu.count=0",
                                 "redis.mode=none", f"ports.http={self.http_port}", f"ports.grpc={self.grpc_port}"))
        self.spec = encoder_deployment(self.docs)["spec"]["template"]["spec"]
        self.container = encoder_container(self.docs)
        env = env_of(self.container)
        assert all("value" in e for e in env.values()), env  # this configuration needs no Secret
        self.env = {k: e["value"] for k, e in env.items()}
        assert self.env["ENCODER_HOST"] == "0.0.0.0"  # in a pod: the kubelet probes the pod's IP
        self.env["ENCODER_HOST"] = "127.0.0.1"  # here: the host's network
        sc = self.container["securityContext"]
        self.user = (sc["runAsUser"], sc["runAsGroup"])
        # Kubernetes: `args` replace the image's CMD, its ENTRYPOINT stays.
        self.argv = config["Entrypoint"] + self.container["args"]
        empty_dirs = {v["name"] for v in self.spec["volumes"] if "emptyDir" in v}
        self.tmpfs = [m["mountPath"] for m in self.container["volumeMounts"] if m["name"] in empty_dirs]
        self.name = f"image-test-{os.getpid()}"
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        buildah("from", "--pull-never", "--name", self.name, IMAGE, timeout=300)
        self.rootfs = Path(buildah("mount", self.name).stdout.strip())
        self.started_at = time.time()
        time.sleep(1.1)  # file times have a 1 s granularity on some filesystems: later writes are newer
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.run_argv(self.argv), stdout=log, stderr=subprocess.STDOUT)

    def run_argv(self, argv: list[str]) -> list[str]:
        """`buildah run` of argv in this container, with the chart's user, env and volumes."""
        cmd = ["buildah", "run", "--isolation", "chroot", "--cap-drop", "ALL", "--user", "%d:%d" % self.user]
        for k, v in self.env.items():
            cmd += ["-e", f"{k}={v}"]
        for path in self.tmpfs:
            cmd += ["--mount", f"type=tmpfs,destination={path}"]
        return [*cmd, self.name, "--", *argv]

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self) -> None:
        wait_for(self._ready, lambda: f"the container to be ready:\n{self.log_tail()}", READY_TIMEOUT_S, poll_s=0.3)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"the container exited {self.proc.returncode}:\n{self.log_tail()}"
        try:
            return httpx.get(f"{self.url}/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def service_pid(self) -> int:
        """The service's process: the deepest process under `buildah run` (buildah-chroot-runtime, then
        buildah-chroot-exec, then the ENTRYPOINT's python)."""
        pid = self.proc.pid
        for _ in range(8):
            children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                        for c in (t / "children").read_text().split()]
            if not children:
                return pid
            (pid,) = children
        raise AssertionError("process tree deeper than expected")

    def remove(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.service_pid(), signal.SIGKILL)  # buildah run exits with it
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        buildah("rm", self.name, timeout=300, check=False)


@pytest.fixture(scope="module")
def service(image_config, tmp_path_factory):
    running = Running(image_config, tmp_path_factory.mktemp("image") / "container.log")
    try:
        running.start()
        running.wait_ready()
        yield running
    finally:
        running.remove()


# ---- the image as built ---------------------------------------------------------------------------------------


def test_image_config_is_the_dockerfiles_and_the_charts(image_config):
    env = image_env(image_config)
    declared = dockerfile.runtime_env()
    assert {k: v for k, v in declared.items() if "$" not in v}.items() <= env.items()
    assert env["PATH"].startswith(declared["PATH"].replace("$PATH", ""))  # the venv first
    assert "DEBIAN_FRONTEND" not in env
    assert image_config["User"] == "%d:%d" % dockerfile.runtime_user()
    assert {int(p.split("/")[0]) for p in image_config["ExposedPorts"]} == dockerfile.exposed_ports()
    assert image_config["Entrypoint"] == ["encoder-service"] and image_config["Cmd"] == ["serve"]
    # The chart's defaults (no --set): its user and ports are the image's.
    c = encoder_container(render())
    assert image_config["User"] == "%d:%d" % (c["securityContext"]["runAsUser"], c["securityContext"]["runAsGroup"])
    assert {p["containerPort"] for p in c["ports"]} == dockerfile.exposed_ports()
    health = image_config["Healthcheck"]  # kept only by the docker format (scripts/tiers/image.sh)
    assert health["Test"][0] == "CMD" and "/health/live" in " ".join(health["Test"])


def test_labels_name_the_version_and_the_commit(image_config):
    import tomllib

    labels = image_config["Labels"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert labels["org.opencontainers.image.version"] == version
    revision = labels["org.opencontainers.image.revision"]
    commit, dirty = re.fullmatch(r"([0-9a-f]{40})(-dirty)?", revision).groups()
    git = ["git", "-C", str(ROOT)]
    assert subprocess.run([*git, "cat-file", "-e", f"{commit}^{{commit}}"]).returncode == 0, revision
    if not dirty:  # a clean build: that commit's image inputs are this checkout's (the tier reuses it while so)
        inputs = ["Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "encoder_service"]
        assert subprocess.run([*git, "diff", "--quiet", commit, "--", *inputs]).returncode == 0, revision


def test_build_info_names_the_commit(service, image_config):
    """The running service's encoder_build_info carries the image's commit (ENCODER_GIT_COMMIT from VCS_REF:
    the installed package has no .git of its own)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(service.url + "/metrics", timeout=10).text
    (info,) = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "encoder_build_info"]
    assert info.labels["commit"] == image_config["Labels"]["org.opencontainers.image.revision"], info.labels


def test_runtime_stage_has_no_build_tools_or_caches(service):
    root = service.rootfs
    for tool in BUILD_TOOLS:
        assert not (root / "usr/bin" / tool).exists() and not (root / "usr/local/bin" / tool).exists(), tool
    status = (root / "var/lib/dpkg/status").read_text()
    installed = {m.group(1) for m in re.finditer(r"^Package: (\S+)\nStatus: install ok installed", status, re.M)}
    assert "python3" in installed and not BUILD_PACKAGES & installed
    assert not [p.name for p in (root / "var/lib/apt/lists").iterdir() if p.name not in ("lock", "partial")]
    assert not list((root / "var/cache/apt/archives").glob("*.deb"))
    for home in ("root", "tmp"):  # root's and the service user's (HOME=/tmp) pip caches
        assert not (root / home / ".cache" / "pip").exists(), home
    assert not (root / "src").exists()  # the build stage's source tree
    assert not list((root / "mnt").iterdir())  # the test build's torch index was mounted there, never copied
    assert not list((root / "opt/venv").rglob("*.whl"))


# ---- the image as the chart runs it ---------------------------------------------------------------------------


def test_chart_probes_answer(service):
    ports = {p["name"]: p["containerPort"] for p in service.container["ports"]}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = service.container[kind]
        if "grpc" in probe:  # the kubelet's native gRPC probe: grpc.health.v1 Check, service ""
            with grpc.insecure_channel(f"127.0.0.1:{probe['grpc']['port']}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, kind
        else:
            get = probe["httpGet"]
            port = ports.get(get["port"], get["port"])
            assert httpx.get(f"http://127.0.0.1:{port}{get['path']}", timeout=10).status_code == 200, kind


@pytest.mark.parametrize(("transport", "seed"), [("http", 1), ("grpc", 2)])
def test_encode_and_fetch(service, transport, seed, tmp_path):
    """The rows the container serves are the demo checkpoint's (built inside it; read here through /proc)."""
    data = image_bytes(112, 84, seed)
    client = EncoderClient.http(service.url, timeout=60) if transport == "http" else \
        EncoderClient.grpc(service.grpc_address, timeout=60)
    with client:
        (info,) = client.encode([data])
        assert info.num_tokens > 0 and not info.cached
        got = client.fetch([(info.id, 0)], 0, info.num_tokens)
        assert client.metadata()["family"] == "qwen2_5_vl"
    checkpoint = tmp_path / "demo"
    shutil.copytree(f"/proc/{service.service_pid()}/root/tmp/.demo/qwen2_5_vl", checkpoint)
    assert_close(got.rows, reference_rows(checkpoint, data))


def test_runs_as_the_charts_user(service, image_config):
    uid, gid = service.user
    assert uid != 0 and image_config["User"] == f"{uid}:{gid}"
    assert service.spec["securityContext"]["fsGroup"] == gid
    status = Path(f"/proc/{service.service_pid()}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines())
    assert fields["Uid"].split() == [str(uid)] * 4 and fields["Gid"].split() == [str(gid)] * 4
    assert int(fields["CapEff"], 16) == 0


def test_healthcheck_passes_while_serving(service, image_config):
    test = image_config["Healthcheck"]["Test"]
    p = subprocess.run(service.run_argv(test[1:]), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_sigterm_stops_it_cleanly(service, image_config, capsys):
    """Last: it stops the module's container. The kubelet runs the preStop sleep, then sends SIGTERM, then
    SIGKILL once terminationGracePeriodSeconds have passed since the start: the service must be gone before."""
    budget = service.spec["terminationGracePeriodSeconds"] - int(
        service.container["lifecycle"]["preStop"]["exec"]["command"][1])
    pid = service.service_pid()
    start = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    try:
        code = service.proc.wait(budget)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {budget} s after SIGTERM:\n{service.log_tail()}")
    took = time.monotonic() - start
    assert code == 0, service.log_tail()
    assert "signal received: shutting down gracefully" in service.log_tail() and "stopped" in service.log_tail()
    with capsys.disabled():
        print(f"\nimage tier: the service stopped {took:.1f} s after SIGTERM (exit status 0; budget {budget} s)")
    # Down: the HEALTHCHECK command fails.
    p = subprocess.run(service.run_argv(image_config["Healthcheck"]["Test"][1:]), capture_output=True, timeout=120)
    assert p.returncode != 0
    # It wrote nothing outside the chart's volumes (tmpfs here): readOnlyRootFilesystem would have held.
    # (buildah itself touches /run for each `buildah run`.)
    written = [str(p.relative_to(service.rootfs)) for p in service.rootfs.rglob("*")
               if not p.is_symlink() and p.lstat().st_mtime > service.started_at and p != service.rootfs / "run"]
    assert not written, written


# ---- the tier's build ---------------------------------------------------------------------------------------------


def test_a_broken_dockerfile_step_fails_the_build(tmp_path):
    """The tier's own build (scripts/tiers/image.sh build) of a Dockerfile whose first RUN asks apt for a
    package that does not exist: it fails, naming the step, and leaves no image and no container behind."""
    text = (ROOT / "Dockerfile").read_text()
    broken = text.replace("python3 ca-certificates", "python3 ca-certificates no-such-package-xyz", 1)
    assert broken != text, "the Dockerfile's first apt-get install changed: update this test"
    path = tmp_path / "Dockerfile"
    path.write_text(broken)
    tag = f"localhost/encoder-service:broken-{os.getpid()}"
    before = buildah("containers", "--format", "{{.ContainerName}}").stdout
    p = subprocess.run(["bash", "scripts/tiers/image.sh", "build", str(path), tag], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "Unable to locate package no-such-package-xyz" in out and "building at STEP" in out, out[-3000:]
    assert buildah("inspect", "--type", "image", tag, check=False).returncode != 0
    assert buildah("containers", "--format", "{{.ContainerName}}").stdout == before
