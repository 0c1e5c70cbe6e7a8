"""The budget within which megalite reads a file from elsewhere: every bound in one place, decided before the
file's bytes are trusted (docs/reliability.md: "Files from elsewhere, within a budget").

A file from elsewhere (a foreign checkpoint's pickles and JSON, an HF folder, a tokenizer, a token file's
description, a model file's metadata) may claim anything in a few bytes: a memo index of 2**27, a tensor of
10**30 elements, 10**6 layers, a 5,000-digit integer, containers nested 10**5 deep. Each claim is checked
against what the file can hold, or against the range its consumer takes, before anything is allocated or
looped over; a claim beyond it is one line naming the file and the field. The readers ask this module:

    FILE_BYTES[kind]                   how large a file of each kind may be before it is read whole
    within(n, kind, where, error)      refuse a file (or a zip record) larger than its kind's budget
    MAX_DEPTH                          containers inside containers, for every JSON and pickle reader (jsonio,
                                       check_pickle): a parser never recurses past it
    check_pickle(data, where, error)   a pickle's claims before it is loaded: memo indices within the file,
                                       integers of at most MAX_INT_BYTES, nesting at most MAX_DEPTH
    number(v, where, error, lo, hi)    an integer field in [lo, hi] (default: a non-negative int64)
    finite(v, where, error)            a float field that is a finite number
    describe(v)                        a value for a message: bounded in length, never recursing, never
                                       printing a 5,000-digit integer
    MAX_COUNT, MAX_SIZE, MAX_INT       the ranges numbers take where they enter (config, manifest, foreign files)
    HOLES                              how far a tokenizer's largest id may lie past the ids it lists

Costs that scale with a file's size are fine (a 10 MB index takes some 10x that to parse); costs that scale
with a number written in it are not: each such number is bounded by the bytes that back it (a chunk's
declared elements by the bytes recorded for it, a layer count by the layers stored, a decompressed size by
the file's own size). This module imports nothing of megalite's: every floor may ask it (the caller passes
the error class to raise).
"""
from __future__ import annotations

import math
import pickletools
import sys

MiB = 1 << 20

# ---------------------------------------------------------------- sizes of files read whole
FILE_BYTES = {
    "json": 16 * MiB,  # a small JSON file: config.json, metadata.json, a token file's .json, tokenizer_config.json
    "tokenizer": 512 * MiB,  # tokenizer.json, vocab.json, merges.txt: the largest real ones are ~35 MB
    "index": 1024 * MiB,  # a DCP .metadata pickle (one entry per chunk: a 405B model's is ~100 MB)
    "pickle": 256 * MiB,  # Megatron's common.pt data.pkl: arguments and small states (its tensors are not read)
    "line": 4096,  # a one-line text file: latest_checkpointed_iteration.txt
}

# ---------------------------------------------------------------- numbers
MAX_DEPTH = 64  # containers inside containers; a manifest needs 7, a DCP index 8, a scheduler's state a few more
MAX_INT_BYTES = 16  # an integer in a pickle (LONG1/LONG4): two's complement bytes, int64 needs 8
MAX_INT = 2**63 - 1  # an integer field of a foreign file: what a C int64 (torch, numpy, safetensors) holds
MAX_COUNT = 2**53 - 1  # steps, intervals, batch sizes, seeds, stored counters: exact in any JSON reader, and a
#                        seed plus a step still fits torch.manual_seed's int64 (a resume re-seeds from seed + step)
MAX_SIZE = 2**31 - 1  # model sizes: a tensor's dims and element counts stay within torch's indexing kernels
MAX_ITERATION_DIGITS = 12  # Megatron's latest_checkpointed_iteration.txt: iter_%07d, far below 10**12 steps
HOLES = 2  # a tokenizer's largest id + 1 may be at most HOLES x the ids it lists (+ SLACK): per-id tables
SLACK = 1024  # (bits per byte, the token dtype) are then sized by the file, not by one id written in it


def within(n: int, kind: str, where: str, error: type) -> int:
    """`n` (a file's or a record's byte count) if it is within FILE_BYTES[kind], else `error` naming `where`."""
    cap = FILE_BYTES[kind]
    if n > cap:
        raise error(f"{where}: {n:,} bytes, more than the {cap:,} megalite reads for such a file "
                    f"(docs/reliability.md: files from elsewhere, within a budget)")
    return n


