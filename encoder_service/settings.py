"""One frozen settings tree for the service, built from CLI flags with environment-variable twins.

Every flag in README's Configuration table has an `ENCODER_*` twin; the flag wins over the environment,
the environment over the default. Bad values raise `SettingsError` naming the flag, the env var and the
value. Sizes accept plain integers and units ("64MiB", "4GiB", "1.5GB").
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from encoder_service.protocol.shm import DEFAULT_DIR as DEFAULT_SHM_DIR
from encoder_service.redis_url import parse_url

log = logging.getLogger(__name__)

HASHES = ("blake3", "xxh3_128", "sha256")
DTYPES = ("bfloat16", "float16", "float32")
# Preprocessing backends (preprocessing/backends.py): the Pillow pipeline on CPU threads; transformers'
# torchvision pipeline on the model's device, every image decoded by Pillow (pixels exactly those transformers
# gets from a PIL image); the same with JPEGs decoded by nvJPEG on CUDA (faster, not exact: opt-in).
PREPROCESS_BACKENDS = ("pil", "torchvision", "torchvision-nvjpeg")
# Old names, accepted with a warning for one release: old -> what it is now.
PREPROCESS_ALIASES = {"torchvision-pil-decode": "torchvision"}
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# --attention: ops/attention.py's CHOICES (kept here so that settings import no torch).
ATTENTION = ("auto", "fa4", "torch")
# The one default ladder of CUDA-graph buckets (patch rows): the service's, make_runner's and the
# benchmarks'. runtime/runner.py adds an exact bucket for each common resolution under the largest.
DEFAULT_BUCKETS = (1024, 2048, 4096, 8192, 16384)
# Video demuxers and codecs that may be allowed (FFmpeg's names; preprocessing/limits.py: VideoLimits):
# mov reads MP4 and QuickTime files, matroska MKV and WebM.
VIDEO_CONTAINERS = ("mov", "matroska")
VIDEO_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg")
# --max-pixels' default: the most pixels one image may decode to. The models' own processors keep at most
# 16777216 (Qwen3-VL) or 12845056 (Qwen2/2.5-VL) pixels, smart_resize shrinking larger images to that; twice
# the larger still takes an 8K UHD frame (7680x4320) and a 24 MP photo, and bounds one image's decode (a PNG of
# 8000x8000 took 0.66 s of CPU; the old default, 64 Mpx, let it through).
MAX_PIXELS = 2 * 16_777_216
# --max-request-pixels' default: the decode work of one request, eight images at that limit (64 images of 4 Mpx,
# 2560x1600); with it sixteen 8000x8000 PNGs in one request are refused before any is decoded.
MAX_REQUEST_PIXELS = 8 * MAX_PIXELS

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class SettingsError(ValueError):
    """A configuration value is wrong; the message names the flag, its env twin and the value."""


class PortUnavailable(SettingsError):
    """A server cannot listen on its port (another process holds it, ...): the one line `encoder-service serve`
    prints, naming the flag, the address and what to do."""

    @classmethod
    def of(cls, name: str, host: str, port: int, exc: OSError | None) -> "PortUnavailable":
        """For option `name` (http_port, ...); `exc`: the bind's error (None: gRPC's, which names no cause)."""
        address = f"{flag(name)} {port}: cannot listen on {host}:{port}"
        other_port = f"{flag(name)} / {env_name(name)}"
        if exc is not None and exc.errno == errno.EADDRINUSE:
            return cls(f"{address}: another process holds it (another encoder-service?); stop it or give another "
                       f"port ({other_port})")
        if exc is None:
            why = "in use by another process, or not an address of this host"
        elif exc.errno == errno.EACCES:
            why = "permission denied (ports below 1024 need privileges)"
        else:
            why = exc.strerror or str(exc)
        return cls(f"{address}: {why}; give another port ({other_port}) or check --host / ENCODER_HOST")


def parse_size(text: str) -> int:
    """'64MiB' -> 67108864; '4GiB', '1.5GB', '512' (bytes) also accepted. Raises ValueError."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or a unit such as 64MiB, 4GiB, 1GB)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n}B"


