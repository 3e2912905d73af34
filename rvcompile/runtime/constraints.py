"""Grammar constraints on generation (issue 16, structured outputs): a request's `Constraint` (a
JSON schema, any JSON object, a Lark grammar or a regular expression) becomes a token mask per
sampling step, computed on the host by llguidance over the artifact's own tokenizer (the
tokenizers JSON it ships), and applied by the device-side sampler (SampleExtras.mask).

- `Constraint` is what callers build (the server's response_format; a tool call's arguments
  schema, or a Lark grammar for a whole call format): frozen, with the llguidance grammar text.
- `Grammars` (one per engine) builds llguidance's tokenizer once, checks a constraint at the door
  (`check`: a RequestError naming the field and llguidance's reason for a schema it cannot
  compile) and starts a `Matcher` per sequence.
- `Matcher` follows one sequence: `fill(row)` writes the mask of its next token (int32 words,
  bit j of word w allows token 32 w + j: llguidance's layout and the sampler's), `consume`
  advances it by the sampled token. Once the grammar is complete only EOS is allowed.
llguidance comes with the `serve` extra; without it a constraint is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

from rvcompile.runtime.request_limits import RequestError

# JSON without free whitespace between tokens (as OpenAI's structured outputs write it): a small
# model cannot then spend its tokens on newlines inside an object.
COMPACT = {"whitespace_flexible": False}
INSTALL = "structured outputs need llguidance: pip install 'rvcompile[serve]'"


@dataclass(frozen=True)
class Constraint:
    """A grammar that every generated token must keep the text inside."""

    kind: str  # "json_schema", "json_object", "lark" or "regex"
    source: str  # the schema (JSON text), the Lark grammar or the regex; "" for json_object
    param: str = "response_format"  # the request field it came from, for errors
    grammar: str = ""  # llguidance's grammar, once Grammars.check compiled it

    @staticmethod
    def json_schema(schema: dict | bool, param: str = "response_format") -> Constraint:
        return Constraint("json_schema", json.dumps(schema, sort_keys=True), param)

    @staticmethod
    def json_object(param: str = "response_format") -> Constraint:
        return Constraint("json_object", "", param)

    @staticmethod
    def lark(grammar: str, param: str = "grammar") -> Constraint:
        return Constraint("lark", grammar, param)

    @staticmethod
    def regex(pattern: str, param: str = "regex") -> Constraint:
        return Constraint("regex", pattern, param)


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, words: int):
        self._m, self.words = matcher, words

    def fill(self, row: np.ndarray) -> None:
        """The allowed next tokens into row (int32 [words], C-contiguous)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, row.reshape(1, self.words))
        if self._m.is_error():
            raise RuntimeError(f"the grammar failed: {self._m.get_error()}")

    def consume(self, token: int) -> None:
        if not self._m.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return self._m.is_stopped()


class Grammars:
    """llguidance over one tokenizer (a `tokenizers.Tokenizer`) of `vocab_size` ids."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._eos = sorted(eos_ids)
        self.words = -(-vocab_size // 32)
        self._ll = None

    def _llg(self):
        """(llguidance, its tokenizer), built on first use (about a second for a large vocab)."""
        try:
            import llguidance
        except ImportError:
            raise RequestError("response_format", INSTALL) from None
        if self._ll is None:
            self._ll = llguidance.LLTokenizer(self._tokenizer.to_str(), n_vocab=self.vocab_size,
                                              eos_token=self._eos[0] if self._eos else None)
        return llguidance, self._ll

    def check(self, c: Constraint) -> Constraint:
        """c with its llguidance grammar, checked; raises RequestError naming c.param and
        why llguidance cannot compile it."""
        if not isinstance(c, Constraint):
            raise RequestError("response_format", f"expected a Constraint, got "
                                                  f"{type(c).__name__}")
        return dataclasses.replace(c, grammar=self._grammar(c))

    def _grammar(self, c: Constraint) -> str:
        llg, tok = self._llg()
        try:
            if c.kind == "json_schema":
                g = llg.LLMatcher.grammar_from_json_schema(c.source, defaults=COMPACT)
            elif c.kind == "json_object":
                g = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=COMPACT)
            elif c.kind == "lark":
                g = llg.LLMatcher.grammar_from_lark(c.source)
            elif c.kind == "regex":
                g = llg.LLMatcher.grammar_from_regex(c.source)
            else:
                raise ValueError(f"unknown constraint kind {c.kind!r}")
        except ValueError as e:
            raise RequestError(c.param, f"cannot compile this grammar: {_line(e)}") from None
        error = llg.LLMatcher.validate_grammar(g, tok)
        if error:
            raise RequestError(c.param, f"cannot compile this grammar: {_line(error)}")
        return g

    def matcher(self, c: Constraint) -> Matcher:
        """A Matcher at the start of a checked constraint's grammar."""
        llg, tok = self._llg()
        m = llg.LLMatcher(tok, c.grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(f"the grammar failed: {m.get_error()}")
        return Matcher(m, self.words)


def _line(e: object) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
