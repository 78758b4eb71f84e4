"""A stand-in for vLLM's OpenAI server, for tests of `encoder-service vllm-proxy` (main suite and the vLLM
tier): it records each chat body it is sent and answers like vLLM. Stdlib only (every venv imports it).

  - `StandInVllm(gap_s=0.0)`: listening on 127.0.0.1 (`.url`) in a thread; `.bodies`, the chat bodies in order;
    `.shutdown()`. A streamed answer is CHUNKS events `gap_s` apart, then `data: [DONE]`. A body whose last
    text is "refuse" gets a 400, as vLLM answers a request it rejects before its engine.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHUNKS = 4  # events of a streamed answer


class StandInVllm(ThreadingHTTPServer):
    def __init__(self, gap_s: float = 0.0):
        self.bodies: list[dict] = []
        self.gap_s = gap_s
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"data": [{"id": "m"}]} if self.path == "/v1/models" else {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.bodies.append(body)
        if body["messages"][-1]["content"][-1].get("text") == "refuse":
            return self._send(400, {"error": {"message": "refused", "code": 400}})
        if not body.get("stream"):
            return self._send(200, {"id": "c", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}]})
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body runs until the connection closes
        for k in range(CHUNKS):
            event = {"id": "c", "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": {"content": str(k)}}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
            time.sleep(self.server.gap_s)
        self.wfile.write(b"data: [DONE]\n\n")