def parse_bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false, 1/0, on/off)")


def parse_buckets(text: str) -> tuple[int, ...]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"buckets must be positive integers, got {text!r}")
    return tuple(sorted(set(values)))


def parse_hosts(text: str) -> tuple[str, ...]:
    return tuple(h.strip().lower() for h in str(text).split(",") if h.strip())


def _names(known: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated, non-empty subset of `known`."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip().lower() for n in str(text).split(",") if n.strip()))
        unknown = [n for n in names if n not in known]
        if not names or unknown:
            raise ValueError(f"must be a comma-separated list of {', '.join(known)}, got {text!r}")
        return names

    return parse


@dataclass(frozen=True)
class ModelSettings:
    model: str
    revision: str | None
    device: str
    dtype: str
    preprocess: str = "pil"  # one of PREPROCESS_BACKENDS
    exif_orientation: bool = True  # apply a photo's EXIF orientation before preprocessing, as the engines do


@dataclass(frozen=True)
class ServerSettings:
    host: str
    http_port: int  # 0: HTTP off
    grpc_port: int  # 0: gRPC off
    auth_token: str | None = field(repr=False)
    log_level: str
    access_log: bool = False  # one INFO line per request (api/requests.py), on every transport
    shm_fetch: bool = False  # fetch rows into co-located clients' shared-memory files (core/shm_writer.py)
    shm_dir: str = DEFAULT_SHM_DIR  # the only directory those files may be in
    send_threads: int = 8  # threads writing fetched rows onto HTTP sockets (api/socket_send.py); 0: the loop
    # An HTTP request's head must arrive within this of its first byte (or of a new connection), and its body
    # pause no longer than this, and arrive whole within it plus its length at api/bodies.py: MIN_BODY_RATE
    # (api/read_timeouts.py, api/bodies.py); else the connection is closed.
    read_timeout_s: float = 30.0
    # Rows GPU to GPU for consumers on this host (runtime/device_arena.py): the arena's bytes (None: auto, 0: off)
    # and how long a fetch by IPC holds its rows at most without an acknowledgement.
    ipc_arena_bytes: int | None = None
    ipc_lease_s: float = 5.0
    # The same-host channel of fetches by IPC (api/ipc_channel.py): "auto", "off", or a Unix socket's path.
    ipc_channel: str = "auto"
    # SGLang's encoder-server protocol (api/sglang/): its own port, off by default (nothing listens then).
    sglang_protocol: bool = False
    sglang_port: int = 8100
    # Where other replicas reach this one's HTTP row path (replicas/peers.py); None: the bound HTTP address
    # (api/service.py: advertised_url).
    advertise_url: str | None = None


@dataclass(frozen=True)
class CacheSettings:
    redis_url: str | None = field(repr=False)  # may hold a password
    redis_ttl_s: int
    cache_bytes: int
    hash: str
    lease_s: float
    max_pinned_bytes: int
    redis_row_copy_bytes: int = 0  # entries up to this size also get a copy of their rows in Redis (0: none)


@dataclass(frozen=True)
class EngineSettings:
    cuda_graphs: bool
    graph_buckets: tuple[int, ...]
    batch_tokens: int
    max_queue: int
    attention: str = "auto"  # ops/attention.py: CHOICES


@dataclass(frozen=True)
class LimitSettings:
    max_images: int
    max_body_bytes: int
    max_image_bytes: int
    max_pixels: int
    allow_url_hosts: tuple[str, ...]  # empty: url images refused
    max_request_pixels: int = MAX_REQUEST_PIXELS  # decoded pixels of a request's images together (headers)
    max_fetch_bytes: int = 4 << 30  # rows one socket fetch gathers from several items


@dataclass(frozen=True)
class VideoSettings:
    """Bounds on one video (preprocessing/limits.py: VideoLimits) and how much of one the engine holds."""

    max_videos: int = 4  # per request
    max_video_bytes: int = 64 << 20  # the file, or all frames' images together
    max_video_duration_s: float = 600.0
    max_video_frames: int = 768  # sampled frames (what the tower gets)
    max_video_source_frames: int = 36_000  # frames in the source (decoded up to the last one sampled)
    max_video_frame_pixels: int = 4096 * 4096  # one source frame
    max_video_pixels: int = 1 << 35  # source frames x width x height: the decoder's work
    max_video_tokens: int = 1 << 18  # merged tokens of one video
    video_containers: tuple[str, ...] = VIDEO_CONTAINERS
    video_codecs: tuple[str, ...] = VIDEO_CODECS
    video_decoder_threads: int = 2  # FFmpeg threads per video decoder
    video_window: int = 8  # frame groups of one video in the engine at once


@dataclass(frozen=True)
class Settings:
    model: ModelSettings
    server: ServerSettings
    cache: CacheSettings
    engine: EngineSettings
    limits: LimitSettings
    video: VideoSettings = field(default_factory=VideoSettings)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> "Settings":
        """Parse `encoder-service serve` flags (argv without the subcommand) with env twins."""
        parser = argparse.ArgumentParser(prog="encoder-service serve", exit_on_error=False)
        add_serve_arguments(parser)
        ns = parser.parse_args(list(argv or []))
        return resolve(ns, os.environ if env is None else env)


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str):
        v = kind(text)
        if v <= 0:
            raise ValueError(f"must be > 0, got {text!r}")
        return v

    return parse


