"""Builds the core from settings and runs HTTP (uvicorn) and gRPC on one asyncio loop (and, with
--sglang-protocol, SGLang's encoder protocol on its own port: api/sglang/).

    service = Service(settings); await service.start(); ...; await service.stop()
Used by the CLI (serve until SIGTERM) and by the tests (tests/support/service.py). The model loads on a
worker thread so the loop stays responsive; readiness turns true only after the warm-up encode.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING

import uvicorn

from encoder_service.api.pickup import Pickups
from encoder_service.api.read_timeouts import head_timeout_protocol
from encoder_service.api.requests import install_log_ids
from encoder_service.api.socket_send import SocketSend
from encoder_service.api.uvicorn_internals import UvicornServer
from encoder_service.core import EncoderCore
from encoder_service.core.metrics import Metrics
from encoder_service.settings import PortUnavailable, Settings, format_size

if TYPE_CHECKING:
    from encoder_service.replicas import RedisTier

log = logging.getLogger("encoder_service")

# How long an idle HTTP keep-alive connection stays open. Longer than clients keep theirs (httpx 5 s,
# aiohttp 15 s, Go 90 s): at uvicorn's default of 5 s a client reusing a connection at the moment the server
# closes it gets a ReadError (seen once in 13600 sessions of benchmarks/soak.py). Idle connections cost a
# socket each, bounded by the clients' pools.
HTTP_KEEP_ALIVE_S = 120


def build_core(settings: Settings, *, loaded=None, ipc_memory=None) -> EncoderCore:
    """Load the model (unless `loaded` is given), make the runner, the device row arena (once the graphs are
    captured: it is sized from the memory left), the store, the Redis tier and the core (not started).
    `ipc_memory(nbytes)`: the arena's memory instead of cudaMalloc (the CPU tests' host stand-in,
    encoder_service/testing/host_ipc.py)."""
    from encoder_service.cache import EmbeddingStore
    from encoder_service.models.loader import load_model
    from encoder_service.preprocessing import PreprocessConfig
    from encoder_service.runtime.arena_memory import make_arena
    from encoder_service.runtime.runner import make_runner

    m, e, c = settings.model, settings.engine, settings.cache
    if loaded is None:
        loaded = load_model(m.model, device=m.device, dtype=m.dtype, revision=m.revision)
    runner = make_runner(loaded, cuda_graphs=e.cuda_graphs, buckets=list(e.graph_buckets), attention=e.attention)
    srv = settings.server
    arena = make_arena(loaded.device, srv.ipc_arena_bytes, srv.ipc_lease_s, memory=ipc_memory)
    cfg = PreprocessConfig.from_checkpoint(loaded.checkpoint_dir, loaded.spec)
    store = EmbeddingStore(c.cache_bytes, lease_s=c.lease_s, max_pinned_bytes=c.max_pinned_bytes)
    return EncoderCore(settings, loaded=loaded, runner=runner, preprocess_cfg=cfg, store=store,
                       redis=redis_tier(settings), metrics=Metrics(), ipc_arena=arena)


def redis_tier(settings: Settings) -> RedisTier | None:
    """The Redis tier replicas share (replicas/redis_tier.py: RedisTier, not started), or None without
    --redis-url: the replica is alone."""
    from encoder_service.replicas import RedisOptions, RedisTier

    c = settings.cache
    if not c.redis_url:
        return None
    return RedisTier(c.redis_url, RedisOptions(ttl_s=c.redis_ttl_s, row_copy_bytes=c.redis_row_copy_bytes))


def advertised_url(host: str, port: int) -> str | None:
    """Where other replicas reach the HTTP port bound at host:port (--advertise-url overrides it): a wildcard
    host (0.0.0.0, ::) is this machine's address as its name resolves; None when that fails."""
    if host in ("0.0.0.0", "::", ""):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            return None
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (port 0: the OS picks one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for an explicit TCP
    # protocol; without it Nagle + delayed ACK added ~40 ms to every response on a reused connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


class Service:
    def __init__(self, settings: Settings, *, core: EncoderCore | None = None, http_sock: socket.socket | None = None,
                 sglang_sock: socket.socket | None = None):
        install_log_ids()  # log records name the request they were written for (api/requests.py)
        self.settings = settings
        self.core = core
        self._http_sock = http_sock
        self._sglang_sock = sglang_sock
        self._http: UvicornServer | None = None
        self._http_task: asyncio.Task | None = None
        self._socket_send: SocketSend | None = None
        self._sglang: UvicornServer | None = None
        self._sglang_task: asyncio.Task | None = None
        self._sglang_protocol = None
        self._grpc = None
        self._grpc_health = None
        self._ipc_channel = None  # api/ipc_channel.py, with an arena and --ipc-channel not off
        self.http_address: str | None = None
        self.grpc_address: str | None = None
        self.sglang_address: str | None = None

    async def start(self) -> None:
        s = self.settings
        t0 = time.perf_counter()
        if s.server.sglang_protocol:  # before the model loads: a missing pyzmq fails at once
            from encoder_service.api.sglang import require_zmq

            require_zmq()
        self._bind_ports()  # before the model loads too: a taken port fails at once, in one line
        if self.core is None:
            self.core = await asyncio.to_thread(build_core, s)
        load_s = time.perf_counter() - t0
        http = self._http_sock is not None  # bound above: the address other replicas fetch rows at is known
        if http:
            self.core.advertise(s.server.advertise_url or advertised_url(*self._http_sock.getsockname()[:2]))
        await self.core.start()
        # Rows gRPC fetches leave for their clients to read over HTTP (api/pickup.py): with both ports only.
        pickups = Pickups() if http and s.server.grpc_port else None
        if http:
            await self._start_http(pickups)
            await self._start_ipc_channel()
        if s.server.grpc_port:
            from encoder_service.api import grpc_server

            http_port = int(self.http_address.rsplit(":", 1)[1]) if pickups is not None else None
            self._grpc, self._grpc_health = await grpc_server.start(self.core, s, pickups, http_port)
            self.grpc_address = f"{s.server.host}:{s.server.grpc_port}"
        if s.server.sglang_protocol:
            await self._start_sglang()
        log.info("%s", startup_summary(self, load_s=load_s, total_s=time.perf_counter() - t0))

    def _bind_ports(self) -> None:
        """The HTTP and SGLang sockets (unless given), and a check that gRPC's port is free (gRPC binds its own
        once the core exists); PortUnavailable when one is taken."""
        s = self.settings.server
        bound = []
        try:
            if s.http_port and self._http_sock is None:
                self._http_sock = self._bind("http_port")
                bound.append(self._http_sock)
            if s.sglang_protocol and self._sglang_sock is None:
                self._sglang_sock = self._bind("sglang_port")
                bound.append(self._sglang_sock)
            if s.grpc_port:
                self._bind("grpc_port").close()
        except PortUnavailable:
            for sock in bound:
                sock.close()
            raise

    def _bind(self, name: str) -> socket.socket:
        s = self.settings.server
        try:
            return bind_socket(s.host, getattr(s, name))
        except OSError as exc:
            raise PortUnavailable.of(name, s.host, getattr(s, name), exc) from None

    async def _start_http(self, pickups: Pickups | None) -> None:
        from encoder_service.api.http import create_app

        s = self.settings.server
        sock = self._http_sock
        self._socket_send = SocketSend(create_app(self.core, pickups), s.send_threads)
        self._http, self._http_task, self.http_address = await self._serve(self._socket_send, sock, "HTTP")

    async def _start_ipc_channel(self) -> None:
        """The same-host channel of fetches by IPC, named in /v1/metadata once it listens."""
        from encoder_service.api.ipc_channel import IpcChannel, channel_path

        s = self.settings.server
        path = channel_path(s.ipc_channel, *self._http_sock.getsockname()[:2], self.core.ipc.arena is not None)
        if path is None:
            return
        channel = IpcChannel(self.core, path, s.auth_token, access_log=s.access_log)
        if await channel.start():
            self._ipc_channel, self.core.ipc.channel = channel, path

    async def _start_sglang(self) -> None:
        """SGLang's encoder protocol on its own port (unauthenticated: SGLang sends no credentials)."""
        from encoder_service.api.sglang import SGLangProtocol

        s = self.settings.server
        sock = self._sglang_sock
        self._sglang_protocol = SGLangProtocol(self.core)
        self._sglang, self._sglang_task, self.sglang_address = await self._serve(
            self._sglang_protocol.app, sock, "SGLang protocol")
        if s.auth_token:
            log.warning("--auth-token does not cover the SGLang protocol port %s (SGLang sends no credentials): "
                        "keep it on a private network", self.sglang_address)

    async def _serve(self, app, sock: socket.socket, name: str) -> tuple[UvicornServer, asyncio.Task, str]:
        """uvicorn serving `app` on `sock`, started (listening) on this loop: (server, its task, its URL)."""
        s = self.settings.server
        config = uvicorn.Config(app, lifespan="off", log_level=s.log_level, access_log=False,
                                timeout_graceful_shutdown=10, timeout_keep_alive=HTTP_KEEP_ALIVE_S, log_config=None,
                                http=head_timeout_protocol(s.read_timeout_s))
        server = UvicornServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"uvicorn {name}")
        listening = asyncio.create_task(server.listening.wait())
        await asyncio.wait([task, listening], return_when=asyncio.FIRST_COMPLETED)
        if not listening.done():  # serve() ended before listening: surface its error
            listening.cancel()
            await task
            raise RuntimeError(f"{name} server exited during startup")
        host, port = sock.getsockname()[:2]
        return server, task, f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"

    @property
    def threaded_sends(self) -> bool:
        return self._socket_send is not None and self._socket_send.active

    @property
    def rows_written_by(self) -> str:
        """Who writes fetched rows onto HTTP sockets (the startup summary, the benchmarks' setup)."""
        return f"{self.settings.server.send_threads} threads" if self.threaded_sends else "the event loop"

    async def wait_closed(self) -> None:
        """Returns when a server exits by itself (it should not) — the CLI races this with SIGTERM."""
        tasks = [t for t in (self._http_task, self._sglang_task) if t is not None]
        if tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
        elif self._grpc is not None:
            await self._grpc.wait_for_termination()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Report not ready, stop taking requests, let in-flight ones finish (up to grace_s), then stop the
        core. Readiness goes first so gRPC Health says NOT_SERVING (and /health/ready 503) during the grace."""
        if self.core is not None:
            self.core.drain()
        channel = None  # the IPC channel takes nothing new from now on; its fetches in flight end within grace_s
        if self._ipc_channel is not None:
            self.core.ipc.channel = None
            channel = asyncio.create_task(self._ipc_channel.stop(grace_s))
        if self._grpc_health is not None:
            await self._grpc_health.enter_graceful_shutdown()  # open Health.Watch streams hear it now
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        for server in (self._http, self._sglang):
            if server is not None:
                server.should_exit = True
        for task in (self._http_task, self._sglang_task):
            if task is not None:
                await task
        if channel is not None:
            await channel
        if self._socket_send is not None:
            self._socket_send.close()
        if self._sglang_protocol is not None:
            await self._sglang_protocol.close()
        if self.core is not None:
            await self.core.stop()


def startup_summary(service: Service, *, load_s: float, total_s: float) -> str:
    s, core = service.settings, service.core
    spec = core.spec
    tiers = [f"host LRU {format_size(s.cache.cache_bytes)} (pinned <= {format_size(s.cache.max_pinned_bytes)})"]
    if s.cache.redis_url:
        tiers.append(f"Redis (ttl {s.cache.redis_ttl_s}s)")
    memory = ""
    device = str(core.loaded.device)
    if device.startswith("cuda"):
        import torch

        memory = f", GPU memory allocated {format_size(torch.cuda.memory_allocated(core.loaded.device))}"
    runner = core.runner.describe()
    return "\n  ".join([
        f"encoder_service ready in {total_s:.1f}s (model load {load_s:.1f}s)",
        f"model: {s.model.model} family={spec.family} model_type={spec.model_type} fingerprint={core.model_fp}",
        f"device: {device} dtype={core.dtype} runner={runner.get('runner', '?')}{memory}",
        f"rows: width {spec.row_width} layout {spec.layout}",
        f"batching: batch_tokens={s.engine.batch_tokens} buckets={list(core.runner.buckets) or 'none (eager)'} "
        f"max_queue={s.engine.max_queue}",
        f"cache: {', '.join(tiers)}; hash {s.cache.hash}; lease {s.cache.lease_s:g}s",
        f"limits: max_images={s.limits.max_images} max_body={format_size(s.limits.max_body_bytes)} "
        f"max_image={format_size(s.limits.max_image_bytes)} max_pixels={s.limits.max_pixels} "
        f"max_request_pixels={s.limits.max_request_pixels} read_timeout={s.server.read_timeout_s:g}s "
        f"url_hosts={','.join(s.limits.allow_url_hosts) or 'off'}",
        f"http: {service.http_address or 'off'} (rows written by {service.rows_written_by})  "
        f"grpc: {service.grpc_address or 'off'}  "
        f"auth: {'bearer token' if s.server.auth_token else 'off'}",
        "sglang protocol: " + (f"{service.sglang_address} (unauthenticated: private network only)"
                               if service.sglang_address else "off"),
        "shm fetch (rows into clients' shared-memory files, this host): " + (
            f"on, files in {s.server.shm_dir}" if s.server.shm_fetch else "off (--shm-fetch)"),
        "ipc fetch (rows GPU to GPU, consumers on this host, HTTP): " + (
            f"device row arena {format_size(ipc['arena_bytes'])} on {ipc['device']}, hold lease {ipc['lease_s']:g}s, "
            f"channel {ipc['channel'] or 'off'}" if (ipc := core.ipc.metadata()) else "off"),
    ])
