"""What `--redis-url` names: one Redis server, a Redis Cluster, or a master watched by Sentinels.

    redis://h:p/0, rediss://..., unix://...      one server, or a node of a Cluster (which, is asked at
                                                 connect: replicas/redis_connections.py)
    redis+cluster://h:p[,h:p...]                 a Cluster, said so (any of its nodes)
    redis+sentinel://[user:pass@]h:p[,h:p...]/<master name>[/<db>]
                                                 the master the Sentinels name; a failover is followed
    (rediss+cluster, rediss+sentinel: TLS; Sentinel query options: ssl_ca_certs, ssl_certfile, ssl_keyfile,
     ssl_cert_reqs, sentinel_username, sentinel_password; user:pass@ is the master's; the ssl_* options only
     with TLS, on every form)

Parsed once where settings are read (a bad URL stops the start with a clear message) and again by the tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

STANDALONE, CLUSTER, SENTINEL = "standalone", "cluster", "sentinel"
_SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")


@dataclass(frozen=True)
class RedisTarget:
    """What `--redis-url` names: its kind (None: one server or a Cluster node, asked at connect), where, and
    the connection options (password, TLS) redis-py takes."""

    kind: str | None
    url: str  # redis:// or rediss:// for redis-py's from_url (standalone, Cluster); "" for Sentinel
    nodes: tuple[tuple[str, int], ...] = ()  # Cluster nodes or Sentinels given
    master: str = ""  # Sentinel: the master's name
    options: dict = field(default_factory=dict)  # Sentinel: the master's connection options
    sentinel_options: dict = field(default_factory=dict)

    @property
    def shown(self) -> str:
        """Where, without credentials (logs, health)."""
        if self.kind == SENTINEL:
            return "sentinel " + ",".join(f"{h}:{p}" for h, p in self.nodes) + f"/{self.master}"
        parts = urlsplit(self.url)
        if self.kind == CLUSTER:  # its url is the first node's, for redis-py: the scheme says TLS or not
            return f"{parts.scheme}+cluster://" + ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"


def parse_url(url: str) -> RedisTarget:
    """The target of a `--redis-url`; ValueError naming what is wrong."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    base, _, kind = scheme.partition("+")
    if base not in ("redis", "rediss", "unix") or kind not in ("", CLUSTER, SENTINEL) or \
            (base == "unix" and kind):
        raise ValueError(f"a redis URL starts with redis://, rediss:// or unix:// (one server or a Cluster node), "
                         f"redis+cluster:// or redis+sentinel://host:port,host:port/<master name>, not "
                         f"{parts.scheme + '://' if parts.scheme else repr(_redacted(url)[:40])}")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    tls_asked = sorted(set(query) & set(_SSL_OPTIONS))
    if tls_asked and base != "rediss":  # redis-py passes them to a plain connection: a TypeError at connect
        raise ValueError(f"redis URL option(s) {', '.join(tls_asked)} are for TLS: give them with rediss"
                         f"{'+' + kind if kind else ''}://, or leave them out")
    if not kind:
        if base != "unix":
            try:
                parts.port  # redis-py reads it only at connect
            except ValueError:
                raise ValueError(f"redis URL {_redacted(url)!r}: the port must be a number in 0-65535") from None
        return RedisTarget(None, url)
    nodes = tuple(_host_port(hp, url) for hp in parts.netloc.rpartition("@")[2].split(",") if hp)
    if not nodes:
        raise ValueError(f"redis URL {_redacted(url)!r} names no host:port")
    if kind == CLUSTER:
        userinfo = parts.netloc.rpartition("@")[0]
        first = f"{base}://{userinfo + '@' if userinfo else ''}{nodes[0][0]}:{nodes[0][1]}{parts.path}"
        return RedisTarget(CLUSTER, first + (f"?{parts.query}" if parts.query else ""), nodes)
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not (path[1].isascii() and path[1].isdigit())):
        raise ValueError(f"redis URL {_redacted(url)!r}: a Sentinel URL ends in /<master name>[/<db>]")
    unknown = set(query) - {*_SSL_OPTIONS, "sentinel_username", "sentinel_password"}
    if unknown:
        raise ValueError(f"redis URL option(s) {', '.join(sorted(unknown))} not known for a Sentinel URL")
    tls = {k: query[k] for k in _SSL_OPTIONS if k in query}
    if base == "rediss":
        tls["ssl"] = True
    options = dict(tls, db=int(path[1]) if len(path) == 2 else 0)
    if parts.username:
        options["username"] = unquote(parts.username)
    if parts.password:
        options["password"] = unquote(parts.password)
    sentinel_options = dict(tls)
    for key in ("username", "password"):
        if f"sentinel_{key}" in query:
            sentinel_options[key] = query[f"sentinel_{key}"]
    return RedisTarget(SENTINEL, "", nodes, path[0], options, sentinel_options)


def _host_port(text: str, url: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise ValueError(f"redis URL {_redacted(url)!r}: {text!r} is not host:port (a port in 0-65535)")
    return host.strip("[]"), int(port)


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    return url.replace(parts.password, "***") if parts.password else url