def _non_negative(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str):
        v = kind(text)
        if v < 0:
            raise ValueError(f"must be >= 0, got {text!r}")
        return v

    return parse


def _advertised(text: str) -> str:
    if not re.match(r"^http://[^/\s]+$", str(text).rstrip("/")):
        raise ValueError(f"must be http://host:port (the replica's own HTTP port), got {text!r}")
    return str(text).rstrip("/")


def _size_or_auto(text: str) -> int | None:
    return None if str(text).strip().lower() == "auto" else _non_negative(parse_size)(text)


def _ipc_channel(value: str) -> str:
    """auto, off, or an absolute path whose directory exists."""
    if value in ("auto", "off"):
        return value
    if not os.path.isabs(value) or not os.path.isdir(os.path.dirname(value)):
        raise ValueError(f"expected auto, off or an absolute path in an existing directory, got {value!r}")
    return value


def _port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise ValueError(f"port must be in 0..65535, got {text!r}")
    return v


def _choice(options: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        t = str(text).strip().lower()
        if t not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {text!r}")
        return t

    return parse


def _preprocess(text: str) -> str:
    t = str(text).strip().lower()
    if t in PREPROCESS_ALIASES:
        log.warning("--preprocess / ENCODER_PREPROCESS %s is deprecated and goes in the next release: use %s, "
                    "which now decodes every image with Pillow as %s did (nvJPEG is torchvision-nvjpeg)",
                    t, PREPROCESS_ALIASES[t], t)
        return PREPROCESS_ALIASES[t]
    return _choice(PREPROCESS_BACKENDS)(t)


def _device(text: str) -> str:
    t = str(text).strip().lower()
    if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", t):
        raise ValueError(f"must be cpu, cuda, cuda:N or mps, got {text!r}")
    return t


# name -> (parser, default (None: none / computed), help). The flag is --name-with-dashes, env ENCODER_NAME.
OPTIONS: dict[str, tuple[Callable[[str], object], object, str]] = {
    "model": (str, None, "checkpoint directory, hub id, or demo:<family> (tiny random checkpoint)"),
    "revision": (str, None, "hub revision"),
    "device": (_device, None, "cuda if available else cpu"),
    "dtype": (_choice(DTYPES), None, "bfloat16 on GPU, float32 on CPU"),
    "preprocess": (_preprocess, None, "image preprocessing backend: torchvision on CUDA, pil elsewhere; "
                                      "torchvision-nvjpeg decodes JPEGs with nvJPEG (faster, not bit-exact)"),
    "exif_orientation": (parse_bool, "true", "turn a photo upright by its EXIF orientation before preprocessing, "
                                             "as vLLM and transformers' load_image do (images, and video frames "
                                             "given as images); --no-exif-orientation: the pixels as stored, for "
                                             "callers that send them upright"),
    "host": (str, "127.0.0.1", "bind address of both servers"),
    "http_port": (_port, "8000", "0 disables HTTP"),
    "grpc_port": (_port, "50051", "0 disables gRPC"),
    "redis_url": (str, None, "enables the shared Redis tier: redis://host:port/0 (one server, or any node of a "
                              "Redis Cluster), unix:///path, redis+cluster://host:port[,host:port...] (a Cluster), "
                              "redis+sentinel://host:port,host:port/<master name>[/<db>] (the master the Sentinels "
                              "name); rediss://, rediss+cluster://, rediss+sentinel:// for TLS (the ssl_* query "
                              "options only with these)"),
    "redis_ttl_s": (_positive(int), "86400", "backstop TTL of Redis entries"),
    "redis_row_copy_bytes": (_non_negative(parse_size), "0", "entries up to this size also get a copy of their "
                                                            "rows in Redis (0: none; rows go replica to replica)"),
    "advertise_url": (_advertised, None, "http://host:port other replicas reach this one's HTTP port at (default: "
                                         "--host and --http-port; Helm: the pod IP)"),
    "cache_bytes": (_non_negative(parse_size), "4GiB", "in-process host LRU size"),
    "hash": (_choice(HASHES), "blake3", "content hash of image bytes"),
    "lease_s": (_positive(float), "300", "how long an encoded id stays pinned at most: a fetch of all its rows "
                                         "or its release ends the pin sooner"),
    "max_pinned_bytes": (_non_negative(parse_size), None, "bound on pinned entries: images encoded and not yet "
                                                          "fetched in full (half of --cache-bytes)"),
    "cuda_graphs": (parse_bool, None, "capture CUDA graphs (on, GPU only)"),
    "graph_buckets": (parse_buckets, ",".join(map(str, DEFAULT_BUCKETS)), "patch-token buckets"),
    "batch_tokens": (_positive(int), "16384", "patch-token budget of one ViT batch"),
    "max_queue": (_positive(int), "256", "images waiting before 429"),
    "attention": (_choice(ATTENTION), "auto",
                  "attention kernels: auto (the per-layout table), or prefer fa4 / torch"),
    "max_images": (_positive(int), "64", "images per request"),
    "max_body_bytes": (_positive(parse_size), "64MiB", "request body"),
    "max_image_bytes": (_positive(parse_size), "32MiB", "one encoded image"),
    "max_pixels": (_positive(int), str(MAX_PIXELS), "decoded pixels of one image (width x height, checked from "
                                                    "its header before decoding): twice the most the models' own "
                                                    "processors keep (Qwen3-VL 16777216, Qwen2/2.5-VL 12845056; "
                                                    "smart_resize shrinks larger images to that), so 8K frames "
                                                    "and 24 MP photos pass"),
    "max_request_pixels": (_positive(int), str(MAX_REQUEST_PIXELS),
                           "decoded pixels of one request's images together (each counted as sent, from its "
                           "header): the decode work one request may ask for"),
    "max_fetch_bytes": (_positive(parse_size), "4GiB", "rows one fetch gathers from several images or frame groups "
                                                        "over a socket (one item's are not copied; shm writes into "
                                                        "the client's file)"),
    "allow_url_hosts": (parse_hosts, "", "comma-separated hosts url images and videos may name (none: URLs off)"),
    "max_videos": (_positive(int), "4", "videos per request"),
    "max_video_bytes": (_positive(parse_size), "64MiB", "one encoded video (a file, or its frames' images together)"),
    "max_video_duration_s": (_positive(float), "600", "duration of one video, from its header"),
    "max_video_frames": (_positive(int), "768", "sampled frames of one video (what the vision tower gets)"),
    "max_video_source_frames": (_positive(int), "36000", "frames in one video's source (from its header)"),
    "max_video_frame_pixels": (_positive(int), "16777216", "pixels of one source frame (from the header)"),
    "max_video_pixels": (_positive(int), "34359738368", "source frames x width x height of one video: decode work"),
    "max_video_tokens": (_positive(int), "262144", "merged tokens (rows) of one video"),
    "video_containers": (_names(VIDEO_CONTAINERS), ",".join(VIDEO_CONTAINERS),
                         "video containers accepted (FFmpeg demuxers: mov = MP4/MOV, matroska = MKV/WebM)"),
    "video_codecs": (_names(VIDEO_CODECS), ",".join(VIDEO_CODECS), "video codecs accepted"),
    "video_decoder_threads": (_positive(int), "2", "FFmpeg threads per video decoder"),
    "video_window": (_positive(int), "8", "frame groups of one video in the encode queue at once"),
    "auth_token": (str, None, "bearer token for HTTP and gRPC (health stays open)"),
    "log_level": (_choice(LOG_LEVELS), "info", "log level"),
    "access_log": (parse_bool, "false", "log one line per request (transport, method, outcome, seconds, request id)"),
    "shm_fetch": (parse_bool, "false", "let clients on this host fetch rows through shared-memory files"),
    "shm_dir": (str, DEFAULT_SHM_DIR, "directory of those files (client and server must share it)"),
    "ipc_arena_bytes": (_size_or_auto, "auto", "device row arena for fetches by IPC (rows GPU to GPU on this host): "
                                               "auto (a quarter of the GPU memory free after startup, at most "
                                               "8GiB), a size, or 0 (off); always off on a CPU"),
    "ipc_lease_s": (_positive(float), "5", "how long a fetch by IPC holds its rows in the arena at most when its "
                                           "consumer does not acknowledge its copy"),
    "ipc_channel": (_ipc_channel, "auto", "Unix socket for fetches by IPC from this host (a persistent "
                                          "channel beside HTTP): auto (with an arena, in a directory of this "
                                          "uid's alone under the temp dir), off, or an absolute path"),
    "read_timeout_s": (_positive(float), "30", "an HTTP request's head must arrive within this many seconds of its "
                                               "first byte (or of the connection's opening), and its body pause no "
                                               "longer and arrive whole within it plus its length at 64 KiB/s; "
                                               "else the connection is closed (a stalled or trickling body: 408)"),
    "send_threads": (_non_negative(int), "8", "threads that write fetched rows onto HTTP sockets, several "
                                              "fetches at once (0: the event loop writes them)"),
    "sglang_protocol": (parse_bool, "false", "serve SGLang's encoder protocol (--language-only --encoder-urls) "
                                             "on --sglang-port: unauthenticated, private networks only"),
    "sglang_port": (_port, "8100", "port of the SGLang protocol (its /encode, /scheduler_receive_url, /health)"),
}
# On/off options: `--name` / `--no-name` on the command line, a boolean string in the env twin.
_SWITCHES = ("cuda_graphs", "access_log", "shm_fetch", "sglang_protocol", "exif_orientation")


def _url(text: str) -> str:
    if not str(text).startswith(("http://", "https://", "grpc://")):
        raise ValueError(f"must start with http://, https:// or grpc://, got {text!r}")
    return str(text).rstrip("/")


def _http_url(text: str) -> str:
    url = _url(text)
    if url.startswith("grpc://"):
        raise ValueError(f"vLLM speaks HTTP: give http://host:port, got {text!r}")
    return url


# `encoder-service vllm-proxy` (integrations/vllm/proxy.py), as OPTIONS: flag --name-with-dashes, env
# ENCODER_PROXY_NAME.
PROXY_ENV_PREFIX = "ENCODER_PROXY_"
PROXY_OPTIONS: dict[str, tuple[Callable[[str], object], object, str]] = {
    "encoder_url": (_url, None, "encoder service: http://host:port or grpc://host:port (required)"),
    "vllm_url": (_http_url, None, "the vLLM prefill/decode instance: http://host:port (required)"),
    "host": (str, "127.0.0.1", "bind address"),
    "port": (_positive(_port), "8100", "port"),
    "api_key": (str, None, "bearer token the proxy's callers must send (checked before any encode); default: "
                           "none, every caller is served"),
    "auth_token": (str, None, "the encoder service's bearer token (its --auth-token)"),
    "vllm_api_key": (str, None, "bearer token for vLLM (its --api-key); default: the caller's Authorization"),
    "timeout_s": (_positive(float), "600", "timeout of one encode, and of vLLM's answer (read between chunks)"),
    "max_body_bytes": (_positive(parse_size), "64MiB", "a chat request's body (read whole before its encode)"),
    "log_level": (_choice(("critical", "error", "warning", "info", "debug")), "info", "log level"),
}


@dataclass(frozen=True)
class ProxySettings:
    encoder_url: str
    vllm_url: str
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str | None = field(default=None, repr=False)
    auth_token: str | None = field(default=None, repr=False)
    vllm_api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 600.0
    max_body_bytes: int = 64 << 20
    log_level: str = "info"


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, PROXY_OPTIONS, PROXY_ENV_PREFIX)


