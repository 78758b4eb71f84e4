"""Settings (flags, env twins, sizes, bad values) and `encoder-service serve` as a real process (demo model,
startup summary, SIGTERM; a port another process holds)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from encoder_service.settings import PortUnavailable, Settings, SettingsError, parse_size

REPO = Path(__file__).resolve().parents[2]


def test_sizes():
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("512") == 512
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_flag_beats_env_beats_default():
    env = {"ENCODER_MAX_IMAGES": "12", "ENCODER_BATCH_TOKENS": "2048", "ENCODER_CUDA_GRAPHS": "false",
           "ENCODER_ALLOW_URL_HOSTS": "a.example, B.example", "ENCODER_CACHE_BYTES": "1GiB"}
    s = Settings.from_args(["--model", "m", "--max-images", "3", "--device", "cpu"], env=env)
    assert s.limits.max_images == 3  # flag
    assert s.engine.batch_tokens == 2048  # env
    assert s.limits.max_body_bytes == 64 << 20  # default
    assert s.limits.allow_url_hosts == ("a.example", "b.example")
    assert s.cache.cache_bytes == 1 << 30 and s.cache.max_pinned_bytes == 1 << 29
    assert s.model.dtype == "float32" and s.engine.cuda_graphs is False
    assert s.engine.graph_buckets == (1024, 2048, 4096, 8192, 16384)
    with pytest.raises(Exception):  # frozen
        s.limits.max_images = 5  # type: ignore[misc]
    assert "secret" not in repr(Settings.from_args(["--model", "m", "--auth-token", "secret"], env={}))


def test_shm_fetch_switch(tmp_path):
    assert Settings.from_args(["--model", "m"], env={}).server.shm_fetch is False
    s = Settings.from_args(["--model", "m"], env={"ENCODER_SHM_FETCH": "true", "ENCODER_SHM_DIR": str(tmp_path)})
    assert s.server.shm_fetch is True and s.server.shm_dir == str(tmp_path)
    s = Settings.from_args(["--model", "m", "--no-shm-fetch"], env={"ENCODER_SHM_FETCH": "1"})
    assert s.server.shm_fetch is False and s.server.shm_dir == "/dev/shm"
    assert Settings.from_args(["--model", "m", "--shm-fetch"], env={}).server.shm_fetch is True


def test_exif_orientation_switch():
    assert Settings.from_args(["--model", "m"], env={}).model.exif_orientation is True  # as the engines load images
    assert Settings.from_args(["--model", "m", "--no-exif-orientation"], env={}).model.exif_orientation is False
    assert Settings.from_args(["--model", "m"], env={"ENCODER_EXIF_ORIENTATION": "off"}).model.exif_orientation is False
    s = Settings.from_args(["--model", "m", "--exif-orientation"], env={"ENCODER_EXIF_ORIENTATION": "false"})
    assert s.model.exif_orientation is True  # the flag wins


def test_shm_dir_is_checked_when_settings_are_read_with_shm_fetch_on(tmp_path):
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "missing", tmp_path / "file"):
        named = rf"--shm-dir / ENCODER_SHM_DIR '{re.escape(str(path))}' is not a directory this server can open "
        with pytest.raises(SettingsError, match=named + r"\((No such file or directory|Not a directory)\)"):
            Settings.from_args(["--model", "m", "--shm-fetch", "--shm-dir", str(path)], env={})
        assert Settings.from_args(["--model", "m", "--shm-dir", str(path)], env={}).server.shm_dir == str(path)  # off


@pytest.mark.parametrize("args, env, needle", [
    ([], {}, "--model / ENCODER_MODEL is required"),
    (["--model", "m", "--cache-bytes", "lots"], {}, "--cache-bytes / ENCODER_CACHE_BYTES"),
    (["--model", "m"], {"ENCODER_HTTP_PORT": "70000"}, "ENCODER_HTTP_PORT (ENCODER_HTTP_PORT)"),
    (["--model", "m", "--dtype", "int8"], {}, "must be one of bfloat16"),
    (["--model", "m", "--hash", "md5"], {}, "--hash"),
    (["--model", "m", "--batch-tokens", "0"], {}, "must be > 0"),
    (["--model", "m", "--graph-buckets", "1024,x"], {}, "comma-separated"),
    (["--model", "m", "--http-port", "0", "--grpc-port", "0"], {}, "both 0"),
    (["--model", "m", "--max-body-bytes", "1MiB"], {}, "--max-image-bytes"),
    (["--model", "m"], {"ENCODER_CUDA_GRAPHS": "maybe"}, "not a boolean"),
    (["--model", "m", "--redis-url", "localhost:6379"], {}, "redis://"),
    (["--model", "m", "--shm-dir", "shm"], {}, "--shm-dir / ENCODER_SHM_DIR must be an absolute path"),
    (["--model", "m"], {"ENCODER_SHM_FETCH": "maybe"}, "ENCODER_SHM_FETCH"),
    (["--model", "m", "--max-request-pixels", "1000"], {}, "--max-pixels (33554432) is over --max-request-pixels"),
    (["--model", "m"], {"ENCODER_READ_TIMEOUT_S": "0"}, "--read-timeout-s / ENCODER_READ_TIMEOUT_S"),
])
def test_bad_values_raise_naming_the_setting(args, env, needle):
    with pytest.raises(SettingsError) as info:
        Settings.from_args(args, env=env)
    assert needle in str(info.value)


@pytest.mark.parametrize("url, needle", [
    # passed the settings check, then raised in RedisTarget.shown (a port redis-py reads only at connect)
    ("redis://h:abc/0", "the port must be a number in 0-65535"),
    ("redis://u:secret@h:70000/0", "the port must be a number in 0-65535"),
    ("redis+cluster://h:1,h:99999", "'h:99999' is not host:port"),
    ("redis+sentinel://h:\u00b2/m", "is not host:port"),
    # redis-py passes TLS options to a plain connection, which raises a TypeError at connect
    ("redis+sentinel://h:1,h:2/m?ssl_ca_certs=/ca.pem", "ssl_ca_certs are for TLS: give them with rediss+sentinel://"),
    ("redis://h:1/0?ssl_certfile=/c.pem&ssl_keyfile=/k.pem", "ssl_certfile, ssl_keyfile are for TLS"),
    ("redis+cluster://h:1?ssl_cert_reqs=none", "with rediss+cluster://"),
])
def test_a_redis_url_redis_py_would_refuse_at_connect_is_refused_at_start(url, needle):
    with pytest.raises(SettingsError) as info:
        Settings.from_args(["--model", "m", "--redis-url", url], env={})
    assert "--redis-url / ENCODER_REDIS_URL: " in str(info.value) and needle in str(info.value)
    assert "secret" not in str(info.value)


@pytest.mark.parametrize("url, shown", [
    ("redis://h:6379/0", "redis://h:6379/0"), ("redis://h/0", "redis://h/0"), ("unix:///run/redis.sock", "unix:///run/redis.sock"),
    ("rediss://u:p@h:1/0?ssl_ca_certs=/ca.pem", "rediss://h:1/0"),
    ("rediss+sentinel://h:1,h:2/m?ssl_ca_certs=/ca.pem", "sentinel h:1,h:2/m"),
    ("redis+cluster://u:p@h:1,g:2", "redis+cluster://h:1,g:2"),  # was "redis://h:1": the Cluster not said
    ("rediss+cluster://h:1,g:2?ssl_ca_certs=/ca.pem", "rediss+cluster://h:1,g:2"),
])
def test_redis_urls_that_connect_are_taken(url, shown):
    from encoder_service.redis_url import parse_url

    assert Settings.from_args(["--model", "m", "--redis-url", url], env={}).cache.redis_url == url
    assert parse_url(url).shown == shown


def test_serve_demo_model_then_sigterm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENCODER_")}
    env["PYTHONPATH"] = str(REPO)
    from tests.support.ports import free_port

    grpc_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "encoder_service.cli", "serve", "--model", "demo:qwen2_vl", "--device", "cpu",
         "--grpc-port", str(grpc_port), "--http-port", str(free_port()), "--shm-fetch", "--shm-dir", str(tmp_path)],
        cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "ready in" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(90), "".join(lines)
        summary = "".join(lines)
        assert (tmp_path / ".demo" / "qwen2_vl" / "config.json").exists()
        for needle in ("family=qwen2_vl", "dtype=float32", "buckets=", "cache: host LRU 4GiB", "http: http://",
                       f"grpc: 127.0.0.1:{grpc_port}", f"shm fetch (rows into clients' shared-memory files, this "
                       f"host): on, files in {tmp_path}\n", "max_pixels=33554432 max_request_pixels=268435456"):
            assert needle in summary, summary
        url = summary.split("http: ")[1].split()[0]
        assert httpx.get(f"{url}/health/ready", timeout=10).json() == {"ready": True, "redis": "off"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        reader.join(10)
        assert "stopped" in "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def held_port():
    """A port on 127.0.0.1 that another socket listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def serve(checkpoint, *ports: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENCODER_")}
    env["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, "-m", "encoder_service.cli", "serve", "--model", str(checkpoint), "--device", "cpu",
            "--host", "127.0.0.1", *ports]
    return subprocess.run(argv, capture_output=True, text=True, timeout=150, env=env, cwd=REPO)


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_taken_port_is_one_line_and_exit_1(tiny_checkpoint, held_port, flag):
    """A port another process listens on: which port and what to do, in one line on stderr, exit 1, before the
    model loads (no traceback)."""
    other = "--grpc-port" if flag == "--http-port" else "--http-port"
    done = serve(tiny_checkpoint("qwen2_5_vl"), flag, str(held_port), other, "0")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    last = done.stderr.strip().splitlines()[-1]
    env = "ENCODER_" + flag.removeprefix("--").replace("-", "_").upper()
    assert last == (f"encoder-service serve: error: {flag} {held_port}: cannot listen on 127.0.0.1:{held_port}: "
                    f"another process holds it (another encoder-service?); stop it or give another port "
                    f"({flag} / {env})")
    assert "warm-up" not in done.stderr  # failed before loading the model (no warm-up encode logged)


def test_grpc_bind_failure_after_the_check_names_the_port(tiny_checkpoint, held_port):
    """gRPC binds its own socket once the core exists: a port taken since the check fails as PortUnavailable."""
    from encoder_service.api import grpc_server
    from tests.support.service import make_settings

    settings = make_settings(tiny_checkpoint("qwen2_5_vl"), "--grpc-port", str(held_port))
    with pytest.raises(PortUnavailable, match=f"--grpc-port {held_port}: cannot listen on 127.0.0.1:{held_port}: "
                                              "in use by another process, or not an address of this host"):
        asyncio.run(grpc_server.start(None, settings))
