"""The shape of a checkpoint's `manifest.json`, checked before anything reads it (stdlib).

A manifest that parses is not yet one hpcshard wrote: a list, `"files": null` or a size in
a string (a hand edit, another tool, a file system that returned someone else's bytes)
made every reader fail with a traceback: `ckpt list`, `status`, each node's health check
at every attempt, and rank 0's choice of the checkpoint to resume while every other rank
waited for it. `problem` says what is wrong with one; the store (`store.inspect`) takes
such a checkpoint for a corrupt one, as it does a manifest that does not parse, and hands
no reader its content. Keys this version does not know are left alone (a newer
hpcshard's); the ones it reads must have the type it reads them as.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive(value: Any) -> bool:
    return _count(value) and value > 0


def _number(value: Any) -> bool:
    """A finite number (Python's json reads `NaN` and `1e999`; `store.age` cannot)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _object(value: Any) -> bool:
    return isinstance(value, dict)


def _mesh(value: Any) -> bool:
    return isinstance(value, list) and all(map(_positive, value))


def _data(value: Any) -> bool:
    """The data fingerprint (`runtime.data`), whose sources are compared one by one."""
    sources = value.get("sources", []) if isinstance(value, dict) else None
    return isinstance(sources, list) and all(map(_object, sources))


SHAPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format": (_count, "a whole number"),
    "step": (_count, "a step number"),
    "bytes": (_count, "a count of bytes"),
    "world": (_positive, "a count of ranks"),
    "nodes": (_positive, "a count of nodes"),
    "per_node": (_positive, "a count of ranks"),
    "tp": (_positive, "a degree"),
    "frozen": (_count, "a count"),
    "mesh": (_mesh, "a list of degrees"),
    "time": (_number, "seconds since the epoch"),
    "save_seconds": (_number, "seconds"),
    "sharding": (_text, "text"),
    "config_hash": (_text, "text"),
    "torch": (_text, "text"),
    "reason": (_text, "text"),
    "frozen_from": (_text, "text"),
    "config": (_object, "an object"),
    "data": (_data, "an object whose sources are objects"),
}
"""What each key the readers use must be, where it is present. `extra` (your own loop's
values) is handed back as it was saved: any JSON."""
REQUIRED = ("step", "files")


def problem(raw: Any) -> str:
    """What is wrong with the shape of a parsed manifest, in a few words; "" when nothing."""
    if not isinstance(raw, dict):
        return f"{_kind(raw)}, not an object"
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    files = raw["files"]
    if not isinstance(files, dict):
        return f"'files' is {_kind(files)}, not an object of file names and sizes"
    for name, size in files.items():
        if not _count(size):
            return f"'files' gives {name!r} the size {_short(size)}, not a count of bytes"
    for key, (fits, what) in SHAPES.items():
        if key in raw and not fits(raw[key]):
            return f"{key!r} is {_short(raw[key])}, not {what}"
    return ""


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {list: "a list", str: "a string", bool: "a boolean", dict: "an object"}.get(
        type(value), "a number")


def _short(value: Any) -> str:
    """`value` as JSON would show it, cut short (a manifest's value may be anything)."""
    text = "null" if value is None else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