def resolve_proxy(ns: argparse.Namespace, env: Mapping[str, str]) -> ProxySettings:
    """`encoder-service vllm-proxy`'s settings: flag > env > default (resolve_values); SettingsError naming the
    flag and its env twin."""
    values = resolve_values(ns, env, PROXY_OPTIONS, PROXY_ENV_PREFIX)
    for name in ("encoder_url", "vllm_url"):
        if values[name] is None:
            raise SettingsError(f"{flag(name)} / {env_name(name, PROXY_ENV_PREFIX)} is required")
    return ProxySettings(**{k: v for k, v in values.items() if v is not None})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str, prefix: str = "ENCODER_") -> str:
    return prefix + name.upper()


def add_arguments(parser: argparse.ArgumentParser, options: Mapping, env_prefix: str,
                  switches: Sequence[str] = ()) -> None:
    """One flag per option, kept as a raw string (None when absent) so that env twins and validation go one
    way (`resolve_values`)."""
    for name, (_, default, help_text) in options.items():
        env = env_name(name, env_prefix)
        shown = f" (default {default})" if default not in (None, "") else ""
        if name in switches:
            parser.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{help_text} [env {env}]")
            continue
        parser.add_argument(flag(name), dest=name, default=None, metavar=name.upper(),
                            help=f"{help_text}{shown} [env {env}]")


