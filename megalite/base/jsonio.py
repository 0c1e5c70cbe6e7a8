"""JSON that megalite reads and writes beside tensors: a parser with a depth bound, the check that a user's
value is plain JSON, and an exact codec for Python state that plain JSON would change.

    loads(data, where, error)      parse; nesting deeper than MAX_DEPTH (or than Python's parser can go) is
                                   `error` naming `where`, never a RecursionError; with `kind`, a text larger
                                   than limits.FILE_BYTES[kind] is refused before it is parsed
    plain_problem(value, where)    None, or one line naming the first part of `value` that is not plain JSON
                                   (a dict with a non-string key, a tuple, NaN, an object, too deep)
    encode(value, where) / decode  a value of dicts (any hashable JSON keys), Counters, lists, tuples, strings,
                                   numbers (inf and NaN too), booleans and None as JSON, and back exactly:
                                   a scheduler's state_dict (MultiStepLR's milestones are a Counter of ints)

Plain JSON would turn Counter({30: 1}) into {"30": 1} (a milestone that never matches the epoch again) and a
tuple into a list; `encode` writes such values as {"__py__": "Counter", "items": [[30, 1]]} and `decode`
gives back the same types. A dict that has a "__py__" key of its own is written in the items form too, so
no user value is ever taken for a tagged one. Only this module knows the tags.
"""
from __future__ import annotations

import json
import math
from collections import Counter, OrderedDict

from .errors import MegaliteError
from .limits import MAX_DEPTH, within

TAG = "__py__"


def depth_over(value, limit: int = MAX_DEPTH) -> int:
    """The nesting depth of `value` (containers inside containers), or limit + 1 once it passes `limit`.
    Level by level without recursion, so any depth is measured safely."""
    level, depth = [value], 0
    while True:
        nxt = []
        for v in level:
            t = type(v)
            if t is dict or isinstance(v, dict):
                nxt += v.values()
            elif t is list or isinstance(v, (list, tuple)):
                nxt += v
        if not nxt:
            return depth
        depth += 1
        if depth > limit:
            return depth
        level = nxt


def loads(data, where: str, error: type = MegaliteError, limit: int = MAX_DEPTH, kind: str | None = None):
    """`data` (bytes or str) parsed as JSON. Not JSON, or nested more than `limit` deep: `error` (a one-line
    message naming `where`). Python's parser recurses, so deeply nested input would otherwise raise
    RecursionError (not a user error) before any check could look at it. `kind` (limits.FILE_BYTES): the
    text's size budget, checked before parsing (a parse costs ~10x the text)."""
    if kind is not None:
        within(len(data), kind, where, error)
    try:
        value = json.loads(data)
    except RecursionError:
        raise error(f"{where}: JSON nested more than {limit} levels deep") from None  # same line at any recursion limit
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise error(f"{where} is not valid JSON ({e})") from None
    if depth_over(value, limit) > limit:
        raise error(f"{where}: JSON nested more than {limit} levels deep")
    return value


def _walk(value, at: str, depth: int, limit: int):
    """(path, problem) of the first part of `value` that is not plain JSON, else None (iteratively)."""
    stack = [(value, at, depth)]
    while stack:
        v, path, d = stack.pop()
        if d > limit:
            return path, f"is nested more than {limit} levels deep"
        t = type(v)
        if v is None or t in (bool, int, str):
            continue
        if t is float:
            if not math.isfinite(v):
                return path, f"is {v} (JSON has no NaN or infinity)"
            continue
        if t is dict:
            for k, x in v.items():
                if type(k) is not str:
                    return path, f"has the key {k!r} ({type(k).__name__}; JSON keys are strings)"
                stack.append((x, f"{path}.{k}", d + 1))
            continue
        if t is list:
            stack += [(x, f"{path}[{i}]", d + 1) for i, x in enumerate(v)]
            continue
        return path, f"is a {t.__name__} ({_short(v)}); expected a JSON value (object, list, string, number, " \
                     f"true/false, null)"
    return None


def plain_problem(value, where: str, limit: int = MAX_DEPTH - 2):
    """One line naming the first part of `value` that JSON would not carry unchanged, else None."""
    got = _walk(value, where, 0, limit)
    return None if got is None else f"{got[0]} {got[1]}"


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


# ---------------------------------------------------------------- the exact codec
class NotEncodable(MegaliteError, ValueError):
    """A value the codec cannot carry (a function, a tensor, an object): the message names where it is."""


def encode(value, where: str, limit: int = MAX_DEPTH - 2):
    """`value` as JSON that `decode` turns back into an equal value of the same types (see the module doc)."""
    return _encode(value, where, 0, limit)


def _encode(v, at: str, depth: int, limit: int):
    if depth > limit:
        raise NotEncodable(f"{at} is nested more than {limit} levels deep")
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return v if math.isfinite(v) else {TAG: "float", "value": repr(v)}
    if t is list:
        return [_encode(x, f"{at}[{i}]", depth + 1, limit) for i, x in enumerate(v)]
    if t is tuple:
        return {TAG: "tuple", "items": [_encode(x, f"{at}[{i}]", depth + 2, limit) for i, x in enumerate(v)]}
    if t in (dict, Counter, OrderedDict):
        if t is dict and TAG not in v and all(type(k) is str for k in v):
            return {k: _encode(x, f"{at}.{k}", depth + 1, limit) for k, x in v.items()}
        items = []
        for k, x in v.items():
            if type(k) not in (str, int, float, bool, tuple) and k is not None:
                raise NotEncodable(f"{at} has the key {_short(k)} ({type(k).__name__})")
            items.append([_encode(k, f"{at} key {_short(k)}", depth + 3, limit),
                          _encode(x, f"{at}[{_short(k)}]", depth + 3, limit)])
        return {TAG: t.__name__, "items": items}
    raise NotEncodable(f"{at} is a {t.__module__}.{t.__qualname__} ({_short(v)}): only dicts, Counters, lists, "
                       f"tuples, strings, numbers, booleans and None are checkpointed")


_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_MAPS = {"dict": dict, "Counter": Counter, "OrderedDict": OrderedDict}


def decode(value, where: str, error: type = MegaliteError):
    """The value `encode` wrote (plain JSON decodes to itself); a malformed tag is `error` naming `where`."""
    t = type(value)
    if t is list:
        return [decode(x, f"{where}[{i}]", error) for i, x in enumerate(value)]
    if t is not dict:
        return value
    if TAG not in value:
        return {k: decode(x, f"{where}.{k}", error) for k, x in value.items()}
    kind = value[TAG]
    if kind == "float" and set(value) == {TAG, "value"} and value["value"] in _FLOATS:
        return _FLOATS[value["value"]]
    items = value.get("items")
    if set(value) != {TAG, "items"} or not isinstance(items, list):
        raise error(f"{where}: {_short(value)} is not a value megalite wrote (expected {{\"{TAG}\": kind, "
                    f"\"items\": [...]}})")
    if kind == "tuple":
        return tuple(decode(x, f"{where}[{i}]", error) for i, x in enumerate(items))
    if kind in _MAPS and all(isinstance(kv, list) and len(kv) == 2 for kv in items):
        out = _MAPS[kind]()
        for k, x in items:
            key = decode(k, f"{where} key", error)
            try:
                out[key] = decode(x, f"{where}[{_short(key)}]", error)
            except TypeError:  # an unhashable key (a list)
                raise error(f"{where}: key {_short(key)} is not hashable") from None
        return out
    raise error(f"{where}: {_short(value)} is not a value megalite wrote (unknown kind {kind!r} or items not "
                f"[key, value] pairs)")
