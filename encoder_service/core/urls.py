"""URL images (and videos): fetched only from allow-listed hosts (off by default), bounded in size and time.

Redirects are followed by hand, at most a few, and only to the same host; the body is streamed and
counted so an oversized answer is refused without reading it all.
"""

from __future__ import annotations

from urllib.parse import urljoin, urlsplit

import httpx

from encoder_service.errors import InvalidInput, LimitExceeded, Unavailable

MAX_REDIRECTS = 3


class UrlFetcher:
    def __init__(self, allow_hosts: tuple[str, ...], *, max_bytes: int, timeout_s: float = 10.0,
                 what: str = "image"):
        self.what = what  # what the URLs name, in messages: "image 2: ..." or "video 0: ..."
        self.allow_hosts = frozenset(h.lower() for h in allow_hosts)
        self.max_bytes = max_bytes
        self._timeout = httpx.Timeout(timeout_s)
        self._client: httpx.AsyncClient | None = None

    def _check(self, url: str, index: int) -> str:
        if not self.allow_hosts:
            raise InvalidInput(f"{self.what} {index}: url {self.what}s are disabled (set --allow-url-hosts)")
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        if parts.scheme not in ("http", "https") or not host:
            raise InvalidInput(f"{self.what} {index}: url must be http(s)://host/..., got {url!r:.200}")
        if host not in self.allow_hosts:
            raise InvalidInput(f"{self.what} {index}: url host {host!r} is not in --allow-url-hosts")
        return host

    async def fetch(self, url: str, index: int) -> bytes:
        host = self._check(url, index)
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, follow_redirects=False)
        for _ in range(MAX_REDIRECTS + 1):
            try:
                async with self._client.stream("GET", url) as resp:
                    if resp.is_redirect:
                        target = urljoin(url, resp.headers.get("location", ""))
                        if (urlsplit(target).hostname or "").lower() != host:
                            raise InvalidInput(f"{self.what} {index}: url redirects to another host ({target!r:.200})")
                        self._check(target, index)
                        url = target
                        continue
                    if resp.status_code != 200:
                        raise InvalidInput(f"{self.what} {index}: GET {url!r:.200} answered HTTP {resp.status_code}")
                    declared = int(resp.headers.get("content-length") or 0)
                    if declared > self.max_bytes:
                        raise LimitExceeded(f"{self.what} {index}: url body bytes", declared, self.max_bytes)
                    body = bytearray()
                    async for piece in resp.aiter_bytes():
                        body += piece
                        if len(body) > self.max_bytes:
                            raise LimitExceeded(f"{self.what} {index}: url body bytes", f"over {len(body)}",
                                                self.max_bytes)
                    return bytes(body)
            except httpx.TimeoutException:
                raise Unavailable(f"{self.what} {index}: GET {url!r:.200} timed out") from None
            except httpx.HTTPError as exc:
                raise InvalidInput(f"{self.what} {index}: GET {url!r:.200} failed: {exc}") from None
        raise InvalidInput(f"{self.what} {index}: url redirected more than {MAX_REDIRECTS} times")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
