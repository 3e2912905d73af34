"""The text of one generated sequence as its tokens arrive: decoded, cut before the first stop
string, and released only when final (no trailing partial UTF-8 character, nor the possible
start of a stop string).

Decoding is incremental, O(1) per token however long the sequence grows: each token decodes a
short window of the latest tokens twice (with and without the newest ones) and keeps the
difference, as vLLM's detokenizer does. Decoding the window's older tokens too, rather than the
newest token alone, keeps what a decoder does at a text's start (dropping a leading space) or
across tokens (byte-fallback pieces fused into one character) the same as in a decode of the
whole sequence; while the window's decode ends in a partial character (U+FFFD), nothing new is
taken. The text so far always equals `decode(all tokens)` up to that partial end, and `finish`
adds the rest: exactly `decode(all tokens)` (tests/test_textstream.py checks this against whole
decodes on the real tokenizers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

PARTIAL = "\ufffd"  # what a byte-fallback decoder makes of an incomplete UTF-8 sequence


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self.stop = tuple(s for s in stop if s)
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""  # all text so far, cut before a stop string
        self.emitted = 0  # characters of text released
        self._decoded = ""  # decode(token_ids[:read]): the text taken so far, uncut
        self._prefix = 0  # the window starts here: its tokens before `read` are already taken
        self._read = 0

    def add(self, token: int) -> tuple[str, bool]:
        """Append a token; returns (newly final text, whether a stop string was hit)."""
        self.token_ids.append(token)
        self._take(final=False)
        searched = max(0, len(self.text) - self._longest_stop)
        self.text, hit = stop_check(self._decoded, self.stop, searched)
        return self._release(self.text if hit else stable_prefix(self.text, self.stop)), hit

    def finish(self) -> str:
        """The text held back so far, released at the end of the sequence."""
        self._take(final=True)
        self.text, _ = stop_check(self._decoded, self.stop)
        return self._release(self.text)

    def _take(self, final: bool) -> None:
        """Extend _decoded by the window's new text and move the window on, unless that text
        ends in a partial character (the next token may complete it) and the sequence goes on.
        A token that decodes to nothing (a special token) moves the window on too."""
        window = self.token_ids[self._prefix:]
        before = self._decode(window[:self._read - self._prefix]) if self._read > self._prefix \
            else ""
        now = self._decode(window)
        if (now.endswith(PARTIAL) and not final) or len(now) < len(before):
            return
        self._decoded += now[len(before):]
        self._prefix, self._read = self._read, len(self.token_ids)

    def _release(self, final: str) -> str:
        if len(final) <= self.emitted:
            return ""
        piece = final[self.emitted:]
        self.emitted = len(final)
        return piece


def stop_check(text: str, stop: Sequence[str], start: int = 0) -> tuple[str, bool]:
    """(text before the earliest stop string, True) or (text, False). `start`: where a stop
    string may begin at the earliest (the text before it was checked already)."""
    cut = min((i for i in (text.find(s, start) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def stable_prefix(text: str, stop: Sequence[str]) -> str:
    """Text safe to emit: no trailing partial UTF-8 char, nor a possible start of a stop string."""
    text = text.rstrip(PARTIAL)
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[:len(text) - hold]