def resolve_values(ns: argparse.Namespace, env: Mapping[str, str], options: Mapping,
                   env_prefix: str) -> dict[str, object]:
    """Flag > env > default; each value parsed and validated once (None: unset, no default), errors naming
    the flag and its env twin."""
    values: dict[str, object] = {}
    for name, (parse, default, _) in options.items():
        raw, source = getattr(ns, name, None), flag(name)
        env_var = env_name(name, env_prefix)
        if raw is None and env.get(env_var, "") != "":
            raw, source = env[env_var], env_var
        if raw is None:
            raw, source = default, "default"
        if raw is None or isinstance(raw, bool):  # unset, or a switch given on the command line
            values[name] = raw
            continue
        try:
            values[name] = parse(raw)
        except ValueError as e:
            raise SettingsError(f"{flag(name)} / {env_var} ({source}): {e}") from None
    return values


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, OPTIONS, "ENCODER_", _SWITCHES)


def resolve(ns: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    """`encoder-service serve`'s settings: flag > env > default (resolve_values), then the checks across options."""
    return _build(resolve_values(ns, env, OPTIONS, "ENCODER_"))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _build(v: dict) -> Settings:
    if not v["model"]:
        raise SettingsError("--model / ENCODER_MODEL is required (a checkpoint directory, hub id or demo:<family>)")
    device = v["device"] or ("cuda" if _cuda_available() else "cpu")
    on_gpu = device.startswith("cuda")
    dtype = v["dtype"] or ("bfloat16" if on_gpu else "float32")
    preprocess = v["preprocess"] or ("torchvision" if on_gpu else "pil")
    cuda_graphs = on_gpu if v["cuda_graphs"] is None else bool(v["cuda_graphs"]) and on_gpu
    if v["http_port"] == 0 and v["grpc_port"] == 0:
        raise SettingsError("--http-port and --grpc-port are both 0: at least one server must run")
    if v["http_port"] and v["http_port"] == v["grpc_port"]:
        raise SettingsError(f"--http-port and --grpc-port are both {v['http_port']}")
    if v["sglang_protocol"]:
        if v["sglang_port"] == 0:
            raise SettingsError("--sglang-port / ENCODER_SGLANG_PORT is 0: the SGLang protocol needs a port")
        taken = {"--http-port": v["http_port"], "--grpc-port": v["grpc_port"]}
        for name, port in taken.items():
            if port and port == v["sglang_port"]:
                raise SettingsError(f"--sglang-port and {name} are both {port}")
    if v["max_pixels"] > v["max_request_pixels"]:
        raise SettingsError(f"--max-pixels ({v['max_pixels']}) is over --max-request-pixels "
                            f"({v['max_request_pixels']}): no request could carry one such image")
    if v["max_image_bytes"] > v["max_body_bytes"]:
        raise SettingsError(
            f"--max-image-bytes ({v['max_image_bytes']}) is over --max-body-bytes ({v['max_body_bytes']})")
    pinned = v["max_pinned_bytes"] if v["max_pinned_bytes"] is not None else v["cache_bytes"] // 2
    if pinned > v["cache_bytes"]:
        raise SettingsError(f"--max-pinned-bytes ({pinned}) is over --cache-bytes ({v['cache_bytes']})")
    if not os.path.isabs(v["shm_dir"]):
        raise SettingsError(f"--shm-dir / ENCODER_SHM_DIR must be an absolute path, got {v['shm_dir']!r}")
    if v["shm_fetch"]:
        _check_shm_dir(v["shm_dir"])
    if v["redis_url"]:
        try:
            parse_url(v["redis_url"])
        except ValueError as exc:
            raise SettingsError(f"--redis-url / ENCODER_REDIS_URL: {exc}") from None
    return Settings(
        model=ModelSettings(model=v["model"], revision=v["revision"], device=device, dtype=dtype,
                            preprocess=preprocess, exif_orientation=v["exif_orientation"]),
        server=ServerSettings(host=v["host"], http_port=v["http_port"], grpc_port=v["grpc_port"],
                              auth_token=v["auth_token"] or None, log_level=v["log_level"],
                              access_log=v["access_log"], read_timeout_s=v["read_timeout_s"],
                              shm_fetch=v["shm_fetch"], shm_dir=v["shm_dir"], send_threads=v["send_threads"],
                              ipc_arena_bytes=v["ipc_arena_bytes"], ipc_lease_s=v["ipc_lease_s"],
                              ipc_channel=v["ipc_channel"],
                              sglang_protocol=v["sglang_protocol"], sglang_port=v["sglang_port"],
                              advertise_url=v["advertise_url"]),
        cache=CacheSettings(redis_url=v["redis_url"] or None, redis_ttl_s=v["redis_ttl_s"],
                            cache_bytes=v["cache_bytes"], hash=v["hash"], lease_s=v["lease_s"],
                            max_pinned_bytes=pinned, redis_row_copy_bytes=v["redis_row_copy_bytes"]),
        engine=EngineSettings(cuda_graphs=cuda_graphs, graph_buckets=v["graph_buckets"],
                              batch_tokens=v["batch_tokens"], max_queue=v["max_queue"], attention=v["attention"]),
        limits=LimitSettings(max_images=v["max_images"], max_body_bytes=v["max_body_bytes"],
                             max_image_bytes=v["max_image_bytes"], max_pixels=v["max_pixels"],
                             allow_url_hosts=v["allow_url_hosts"], max_fetch_bytes=v["max_fetch_bytes"],
                             max_request_pixels=v["max_request_pixels"]),
        video=VideoSettings(**{name: v[name] for name in _VIDEO_OPTIONS}),
    )


_VIDEO_OPTIONS = [f.name for f in dataclasses.fields(VideoSettings)]


def _check_shm_dir(path: str) -> None:
    """With --shm-fetch, the directory the server opens clients' files in (core/shm_writer.py) must be one it
    can open: said at start-up, naming the flag, rather than when the core is built."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except OSError as exc:
        raise SettingsError(f"--shm-dir / ENCODER_SHM_DIR {path!r} is not a directory this server can open "
                            f"({exc.strerror}); --shm-fetch needs one shared with its clients") from None
