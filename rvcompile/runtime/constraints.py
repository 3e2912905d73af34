"""Grammar constraints on generation (issue 16, structured outputs): a request's `Constraint` (a
JSON schema, any JSON object, a Lark grammar or a regular expression) becomes a token mask per
sampling step, computed on the host by llguidance over the artifact's own tokenizer (the
tokenizers JSON it ships), and applied by the device-side sampler (SampleExtras.mask).

- `Constraint` is what callers build (the server's response_format; a tool call's arguments
  schema, or a Lark grammar for a whole call format): frozen, with the llguidance grammar text.
- `Grammars` (one per engine) builds llguidance's tokenizer once, checks a constraint at the door
  (`check`: a RequestError naming the field and llguidance's reason for a schema it cannot
  compile) and starts a `Matcher` per sequence.
- `Matcher` follows one sequence: `consume` advances it by a sampled token; `done` says the
  grammar is complete (only EOS is allowed then). `Grammars.fill(matchers)` writes the masks of
  their next tokens at once, on llguidance's threads (int32 words, bit j of word w allows token
  32 w + j: llguidance's layout and the sampler's).
- `Grammars.start(matchers)` runs that fill on the grammars' one worker thread and returns a
  `MaskJob` at once (llguidance drops the GIL while it computes, so the caller's Python runs
  meanwhile); `MaskJob.result()` waits for the masks. Ownership: from `start` until `result`
  has returned (or raised), the job's matchers belong to the worker, and the caller must not
  touch them (no consume, no `error`: llguidance borrows them mutably while it computes); a
  Matcher's `done` and `consumed` are plain attributes, safe to read at any time. One job runs
  at a time: the caller waits for a job before it fills or starts another.
llguidance comes with the `serve` extra; without it a constraint is refused in one line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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

    def __init__(self, matcher):
        self._m = matcher
        self.consumed = 0  # tokens consumed so far
        self.done = matcher.is_stopped()  # the grammar is complete: only EOS may follow

    @property
    def error(self) -> str:
        """Why the grammar failed ("" while it has not): llguidance's matchers do not raise;
        one that fails stays failed."""
        return f"the grammar failed: {self._m.get_error()}" if self._m.is_error() else ""

    def consume(self, token: int) -> None:
        if not self._m.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._m.get_error()}")
        self.consumed += 1
        self.done = self._m.is_stopped()


class MaskJob:
    """Masks being computed on the grammars' worker thread (Grammars.start)."""

    def __init__(self, future: Future):
        self._future = future

    def result(self) -> tuple[np.ndarray, float]:
        """(Grammars.fill's rows, the worker's seconds computing them), once computed; raises
        what the fill raised."""
        return self._future.result()


class Grammars:
    """llguidance over one tokenizer (a `tokenizers.Tokenizer`) of `vocab_size` ids."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._eos = sorted(eos_ids)
        self.words = -(-vocab_size // 32)
        self._ll = None
        self._pool = None  # llguidance's thread pool, for masks of many sequences at once
        self._worker: ThreadPoolExecutor | None = None  # runs `start`'s jobs, one at a time

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
        m = Matcher(llg.LLMatcher(tok, c.grammar, log_level=0))
        if m.error:
            raise RuntimeError(m.error)
        return m

    def fill(self, matchers: list[Matcher]) -> np.ndarray:
        """The allowed next tokens of each matcher's sequence: int32 [len(matchers), words],
        computed on llguidance's threads (outside the GIL) when there are several. A matcher
        that failed says so in its `error` afterwards (its row is then meaningless)."""
        out, compute = self._fill_call(matchers)
        compute()
        return out

    def start(self, matchers: list[Matcher]) -> MaskJob:
        """fill(matchers) on the worker thread, started now (see the module docstring for who
        owns the matchers until the job's result is in)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="rvrun-masks")
        out, compute = self._fill_call(matchers)
        started = threading.Event()

        def run() -> tuple[np.ndarray, float]:
            started.set()
            t0 = time.perf_counter()
            compute()
            return out, time.perf_counter() - t0

        future = self._worker.submit(run)
        # Wait (GIL released) until the worker is in: else it would wait for the GIL until the
        # interpreter's switch interval (5 ms) made this thread let go, which is a whole step's
        # host work between device calls.
        started.wait()
        return MaskJob(future)

    def _fill_call(self, matchers: list[Matcher]) -> tuple[np.ndarray, Callable[[], None]]:
        """The rows fill returns, and llguidance's call that writes them."""
        import llguidance.numpy as lln

        out = np.empty((len(matchers), self.words), np.int32)
        if len(matchers) == 1:
            return out, functools.partial(lln.fill_next_token_bitmask, matchers[0]._m, out)
        if not matchers:
            return out, lambda: None
        if self._pool is None:
            self._pool = lln.LLExecutor()
        return out, functools.partial(lln.fill_next_token_bitmask_par, self._pool,
                                      [(m._m, i) for i, m in enumerate(matchers)], out)


def _line(e: object) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
