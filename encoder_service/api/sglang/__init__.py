"""SGLang's encoder-server protocol: an unmodified SGLang 0.5.23 language server started with
`--language-only --encoder-urls http://<this host>:<--sglang-port>` uses this service as its encoder.

Off by default (`--sglang-protocol`); when on, a third server (uvicorn, its own port) runs on the same loop
as HTTP and gRPC, over the same core. Modules: http.py (the endpoints and the /encode flow), session.py
(per-part state: registrations before or after /encode, bounded), push.py (the ZMQ PUSH), header.py (the
push header, written by hand from allow-listed globals: nothing here pickles or unpickles). docs/sglang.md
has the deployment; the port is unauthenticated (SGLang sends no credentials) and belongs on a private
network.
"""

from __future__ import annotations

from encoder_service.settings import SettingsError

INSTALL_HINT = "pip install 'pyzmq>=25.1.2' (in a checkout of this repository: pip install -e '.[sglang]')"


def require_zmq() -> None:
    """Fail at startup, before the model loads, when --sglang-protocol is on without pyzmq."""
    try:
        import zmq
        import zmq.asyncio  # noqa: F401
    except ImportError as exc:
        raise SettingsError(f"--sglang-protocol / ENCODER_SGLANG_PROTOCOL needs pyzmq, which is not importable "
                            f"({exc}): {INSTALL_HINT}") from None


class SGLangProtocol:
    """The app with its part table and pusher; `close()` after the server stopped."""

    def __init__(self, core):
        from encoder_service.api.sglang.http import create_app
        from encoder_service.api.sglang.push import Pusher
        from encoder_service.api.sglang.session import Sessions

        self.sessions = Sessions()
        self.pusher = Pusher()
        self.app = create_app(core, self.sessions, self.pusher)

    async def close(self) -> None:
        await self.pusher.close()
