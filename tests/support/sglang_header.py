"""Reads the SGLang push header (api/sglang/header.py) back WITHOUT unpickling: a symbolic walk of exactly
the opcodes that module writes (any other opcode fails). Globals stay (module, name) pairs, REDUCE becomes
("call", global, args), NEWOBJ + BUILD become ("new", class, state). `pickle` is never imported."""

from __future__ import annotations

import struct


class Global(tuple):
    """(module, name) named by STACK_GLOBAL."""


def walk(data: bytes):
    """Evaluate our header's opcodes symbolically: returns ("new", Global, state dict); globals stay names,
    REDUCE becomes ("call", Global, args). Any opcode outside the header's own set fails the test."""
    stack, marks, i = [], [], 0
    assert data[:2] == b"\x80\x04", "protocol 4"
    i = 2
    while True:
        op = data[i:i + 1]
        i += 1
        if op == b"\x8c":
            n = data[i]
            stack.append(data[i + 1:i + 1 + n].decode())
            i += 1 + n
        elif op == b"X":
            (n,) = struct.unpack("<I", data[i:i + 4])
            stack.append(data[i + 4:i + 4 + n].decode())
            i += 4 + n
        elif op == b"K":
            stack.append(data[i])
            i += 1
        elif op == b"M":
            stack.append(struct.unpack("<H", data[i:i + 2])[0])
            i += 2
        elif op == b"J":
            stack.append(struct.unpack("<i", data[i:i + 4])[0])
            i += 4
        elif op == b"\x8a":
            n = data[i]
            stack.append(int.from_bytes(data[i + 1:i + 1 + n], "little", signed=True))
            i += 1 + n
        elif op == b"G":
            stack.append(struct.unpack(">d", data[i:i + 8])[0])
            i += 8
        elif op == b"N":
            stack.append(None)
        elif op == b"\x93":
            name = stack.pop()
            stack.append(Global((stack.pop(), name)))
        elif op in (b")", b"]", b"}"):
            stack.append({b")": (), b"]": [], b"}": {}}[op])
        elif op == b"(":
            marks.append(len(stack))
        elif op in (b"e", b"u"):
            at = marks.pop()
            items, stack[at:] = stack[at:], []
            if op == b"e":
                stack[-1].extend(items)
            else:
                stack[-1].update(zip(items[::2], items[1::2]))
        elif op == b"\x85":
            stack.append((stack.pop(),))
        elif op == b"R":
            args = stack.pop()
            stack.append(("call", stack.pop(), args))
        elif op == b"\x81":
            args = stack.pop()
            stack.append(("new", stack.pop(), args))
        elif op == b"b":
            state = stack.pop()
            stack[-1] = stack[-1][:2] + (state,)
        elif op == b".":
            assert i == len(data) and len(stack) == 1 and not marks
            return stack[0]
        else:
            raise AssertionError(f"unexpected opcode {op!r} at {i - 1}")


def globals_in(value) -> set:
    if isinstance(value, Global):
        return {tuple(value)}
    if isinstance(value, dict):
        return set().union(*(globals_in(v) for v in value.values())) if value else set()
    if isinstance(value, (list, tuple)):
        return set().union(*(globals_in(v) for v in value)) if value else set()
    return set()
