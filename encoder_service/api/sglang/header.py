"""Frame 0 of SGLang's embedding push, written opcode by opcode: never `pickle`, never unpickling.

SGLang 0.5.23's language side reads frame 0 with `safe_pickle_loads` (its SafeUnpickler, an exact
(module, name) allow-list, sglang/srt/utils/common.py) into an `EmbeddingData`
(sglang/srt/disaggregation/encoder/receiver.py), then `torch.frombuffer(frame 1, dtype).reshape(shape)`.
This module writes the pickle protocol-4 stream of that object by hand. The only globals it names are
allow-listed there:

    sglang.srt.disaggregation.encoder.receiver  EmbeddingData    the class (EMPTY_TUPLE, NEWOBJ, then BUILD)
    sglang.srt.multimodal.modality              Modality         Modality(1) = IMAGE (REDUCE)
    torch                                       bfloat16 | float16 | float32   the dtype object

Everything else is str / int / float / None / list. No memo opcodes, no FRAME (both optional in protocol 4).
A VIDEO part carries what SGLang's language side needs for video (receiver.py `_GENERAL_VIDEO_META_ATTRS`,
read by its Qwen-VL processor's `get_mm_data`): `video_timestamps` (Qwen3-VL: per video, its frame groups'
times in seconds, a list of floats) or `second_per_grid_ts` (Qwen2/2.5-VL: a float per video); both None
for images, as SGLang's own encoder sends them.
`EmbeddingData.__dict__` after `copy_without_embedding()` (what SGLang's own encoder pickles) has these keys
in this order; `send_time` must be present (the receiver reads it without a default), `error_code` must be
a plain int (http.HTTPStatus is not allow-listed), and `grid_dim` travels as a list [[t, h, w], ...]
(the receiver's `_cat_grid` turns it into the same int64 tensor SGLang's encoder sends).

tests/unit/test_sglang_protocol.py checks the bytes against a golden stream and walks the opcodes (without
unpickling); tests/engines/sglang/ unpickles them with SGLang's own SafeUnpickler and compares the object
with the one SGLang's own encoder pickles.
"""

from __future__ import annotations

import struct
from typing import Mapping, Sequence

# Pickle protocol-4 opcodes (the names of CPython's Lib/pickle.py).
PROTO, STOP, MARK = b"\x80", b".", b"("
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE = b"}", b"]", b")"
SETITEMS, APPENDS, BUILD, NEWOBJ, REDUCE, TUPLE1 = b"u", b"e", b"b", b"\x81", b"R", b"\x85"
NONE, SHORT_BINUNICODE, BINUNICODE, STACK_GLOBAL = b"N", b"\x8c", b"X", b"\x93"
BININT1, BININT2, BININT, LONG1, BINFLOAT = b"K", b"M", b"J", b"\x8a", b"G"

EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.multimodal.modality", "Modality")
MODALITIES = {"IMAGE": 1, "VIDEO": 2, "AUDIO": 3}  # Modality(Enum) values (auto())
DTYPES = ("bfloat16", "float16", "float32")  # ("torch", name) pairs of the allow-list that we send
# The aux attributes SGLang's encoder sets for every model (`_build_mm_aux_data`): None for images.
AUX_ATTRS = ("video_timestamps", "second_per_grid_ts")


def allowed_globals() -> frozenset[tuple[str, str]]:
    """Every (module, name) a header from this module can name (a subset of SGLang's allow-list)."""
    return frozenset({EMBEDDING_DATA, MODALITY} | {("torch", d) for d in DTYPES})


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) < 256:
        return SHORT_BINUNICODE + bytes([len(b)]) + b
    return BINUNICODE + struct.pack("<I", len(b)) + b


def _int(v: int) -> bytes:
    if isinstance(v, bool) or not isinstance(v, int):  # the receiver rejects bools for num_parts / part_idx
        raise TypeError(f"expected an int, got {type(v).__name__}")
    if 0 <= v < 256:
        return BININT1 + bytes([v])
    if 0 <= v < 65536:
        return BININT2 + struct.pack("<H", v)
    if -(2**31) <= v < 2**31:
        return BININT + struct.pack("<i", v)
    n = (v.bit_length() + 8) // 8
    return LONG1 + bytes([n]) + v.to_bytes(n, "little", signed=True)


