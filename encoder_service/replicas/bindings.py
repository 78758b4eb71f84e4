"""Caller ids' bindings to one content, decided in Redis by one script per id (directory.py says why an id
names one content on every replica).

    BIND.command(binding, location, marker, tag=..., ttl_px=..., again=False, grace_s=3) -> ("evalsha", ...)
    parse_bound(reply) -> BOUND tag | RECOVERING | RETIRED

A binding is first come first served, but "first" is not only the binding key: Redis may have lost it
(evicted by allkeys-lru, or a restart) while the id's rows or its claim still say which content it names.
So the script, atomically on the id's Redis node:

  1. the binding there: that is the answer (its TTL refreshed);
  2. else the content tag the id's *location* carries (the header of the rows a replica holds), else the one
     its *pending marker* carries (an encode under way): the binding is written again to that tag, and that
     is the answer (a request with other bytes is then a Conflict, whoever asked);
  3. else, on a Redis node the asking replica does not know (`known_nodes`: the run ids its heartbeat saw; an
     unknown one restarted, or is a replica promoted by a failover, since the heartbeat last looked), or
     while the asking replica's own grace after a recovery runs (`known_nodes` = NO_NODE), nothing is bound:
     RECOVERING (the encode answers 503, the clients retry; the replica looks at Redis at once). The replicas
     holding ids write their bindings again meanwhile. A holder writing its own binding again (`again`)
     is never refused;
  4. else the request's tag is bound.

A *retired* id (RETIRED, the binding's value `retired`) is one Redis lost everything about while a replica
held it, and that was then sent with other bytes elsewhere: two contents exist under it on two replicas, and
no fetch can say which its caller meant. Every replica drops it, and it names nothing until the retirement
expires (binding_writes.py: `retire`): both callers get a 404 or a 409, never the other's rows.
"""

from __future__ import annotations

from encoder_service.cache.entry import HEADER_LEN
from encoder_service.replicas.redis_connections import LuaScript

RETIRED_VALUE = b"retired"
# The content tag inside an entry header (entry.py's _FIELDS: magic 4, version 2, dtype 1, checksum 1, six u32,
# layout 24 bytes, then content_tag as a little-endian u64) and the header version that has it.
_TAG_OFFSET = 56
_HEADER_VERSION = 2

_BIND_SOURCE = f"""
local bound = redis.call('GET', KEYS[1])
if bound then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return bound
end
local found = nil
local location = redis.call('GET', KEYS[2])
if location then
  local sp = string.find(location, ' ', 1, true)
  if sp and #location - sp >= {HEADER_LEN} and string.byte(location, sp + 5) == {_HEADER_VERSION}
      and string.byte(location, sp + 6) == 0 then
    local hex = {{}}
    for i = 8, 1, -1 do hex[#hex + 1] = string.format('%02x', string.byte(location, sp + {_TAG_OFFSET} + i)) end
    found = table.concat(hex)
  end
end
if not found or found == '0000000000000000' then
  local marker = redis.call('GET', KEYS[3])
  found = marker and string.match(marker, '^pending (%x+)') or nil
end
if found == '0000000000000000' then found = nil end
if not found and ARGV[3] ~= '1' and ARGV[4] ~= '' then
  local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
  if not run_id or not string.find(ARGV[4], run_id, 1, true) then return false end
end
local value = found or ARGV[1]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return value
"""


BIND = LuaScript(_BIND_SOURCE)


class Recovering:
    """The id's Redis node came up moments ago and nothing there says what the id names yet."""


RECOVERING = Recovering()
RETIRED = -1  # a retired id's "tag": every request's bytes conflict with it (keys.py: other_content)


NO_NODE = "!"  # matches no run id: every new binding waits
# The run id of the Redis node holding KEYS[1] (a script runs where its keys live: in a Cluster, that node).
NODE_RUN_ID = LuaScript("return string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')")


def bind_command(binding: str, location: str, marker: str, *, tag: int, ttl_px: int, again: bool,
                 known_nodes: str) -> tuple:
    """`known_nodes`: the run ids the replica knows, joined ("" checks none)."""
    return BIND.command((binding, location, marker), (b"%016x" % tag, ttl_px, "1" if again else "0", known_nodes))


def parse_bound(reply: bytes | None) -> int | Recovering:
    """The tag an id is bound to (RETIRED for a retired id), or RECOVERING."""
    if reply is None:
        return RECOVERING
    if reply == RETIRED_VALUE:
        return RETIRED
    try:
        return int(reply, 16) or RETIRED
    except ValueError:  # not a binding of ours: nobody can say what the id names
        return RETIRED
