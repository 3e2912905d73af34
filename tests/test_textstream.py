"""runtime/textstream.py: the incremental detokenizer releases, token by token, exactly what
decoding the whole sequence each time releases (the O(n^2) rule it replaced, kept here as the
reference), on the embedded default model's tokenizer and on the synthetic one of a
random-weights build, through the runtime's decode (special tokens hidden, tool-call markers
kept): random ids, byte-fallback pieces of multi-byte characters, special tokens, stop strings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from rvcompile.runtime.model import text_decoder
from rvcompile.runtime.textstream import TextStream, stable_prefix, stop_check
from rvcompile.sources.tokenizer_files import synthetic_tokenizer

DEFAULT_TOKENIZER = Path(__file__).parents[1] / "models" / "rv-gemma4-tiny" / "tokenizer.json"
TEXTS = ("Grüße aus Köln — 東京 🚀🎉 naïve café, ½ ≤ ∞", "def f(x):\n    return x ** 2  # ok",
         "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|> done.")
STOPS = ((), ("\n",), ("END", "ab"), ("é", "🚀"), ("return",))


class WholeDecode:
    """The reference: decode every token so far at each step (the rule before incremental
    decoding), same cut and hold-back."""

    def __init__(self, decode, stop):
        self.decode, self.stop, self.ids, self.emitted = decode, tuple(s for s in stop if s), [], 0

    def add(self, token):
        self.ids.append(token)
        text, hit = stop_check(self.decode(self.ids), self.stop)
        return self._release(text if hit else stable_prefix(text, self.stop)), hit

    def finish(self):
        return self._release(stop_check(self.decode(self.ids), self.stop)[0])

    def _release(self, final):
        piece = final[self.emitted:] if len(final) > self.emitted else ""
        self.emitted = max(self.emitted, len(final))
        return piece


def sequences(tok: Tokenizer, rng: random.Random) -> list[list[int]]:
    vocab = tok.get_vocab_size()
    special = list(tok.get_added_tokens_decoder())
    out = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    for _ in range(12):
        n = rng.randrange(1, 120)
        ids = [rng.randrange(vocab) for _ in range(n)]
        for _ in range(rng.randrange(4)):  # special tokens and whole encoded texts mixed in
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
            at = rng.randrange(len(ids) + 1)
            ids[at:at] = tok.encode(rng.choice(TEXTS), add_special_tokens=False).ids
        out.append(ids)
    byte_pieces = [i for t, i in tok.get_vocab().items() if t.startswith("<0x")]
    if byte_pieces:  # lone and truncated UTF-8 bytes: partial characters, some never completed
        out += [[rng.choice(byte_pieces) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    return out


@pytest.fixture(scope="module", params=["default", "synthetic"])
def tokenizer(request) -> Tokenizer:
    if request.param == "default":
        return Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    return synthetic_tokenizer(4096)


def test_incremental_releases_what_whole_decoding_releases(tokenizer):
    decode = text_decoder(tokenizer)
    rng = random.Random(0)
    checked = 0
    for ids in sequences(tokenizer, rng):
        for stop in STOPS:
            got, ref = TextStream(decode, stop), WholeDecode(decode, stop)
            for token in ids:
                a, b = got.add(token), ref.add(token)
                assert a == b, (ids, stop)
                checked += 1
                if a[1]:
                    break
            else:
                assert got.finish() == ref.finish()
            assert got.text == stop_check(decode(got.token_ids), got.stop)[0]
    assert checked > 5000


def test_decodes_a_window_not_the_whole_sequence(tokenizer):
    """Each token costs decodes of a few tokens, not of everything before it."""
    calls = []

    def counting(ids):
        calls.append(len(ids))
        return tokenizer.decode(ids)

    stream = TextStream(counting)
    ids = tokenizer.encode(" ".join(["plain words only"] * 200), add_special_tokens=False).ids
    for token in ids:
        stream.add(token)
    stream.finish()
    assert stream.text == tokenizer.decode(ids)
    assert len(ids) > 400 and max(calls) <= 4
