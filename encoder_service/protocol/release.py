"""What a release answers, on both ends: how many ids had a pin to drop, and the ids it could not read
(malformed: no encode answered them), each with why. One bad id never fails the others' release. The HTTP JSON
`{"released": n, "invalid": [{"id", "reason"}]}` (`to_json` / `from_json`); the gRPC ReleaseResponse:
grpc_messages.py, `release_to_proto` / `release_from_proto`."""

from __future__ import annotations

from dataclasses import dataclass

# An id is echoed in `invalid` cut to this many characters: a valid one is far shorter, and a request's ids are
# bounded in count, not in length (only by the body limit), so the answer stays small.
ECHO_CHARS = 200


@dataclass(frozen=True)
class InvalidId:
    id: str  # as sent, its first ECHO_CHARS characters
    reason: str

    @classmethod
    def of(cls, public_id: str, reason: str) -> InvalidId:
        return cls(public_id[:ECHO_CHARS], reason)


@dataclass(frozen=True)
class Released:
    released: int  # ids that had a pin to drop (unknown, expired or released ones count 0)
    invalid: tuple[InvalidId, ...] = ()  # malformed ids, in the order sent (each distinct one once): not released

    def to_json(self) -> dict:
        return {"released": self.released, "invalid": [{"id": i.id, "reason": i.reason} for i in self.invalid]}

    @classmethod
    def from_json(cls, d: dict) -> Released:
        """From the HTTP JSON (a server that predates `invalid` answers without it)."""
        return cls(int(d["released"]), tuple(InvalidId(i["id"], i["reason"]) for i in d.get("invalid", ())))