def _value(v) -> bytes:
    """None, a float, or a list of them (nested): a video part's metadata."""
    if v is None:
        return NONE
    if isinstance(v, float):
        return BINFLOAT + struct.pack(">d", v)
    if isinstance(v, list):
        return EMPTY_LIST + (MARK + b"".join(_value(x) for x in v) + APPENDS if v else b"")
    raise TypeError(f"expected None, a float or a list, got {type(v).__name__}")


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + STACK_GLOBAL


def _int_list(values: Sequence[int]) -> bytes:
    return EMPTY_LIST + MARK + b"".join(_int(int(v)) for v in values) + APPENDS


def _modality(name: str) -> bytes:
    if name not in MODALITIES:
        raise ValueError(f"modality must be one of {sorted(MODALITIES)}, got {name!r}")
    return _global(*MODALITY) + _int(MODALITIES[name]) + TUPLE1 + REDUCE


def _embedding_data(fields: list[tuple[str, bytes]]) -> bytes:
    """EmbeddingData.__new__(EmbeddingData), then BUILD with the __dict__ (its keys in SGLang's order)."""
    body = _global(*EMBEDDING_DATA) + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + MARK
    body += b"".join(_str(key) + value for key, value in fields)
    return PROTO + b"\x04" + body + SETITEMS + BUILD + STOP


def _part(req_id: str, num_parts: int, part_idx: int) -> list[tuple[str, bytes]]:
    if not isinstance(req_id, str) or not req_id:
        raise ValueError("req_id must be a non-empty string")
    if not 0 <= part_idx < num_parts:
        raise ValueError(f"part_idx must be in [0, {num_parts}), got {part_idx}")
    return [("req_id", _str(req_id)), ("num_parts", _int(num_parts)), ("part_idx", _int(part_idx))]


def embedding_header(req_id: str, num_parts: int, part_idx: int, grid_thw: Sequence[Sequence[int]],
                     shape: Sequence[int], dtype: str, modality: str = "IMAGE", *,
                     aux: Mapping[str, list | None] | None = None) -> bytes:
    """Frame 0 of a part's embeddings. Frame 1 must be exactly shape[0] * shape[1] elements of `dtype`:
    the C-contiguous rows [num_tokens, row_width] of every item of the part, in mm_items order.
    `req_id`, `num_parts` and `part_idx` are the /encode request's, echoed unchanged. `aux`: values of
    AUX_ATTRS (a video part's metadata; the others None)."""
    aux = dict(aux or {})
    if set(aux) - set(AUX_ATTRS):
        raise ValueError(f"aux attributes are {AUX_ATTRS}, got {sorted(aux)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if len(shape) != 2:
        raise ValueError(f"shape must be [num_tokens, row_width], got {list(shape)}")
    rows = EMPTY_LIST + MARK
    for thw in grid_thw:
        if len(thw) != 3:
            raise ValueError(f"a grid row is [t, h, w], got {list(thw)}")
        rows += _int_list(thw)
    rows += APPENDS
    fields = _part(req_id, num_parts, part_idx) + [
        ("grid_dim", rows), ("modality", _modality(modality)), ("embedding", NONE), ("send_time", NONE),
        ("dtype", _global("torch", dtype)), ("shape", _int_list(shape)), ("_mr_ptr", NONE),
        ("error_msg", NONE), ("error_code", NONE),
    ]
    return _embedding_data(fields + [(name, _value(aux.get(name))) for name in AUX_ATTRS])


def error_header(req_id: str, num_parts: int, part_idx: int, message: str, code: int,
                 modality: str = "IMAGE") -> bytes:
    """A part's failure, sent as a single frame: the receiver fails the request with (message, code)."""
    fields = _part(req_id, num_parts, part_idx) + [
        ("grid_dim", NONE), ("modality", _modality(modality)), ("embedding", NONE), ("send_time", NONE),
        ("dtype", NONE), ("shape", NONE), ("_mr_ptr", NONE), ("error_msg", _str(message)),
        ("error_code", _int(int(code))),
    ]
    return _embedding_data(fields)
