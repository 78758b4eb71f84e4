"""`encoder-service serve ...`: HTTP and gRPC over one core, in one process on one asyncio loop.
`encoder-service vllm-proxy ...`: the chat front end for vLLM (encoder_service/integrations/vllm/proxy.py).

`--model demo:<family>` builds a tiny random checkpoint under ./.demo/<family> (testing/tiny.py) once and
serves it. SIGTERM / SIGINT stop both servers gracefully (in-flight requests finish), then the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Sequence

from encoder_service.settings import (
    PortUnavailable,
    Settings,
    SettingsError,
    add_proxy_arguments,
    add_serve_arguments,
    resolve,
    resolve_proxy,
)

log = logging.getLogger("encoder_service")

DEMO_PREFIX = "demo:"


def resolve_demo_model(settings: Settings, root: Path = Path(".demo")) -> Settings:
    """demo:<family> -> a tiny checkpoint under root/<family> (built on first use); others unchanged."""
    model = settings.model.model
    if not model.startswith(DEMO_PREFIX):
        return settings
    from encoder_service.testing.tiny import build_tiny_checkpoint

    family = model[len(DEMO_PREFIX):]
    path = root / family
    if not (path / "config.json").exists():
        log.info("building tiny random %s checkpoint under %s", family, path)
        try:
            build_tiny_checkpoint(family, path)
        except (KeyError, ValueError) as exc:
            raise SettingsError(f"--model {model}: cannot build a demo checkpoint: {exc}") from None
    return dataclasses.replace(settings, model=dataclasses.replace(settings.model, model=str(path.resolve())))


async def serve(settings: Settings) -> None:
    from encoder_service.api.service import Service

    service = Service(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
        closed = asyncio.create_task(service.wait_closed())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([closed, stopping], return_when=asyncio.FIRST_COMPLETED)
        if closed.done() and not stopping.done():
            stopping.cancel()
            closed.result()  # re-raise if the HTTP server died
            log.error("the HTTP server exited on its own; shutting down")
        else:
            log.info("signal received: shutting down gracefully")
    finally:
        await service.stop()
        log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="encoder-service", description="Vision-encoder service for Qwen-VL")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="run the HTTP and gRPC servers"))
    add_proxy_arguments(sub.add_parser(
        "vllm-proxy", help="OpenAI chat front end for vLLM with EncoderServiceConnector (docs/vllm.md)"))
    ns = parser.parse_args(argv)
    if ns.command == "vllm-proxy":
        try:
            proxy_settings = resolve_proxy(ns, os.environ)
        except SettingsError as exc:
            parser.error(str(exc))
        logging.basicConfig(level=proxy_settings.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from encoder_service.integrations.vllm import proxy

        proxy.serve(proxy_settings)
        return 0
    try:
        settings = resolve(ns, os.environ)
    except SettingsError as exc:
        parser.error(str(exc))
    from encoder_service.api.requests import install_log_ids

    install_log_ids()  # every line names the request it was written for ("-" outside requests)
    level = settings.server.log_level.upper()
    logging.basicConfig(level=logging.DEBUG if level == "TRACE" else level,
                        format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
    try:
        settings = resolve_demo_model(settings)
        asyncio.run(serve(settings))
    except PortUnavailable as exc:  # one line saying what to change: no usage text, no traceback
        print(f"encoder-service serve: error: {exc}", file=sys.stderr)
        return 1
    except SettingsError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
