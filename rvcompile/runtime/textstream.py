"""The text of one generated sequence as its tokens arrive: decoded, cut before the first stop
string, and released only when final (no trailing partial UTF-8 character, nor the possible
start of a stop string)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self.stop = tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.text = ""  # all text so far, cut before a stop string
        self.emitted = 0  # characters of text released

    def add(self, token: int) -> tuple[str, bool]:
        """Append a token; returns (newly final text, whether a stop string was hit)."""
        self.token_ids.append(token)
        self.text, hit = stop_check(self._decode(self.token_ids), self.stop)
        return self._release(self.text if hit else stable_prefix(self.text, self.stop)), hit

    def finish(self) -> str:
        """The text held back so far, released at the end of the sequence."""
        return self._release(self.text)

    def _release(self, final: str) -> str:
        if len(final) <= self.emitted:
            return ""
        piece = final[self.emitted:]
        self.emitted = len(final)
        return piece


def stop_check(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """(text before the earliest stop string, True) or (text, False)."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def stable_prefix(text: str, stop: Sequence[str]) -> str:
    """Text safe to emit: no trailing partial UTF-8 char, nor a possible start of a stop string."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[:len(text) - hold]