def number(v, where: str, error: type, lo: int = 0, hi: int = MAX_INT) -> int:
    """`v` if it is an int (not a bool) in [lo, hi], else `error`: `where = <v>, expected an integer in ...`."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise error(f"{where} = {describe(v)}, expected an integer in [{lo}, {hi}]")
    return v


def finite(v, where: str, error: type, positive: bool = False) -> float:
    """`v` as a float if it is a finite number (and > 0 with `positive`), else `error` naming `where`."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float))
    try:
        x = float(v) if ok else math.nan
    except OverflowError:  # an int from 2**1024 - 2**970 up (float() rounds it to 2**1024): not a float at all
        x = math.inf
    if not ok or not math.isfinite(x) or (positive and not x > 0):
        raise error(f"{where} = {describe(v)}, expected a finite{' positive' if positive else ''} number")
    return x


def describe(v, width: int = 60) -> str:
    """`v` for a one-line message: its repr cut to `width` characters, computed without recursing (a nested
    value shows its outer levels) and without printing a huge integer (its size in bits instead)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"an integer of {v.bit_length():,} bits"
    if isinstance(v, (str, bytes)):
        r = repr(v[:width])
    elif isinstance(v, (list, tuple, dict, set, frozenset)):
        opening, closing = {list: "[]", tuple: "()", dict: "{}"}.get(type(v), "{}")
        items = list(v.items())[:4] if isinstance(v, dict) else list(v)[:4]
        parts = [f"{_outer(k)}: {_outer(x)}" for k, x in items] if isinstance(v, dict) else [_outer(x) for x in items]
        r = opening + ", ".join(parts) + (", ..." if len(v) > 4 else "") + closing
    else:
        r = _outer(v)
    r = " ".join(r.split())
    return r if len(r) <= width else r[:width - 3] + "..."


def _outer(v) -> str:
    """One level of `v`: containers as their type and length."""
    if isinstance(v, (list, tuple, dict, set, frozenset)):
        return f"<{type(v).__name__} of {len(v)}>"
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"<an integer of {v.bit_length():,} bits>"
    if isinstance(v, (str, bytes)):
        return repr(v[:40])
    if isinstance(v, (int, float, bool)) or v is None:
        return repr(v)
    kind = getattr(type(v), "kind", None)  # an unpickled Record names the class it stands for
    return f"<{kind or type(v).__name__}>"


# ---------------------------------------------------------------- pickles
def _opcode_table() -> dict:
    """byte -> (action, argument bytes or length code, items taken, items given, argument kind)."""
    special = {"PUT": _PUT, "BINPUT": _PUT, "LONG_BINPUT": _PUT, "MEMOIZE": _MEMOIZE, "GET": _GET,
               "BINGET": _GET, "LONG_BINGET": _GET, "MARK": _MARK, "APPENDS": _MARK_INTO, "SETITEMS": _MARK_INTO,
               "ADDITEMS": _MARK_INTO, "POP_MARK": _POP_MARK, "APPEND": _INTO, "SETITEM": _INTO, "BUILD": _INTO,
               "DUP": _DUP, "POP": _POP, "STOP": _STOP, "INT": _INT, "LONG": _INT, "LONG1": _INT, "LONG4": _INT}
    table = {}
    for op in pickletools.opcodes:
        mark = pickletools.markobject in op.stack_before
        act = special.get(op.name, _BUILD_MARK if mark else _PLAIN)
        table[ord(op.code)] = (act, op.arg.n if op.arg is not None else 0, len(op.stack_before) - 2 * mark,
                               len(op.stack_after), op.arg.name if op.arg is not None else "")
    return table


(_PLAIN, _PUT, _MEMOIZE, _GET, _MARK, _BUILD_MARK, _MARK_INTO, _POP_MARK, _INTO, _DUP, _POP, _STOP,
 _INT) = range(13)
_OPS = _opcode_table()
_LENGTH = {-2: (1, False), -3: (4, True), -4: (4, False), -5: (8, False)}  # pickletools' TAKEN_FROM_ARGUMENT*


def check_pickle(data: bytes, where: str, error: type, depth: int = MAX_DEPTH) -> None:
    """Walk a pickle's opcodes (nothing is built, nothing is called) and refuse, with `error` beginning with
    `where` (the pickle's name: "<file> stores memo index ..."),
    what would cost more than the file's size before any check could see it:

      * a memo index past the opcode's own byte offset: the C unpickler sizes its memo table to the largest
        index (a 9-byte pickle with index 2**27 takes 2 GB); a pickler numbers memo entries 0, 1, 2, ..., one
        per memoized object, so a real pickle's indices never pass its length;
      * an integer of more than MAX_INT_BYTES bytes (a 4,000-digit field);
      * containers nested more than `depth` deep: hashing a deeply nested tuple (a dict key) recurses in C
        without a guard (SIGSEGV), and every reader after the load would recurse too.

    Nesting is followed on the unpickler's own stack, through the memo, so an object referenced many times is
    counted once per level, never expanded. About 0.5 s per 2 MB (pickletools.genops, which decodes every
    argument, takes 5x that). A malformed pickle is left for the loader to refuse in the caller's words."""
    try:
        _scan(data, where, error, depth)
    except (ValueError, IndexError, KeyError, OverflowError):
        if not isinstance(sys.exc_info()[1], error):
            return
        raise


def _scan(data: bytes, where: str, error: type, limit: int) -> None:
    stack: list[int] = []  # the nesting depth of each object on the unpickler's stack
    marks: list[int] = []
    memo: dict[int, int] = {}
    i, end, ops, frombytes = 0, len(data), _OPS, int.from_bytes
    while i < end:
        pos = i
        act, n, before, after, kind = ops[data[i]]  # KeyError: not an opcode (malformed)
        i += 1
        if n > 0:
            arg = frombytes(data[i:i + n], "little") if act == _PUT or act == _GET else 0
            i += n
        elif n == -1:  # up to a newline (protocol 0's text arguments)
            j = data.index(b"\n", i)
            raw, i = data[i:j], j + 1
            if kind == "stringnl_noescape_pair":
                i = data.index(b"\n", i) + 1
            if act == _PUT or act == _GET or act == _INT:
                raw = raw.rstrip(b"L")
                if len(raw) > 40:  # beyond 2**127 in decimal: refused without parsing it
                    raise error(f"{where} holds an integer of {len(raw):,} digits at byte {pos}, "
                                f"expected integers of at most {MAX_INT_BYTES} bytes")
                arg = int(raw) if raw not in (b"00", b"01") else 0
                if act == _INT and (arg if arg >= 0 else ~arg).bit_length() > 8 * MAX_INT_BYTES - 1:  # as LONG1's bytes
                    raise error(f"{where} holds an integer of more than {MAX_INT_BYTES} bytes at byte {pos}, "
                                f"expected integers of at most {MAX_INT_BYTES} bytes")
        elif n < -1:
            width, signed = _LENGTH[n]
            size = frombytes(data[i:i + width], "little", signed=signed)
            i += width
            if act == _INT and size > MAX_INT_BYTES:
                raise error(f"{where} holds an integer of {size:,} bytes at byte {pos}, expected "
                            f"integers of at most {MAX_INT_BYTES} bytes")
            if size < 0 or i + size > end:
                raise ValueError("malformed")
            i += size
        if act == _PLAIN or act == _INT:
            if before:
                got = 1 + max(stack[-before:])
                del stack[-before:]
            else:
                got = 0
            if after == 1:
                stack.append(got)
            elif after:
                stack += [got] * after
            if got > limit:
                _deep(where, pos, limit, error)
        elif act == _GET:
            stack.append(memo.get(arg, 0))
        elif act == _PUT or act == _MEMOIZE:
            idx = len(memo) if act == _MEMOIZE else arg
            if idx > pos:
                raise error(f"{where} stores memo index {describe(idx)} at byte {pos} (a pickler "
                            f"numbers memo entries 0, 1, 2, ...; this index would size the memo table past what "
                            f"the file holds)")
            memo[idx] = stack[-1] if stack else 0
        elif act == _MARK:
            marks.append(len(stack))
        elif act == _BUILD_MARK or act == _MARK_INTO or act == _POP_MARK:
            m = marks.pop() if marks else 0
            got = 1 + max(stack[m:], default=0)
            del stack[m:]
            if act == _MARK_INTO:
                if stack:
                    stack[-1] = got = max(stack[-1], got)
            elif act == _BUILD_MARK:
                stack.append(got)
            if got > limit:
                _deep(where, pos, limit, error)
        elif act == _INTO:  # (container, items...) -> the same container, now holding them
            got = max(stack[-before], 1 + max(stack[1 - before:]))
            del stack[-before:]
            stack.append(got)
            if got > limit:
                _deep(where, pos, limit, error)
        elif act == _DUP:
            stack.append(stack[-1])
        elif act == _POP:
            if marks and marks[-1] == len(stack):
                marks.pop()
            else:
                stack.pop()
        else:  # STOP
            return


def _deep(where: str, pos: int, limit: int, error: type) -> None:
    raise error(f"{where} nests containers more than {limit} deep (at byte {pos}); expected at most "
                f"{limit} levels")
