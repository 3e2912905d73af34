"""A small, explicit JSON validator: `At(value, path)` reads one typed, range-checked value at a
time and names the JSON path in every error, e.g.

    manifest.xla.kv.block_size: expected an int >= 1, got -3

`parse_json` turns bytes into JSON values with every way that can fail (bad UTF-8, bad syntax,
NaN, nesting deep enough to exhaust the stack) as one `SchemaError`. The artifact schemas
(`manifest.py`, `kernel_schedule.py`, `contents.py`) are written with it; they build frozen
dataclasses from what it returns, so nothing after them reads raw JSON.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

INT64_MAX = (1 << 63) - 1
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
FLOAT32_MAX = 3.4028234663852886e38


class SchemaError(ValueError):
    """A value that breaks a schema; the message is 'path: what is wrong' on one line."""


def parse_json(data: bytes | str, where: str) -> Any:
    """JSON text (UTF-8 bytes or str) -> value; SchemaError naming `where` on any failure."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray | memoryview) else data
        return json.loads(text, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise SchemaError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise SchemaError(f"{where}: not JSON ({e.msg} at line {e.lineno} column {e.colno})"
                          ) from None
    except RecursionError:
        raise SchemaError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # NaN / Infinity, and int strings past Python's digit limit
        raise SchemaError(f"{where}: not valid JSON ({e})") from None


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def describe(value: Any) -> str:
    """A short rendering of a JSON value for error messages."""
    if isinstance(value, dict):
        return f"an object with {len(value)} keys"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _range(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    return "" if hi is None else f" <= {hi}"


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.:+-]{1,80}")


class At:
    """A JSON value and where it sits: `At(doc, "manifest")` for a root, `at["key"]`,
    `at.get("key")`, `at.items()` and `at.members()` for what is inside. The path is put
    together only for an error (a schedule holds hundreds of thousands of values)."""

    __slots__ = ("value", "_parent", "_key")

    def __init__(self, value: Any, path: str, parent: At | None = None) -> None:
        self.value = value
        self._parent = parent  # None for a root, whose `path` is its name
        self._key: str | int = path

    def _child(self, value: Any, key: str | int) -> At:
        child = object.__new__(At)  # the hot path: no __init__ call
        child.value, child._parent, child._key = value, self, key
        return child

    @property
    def path(self) -> str:
        """Dotted for plain keys, else quoted: a key from a damaged file may hold anything,
        newlines included."""
        key = self._key
        if self._parent is None:
            return str(key)
        if isinstance(key, int):
            return f"{self._parent.path}[{key}]"
        if _PLAIN_KEY.fullmatch(key):
            return f"{self._parent.path}.{key}"
        return f"{self._parent.path}[{describe(key)}]"

    def fail(self, what: str) -> NoReturn:
        raise SchemaError(f"{self.path}: {what}")

    def expected(self, what: str) -> NoReturn:
        self.fail(f"expected {what}, got {describe(self.value)}")

    # -- containers

    def obj(self) -> dict[str, Any]:
        if not isinstance(self.value, dict):
            self.expected("an object")
        return self.value

    def __getitem__(self, key: str) -> At:
        """A required member of an object."""
        d = self.obj()
        if key not in d:
            self.fail(f"missing required key {key!r}")
        return self._child(d[key], key)

    def get(self, key: str) -> At | None:
        """An optional member of an object; None when absent."""
        d = self.obj()
        return self._child(d[key], key) if key in d else None

    def members(self, max_len: int = INT64_MAX) -> dict[str, At]:
        """An object's members in order."""
        d = self.obj()
        if len(d) > max_len:
            self.expected(f"an object of at most {max_len} keys")
        return {k: self._child(v, k) for k, v in d.items()}

    def items(self, min_len: int = 0, max_len: int = INT64_MAX) -> list[At]:
        """A list's elements."""
        if not isinstance(self.value, list):
            self.expected("a list")
        if not min_len <= len(self.value) <= max_len:
            want = (f"exactly {min_len}" if min_len == max_len
                    else f"{min_len} to {max_len}" if max_len < INT64_MAX
                    else f"at least {min_len}")
            self.expected(f"a list of {want} elements")
        return [self._child(v, i) for i, v in enumerate(self.value)]

    # -- scalars

    def int(self, lo: int | None = None, hi: int | None = INT64_MAX) -> int:
        v = self.value
        if (not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo)
                or (hi is not None and v > hi)):
            self.expected("an int" + _range(lo, hi))
        return v

    def number(self, lo: float = -math.inf, hi: float = math.inf) -> float:
        """An int or a finite float in [lo, hi]."""
        v = self.value
        if (not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v)
                or not lo <= v <= hi):
            self.expected("a finite number" + _range(None if lo == -math.inf else lo,
                                                     None if hi == math.inf else hi))
        return float(v)

    def bool(self) -> bool:
        if not isinstance(self.value, bool):
            self.expected("true or false")
        return self.value

    def str(self, choices: tuple[str, ...] | None = None, pattern: str | None = None,
            max_len: int = 4096, printable: bool = False) -> str:
        """`printable`: no newlines or other control characters (a name errors may quote)."""
        v = self.value
        if not isinstance(v, str) or len(v) > max_len:
            self.expected(f"a string of at most {max_len} characters")
        if printable and not v.isprintable():
            self.expected("a printable string")
        if choices is not None and v not in choices:
            self.expected(f"one of {', '.join(repr(c) for c in choices)}")
        if pattern is not None and not re.fullmatch(pattern, v):
            self.expected(f"a string matching {pattern}")
        return v

    def sha256(self) -> str:
        return self.str(pattern="[0-9a-f]{64}")

    def nullable(self) -> At | None:
        """None for JSON null, else self."""
        return None if self.value is None else self
