"""Gemma 4's tool calls, read out of generated text as OpenAI `tool_calls`.

Gemma 4 writes a call as `<|tool_call>call:NAME{key:value,...}<tool_call|>` (its chat template
renders calls in the history the same way, models/rv-gemma4-tiny/chat_template.jinja): keys bare
or quoted, strings between `<|"|>` marks (or JSON strings), numbers, true, false, null, and
nested `{...}` and `[...]`. Only text between the two markers is a candidate, so text that
merely looks like a call (`call:f{...}` without them, JSON in a code block) stays text. A
candidate becomes a call when it parses completely, names a declared tool and, without
`parallel_tool_calls`, is the first call; anything else is given back as text, markers and all,
never an error. An unterminated call at the end of the output is text too.

`CallStream` does this incrementally, text piece by text piece as the engine produces it,
holding back only what may still become a call (a possible start of `<|tool_call>`, or a call
not closed yet); `parse_message` runs the same stream over a whole text, so streamed and whole
answers agree. Arguments come out as the JSON text of an object.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_NAME = re.compile(r"call:([A-Za-z0-9_-]{1,64})")
_KEY = re.compile(r"[A-Za-z0-9_$.-]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_WORDS = {"true": True, "false": False, "null": None}
_MAX_DEPTH = 64  # deeper nesting is refused as malformed, not run into a RecursionError


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" and 24 hex digits
    name: str  # a declared tool's name
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Piece:
    """One step of a parsed answer: text or a call (exactly one is set)."""

    text: str = ""
    call: ToolCall | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _Malformed(ValueError):
    pass


class _Reader:
    """Recursive descent over Gemma 4's argument syntax."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def take(self, token: str) -> bool:
        self.space()
        if self.text.startswith(token, self.at):
            self.at += len(token)
            return True
        return False

    def string(self) -> str | None:
        """A `<|"|>`-quoted or JSON string at the cursor, or None if there is none."""
        self.space()
        if self.text.startswith(QUOTE, self.at):
            end = self.text.find(QUOTE, self.at + len(QUOTE))
            if end < 0:
                raise _Malformed("an unterminated string")
            value, self.at = self.text[self.at + len(QUOTE):end], end + len(QUOTE)
            return value
        if self.text.startswith('"', self.at):
            try:
                value, self.at = json.JSONDecoder().raw_decode(self.text, self.at)
            except json.JSONDecodeError as e:
                raise _Malformed("a bad JSON string") from e
            return value
        return None

    def value(self, depth: int) -> object:
        if depth > _MAX_DEPTH:
            raise _Malformed("nested too deeply")
        text = self.string()
        if text is not None:
            return text
        if self.take("{"):
            return self.mapping(depth + 1)
        if self.take("["):
            items: list = []
            if self.take("]"):
                return items
            while True:
                items.append(self.value(depth + 1))
                if self.take("]"):
                    return items
                if not self.take(","):
                    raise _Malformed("expected , or ] in a list")
        word = _KEY.match(self.text, self.at)
        if word and word.group() in _WORDS:
            self.at = word.end()
            return _WORDS[word.group()]
        number = _NUMBER.match(self.text, self.at)
        if number:
            self.at = number.end()
            value = json.loads(number.group())
            if isinstance(value, float) and not math.isfinite(value):
                raise _Malformed("a number out of range")
            return value
        raise _Malformed(f"no value at {self.at}")

    def mapping(self, depth: int) -> dict:
        """The rest of a `{...}` whose `{` was taken."""
        out: dict = {}
        if self.take("}"):
            return out
        while True:
            key = self.string()
            if key is None:
                self.space()
                match = _KEY.match(self.text, self.at)
                if not match:
                    raise _Malformed(f"no key at {self.at}")
                key, self.at = match.group(), match.end()
            if key in out:
                raise _Malformed(f"the key {key!r} twice")
            if not self.take(":"):
                raise _Malformed("expected : after a key")
            out[key] = self.value(depth)
            if self.take("}"):
                return out
            if not self.take(","):
                raise _Malformed("expected , or } in a mapping")


def parse_call(body: str, names: frozenset[str]) -> tuple[str, dict] | None:
    """`body`, the text between the call markers, as (name, arguments); None unless it is one
    complete call of a tool in `names`."""
    match = _NAME.match(body)
    if not match or match.group(1) not in names:
        return None
    reader = _Reader(body)
    reader.at = match.end()
    try:
        if not reader.take("{"):
            return None
        arguments = reader.mapping(1)
    except _Malformed:
        return None
    reader.space()
    return (match.group(1), arguments) if reader.at == len(body) else None


class CallStream:
    """An answer's text, fed piece by piece, as text and calls (see the module docstring)."""

    def __init__(self, names: frozenset[str], parallel: bool,
                 new_id: Callable[[], str] = new_call_id):
        self.names, self.parallel, self.new_id = names, parallel, new_id
        self.calls = 0  # calls given out so far
        self._held = ""  # text not given out yet
        self._in_call = False  # _held is the body of a call opened by OPEN

    def feed(self, text: str) -> list[Piece]:
        self._held += text
        out: list[Piece] = []
        while True:
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    return out
                body, self._held = self._held[:end], self._held[end + len(CLOSE):]
                self._in_call = False
                out.append(self._call(body))
            else:
                start = self._held.find(OPEN)
                if start < 0:
                    keep = _partial_suffix(self._held, OPEN)
                    ready, self._held = self._held[:len(self._held) - keep], \
                        self._held[len(self._held) - keep:]
                    if ready:
                        out.append(Piece(text=ready))
                    return out
                if start:
                    out.append(Piece(text=self._held[:start]))
                self._held = self._held[start + len(OPEN):]
                self._in_call = True

    def finish(self) -> list[Piece]:
        """What is still held at the end of the answer, as text (an unterminated call too)."""
        rest = (OPEN if self._in_call else "") + self._held
        self._held, self._in_call = "", False
        return [Piece(text=rest)] if rest else []

    def _call(self, body: str) -> Piece:
        parsed = parse_call(body, self.names) if self.parallel or not self.calls else None
        if parsed is None:
            return Piece(text=OPEN + body + CLOSE)
        self.calls += 1
        name, arguments = parsed
        return Piece(call=ToolCall(self.new_id(), name, json.dumps(arguments,
                                                                    ensure_ascii=False)))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass(frozen=True)
class Message:
    content: str | None  # None when the answer is only calls (and space)
    calls: tuple[ToolCall, ...]


def parse_message(text: str, names: frozenset[str], parallel: bool,
                  new_id: Callable[[], str] = new_call_id) -> Message:
    """A whole answer as content and calls, as CallStream gives them."""
    stream = CallStream(names, parallel, new_id)
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p.text for p in pieces)
    calls = tuple(p.call for p in pieces if p.call is not None)
    return Message(None if calls and not content.strip() else content, calls)
