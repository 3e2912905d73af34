"""The runtime API every tool, test and server uses, whatever target built the artifact:

    m = rvcompile.runtime.load("tiny.rvp")
    out = m.generate("Hello", max_tokens=32, temperature=0.7, top_k=40, top_p=0.95, seed=1)
    for piece in m.generate_stream(...): ...      # text pieces as tokens arrive
    m.logits(token_ids) -> np.ndarray [T, vocab]  # teacher-forced, every position
    m.generate("Hello", speculative="ngram", num_draft_tokens=3)  # or "assistant"

Model owns tokenization and chat templating; generation runs through its Engine (scheduling,
paged KV with prefix caching, chunked prefill, decode, stop checks), the same engine `rvrun
serve` drives from a background thread. Where the artifact has a device-side decode loop and
nothing else runs, generate's tokens come up to its decode_loop_steps at a time;
generate_stream's requests stream (engine: each loop call bounded to about the engine's
stream_interval_s), so its pieces arrive as the tokens are made. Call generate and logits
from one thread, and not while a server runs the engine.

Chat follows Gemma 4's format: a model turn ends at `<turn|>`, or at `<|tool_response>` where the
model hands the turn to a tool. Where the tokenizer has these markers as EOS tokens, EOS ends the
turn; where it does not (rv-gemma4-tiny's vocabulary has no room for them: they are text there),
a chat generation also stops at their text (`chat_stop`). Decoding keeps Gemma 4's tool-call
markers even where they are special tokens, so a caller can parse the calls from the text.

Speculative decoding (`speculative`: "assistant", the artifact's drafter, or "ngram", prompt
lookup; `num_draft_tokens`: drafts per round, default the artifact's most) changes no token: a
seeded or greedy generation gives the same tokens with it as without (runtime/speculative.py);
the result counts the drafts verified and accepted.

generate's arguments are checked where they enter the engine (request_limits, the same check
`rvrun serve` runs): a bad one raises RequestError (a ValueError) naming it. A generation the
engine fails to run (its step raised) raises RuntimeError with the engine's error.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rvcompile.artifacts.contents import Contents, read_contents
from rvcompile.artifacts.manifest import read_manifest
from rvcompile.runtime.constraints import Grammars
from rvcompile.runtime.engine import Engine, Request
from rvcompile.runtime.executor_api import Executor, Sampling
from rvcompile.runtime.load_report import LoadReport
from rvcompile.runtime.request_limits import (
    MAX_STOP_STRINGS,
    RequestError,
    check_stop,
    speculation_of,
)

if TYPE_CHECKING:
    from rvcompile.chat_template import ChatTemplate

# Gemma 4's markers that end a model turn: `<turn|>` closes it, `<|tool_response>` hands it over
# to a tool's answer (the released tokenizers have them as EOS ids 106 and 50).
TURN_ENDS = ("<turn|>", "<|tool_response>")
# Gemma 4's tool-call syntax: kept in decoded text where the tokenizer has them as special tokens
TOOL_CALL_MARKERS = ("<|tool_call>", "<tool_call|>", '<|"|>')


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (a stop string's tokens included, EOS excluded)
    text: str  # decoded new text, cut before any stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int
    ttft_s: float = 0.0  # prompt in -> first new token out
    decode_s: float = 0.0  # time spent producing tokens after the first
    stats: dict = field(default_factory=dict)
    drafted_tokens: int = 0  # speculative decoding: drafts verified
    accepted_tokens: int = 0  # of them, accepted (each one a target step saved)

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def text_decoder(tokenizer) -> Callable[[Sequence[int]], str]:
    """`tokenizer`'s decode without special tokens, but for TOOL_CALL_MARKERS (a caller parses
    the calls out of the text)."""
    added = tokenizer.get_added_tokens_decoder()
    kept = frozenset(i for i, t in added.items() if t.special and t.content in TOOL_CALL_MARKERS)
    hidden = frozenset(i for i, t in added.items() if t.special) - kept

    def decode(ids: Sequence[int]) -> str:
        ids = list(ids)
        if kept.isdisjoint(ids):
            return tokenizer.decode(ids, skip_special_tokens=True)
        return tokenizer.decode([i for i in ids if i not in hidden], skip_special_tokens=False)

    return decode


class Model:
    def __init__(self, art, executor: Executor, *, contents: Contents | None = None,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 load_report: LoadReport | None = None, prefill_budget: int | None = None):
        """`contents`: the artifact's checked tokenizer, ids and template (what `load` read
        before it asked the machine anything); read and checked here when not given.
        `load_report`: what `runtime.load` spent, phase by phase (None for a Model built
        around an executor directly)."""
        self.art, self.executor = art, executor
        self.load_report = load_report
        self.manifest = art.manifest
        contents = contents or read_contents(art, read_manifest(art))
        self.tokenizer = contents.tokenizer
        self.chat_template = contents.chat_template
        self.vocab_size = contents.vocab_size
        self.eos_ids = contents.eos_ids
        self.bos_id = contents.bos_id
        self._decode = text_decoder(self.tokenizer)
        self.engine = Engine(executor, self.decode, self.eos_ids, vocab_size=self.vocab_size,
                             max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             prefill_budget=prefill_budget,
                             grammars=Grammars(self.tokenizer, self.vocab_size, self.eos_ids))
        self.max_context = self.engine.max_model_len
        self._ids = itertools.count()

    # ------------------------------------------------------------------ text

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and (not ids or ids[0] != self.bos_id) else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` without special tokens, but for Gemma 4's tool-call markers."""
        return self._decode(ids)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The artifact's chat template over `messages` (and `tools`, OpenAI function tools, when
        given), rendered in jinja2's immutable sandbox (rvcompile.chat_template); a template
        that fails or reaches outside it raises ChatTemplateError (a ValueError), one line."""
        extra = {} if tools is None else {"tools": tools}
        return self._chat_template.render(messages, add_generation_prompt=True,
                                          bos_token="<bos>", eos_token="<eos>", **extra)

    @functools.cached_property
    def chat_stops(self) -> tuple[str, ...]:
        """The turn ends the chat template writes that the tokenizer does not encode as one EOS
        token: a chat generation stops at their text."""
        template = self.chat_template or ""
        stops = []
        for marker in TURN_ENDS:
            ids = self.tokenizer.encode(marker, add_special_tokens=False).ids
            if marker in template and not (len(ids) == 1 and ids[0] in self.eos_ids):
                stops.append(marker)
        return tuple(stops)

    def chat_stop(self, stop: str | Sequence[str] | None) -> tuple[str, ...]:
        """A chat request's stop strings: the caller's, checked, and `chat_stops`. Raises
        RequestError when both together are more than a request may have."""
        own = check_stop(() if stop is None else stop)
        extra = tuple(s for s in self.chat_stops if s not in own)
        if len(own) + len(extra) > MAX_STOP_STRINGS:
            raise RequestError("stop", f"at most {MAX_STOP_STRINGS - len(extra)} strings in a "
                                       f"chat request on this model (its chat template ends "
                                       f"turns with {len(extra)} of its own), got {len(own)}")
        return own + extra

    @functools.cached_property
    def _chat_template(self) -> ChatTemplate:
        if not self.chat_template:
            raise ValueError(f"{self.art.path.name}: the artifact has no chat template")
        # jinja2 and the sandbox, imported by the first chat rather than by every start (a
        # load's own check of the template imports jinja2 alongside the upload)
        from rvcompile.chat_template import compile_template

        return compile_template(self.chat_template)

    def _prompt_ids(self, prompt: str | Sequence[int], chat: bool) -> Sequence[int]:
        """A text prompt's token ids; token ids as they are (Engine.add checks them)."""
        if not isinstance(prompt, str):
            return prompt
        if chat:
            return self.encode(self.apply_chat_template([{"role": "user", "content": prompt}]),
                               False)
        return self.encode(prompt)

    # ------------------------------------------------------------------ model

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        return self.engine.logits(token_ids)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 64,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 stop: str | Sequence[str] = (), ignore_eos: bool = False,
                 chat: bool = False, speculative: str | None = None,
                 num_draft_tokens: int | None = None) -> GenerationResult:
        *_, (_, result) = self._run(prompt, max_tokens, temperature, top_k, top_p, seed, stop,
                                    ignore_eos, chat, speculative, num_draft_tokens,
                                    stream=False)
        return result

    def generate_stream(self, prompt: str | Sequence[int], *, max_tokens: int = 64,
                        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        seed: int = 0, stop: str | Sequence[str] = (), ignore_eos: bool = False,
                        chat: bool = False, speculative: str | None = None,
                        num_draft_tokens: int | None = None) -> Iterator[str]:
        """Yields text pieces as they become final; the last GenerationResult is on
        `self.last_result` afterwards. `chat`: a text prompt is one user message rendered by
        the chat template (token ids: a conversation the caller rendered), and the generation
        also stops at the end of the model's turn (`chat_stop`)."""
        emitted = 0
        for text, result in self._run(prompt, max_tokens, temperature, top_k, top_p, seed, stop,
                                      ignore_eos, chat, speculative, num_draft_tokens,
                                      stream=True):
            self.last_result = result
            if len(text) > emitted:
                yield text[emitted:]
                emitted = len(text)

    def _run(self, prompt, max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, chat,
             speculative=None, num_draft_tokens=None, *, stream: bool):
        """Yields (final text so far, GenerationResult so far) after each new token."""
        if chat:
            stop = self.chat_stop(stop)
        request = Request(f"generate-{next(self._ids)}", self._prompt_ids(prompt, chat),
                          max_tokens, Sampling(temperature, top_k, top_p, seed), stop,
                          ignore_eos, stream=stream,
                          speculation=speculation_of(speculative, num_draft_tokens))
        t0 = time.perf_counter()
        self.engine.add(request)
        res = GenerationResult([], "", "length", len(request.prompt_ids))
        try:
            while True:
                for out in self.engine.step():
                    if out.id != request.id:
                        continue
                    now = time.perf_counter()
                    if not res.ttft_s:
                        res.ttft_s = now - t0
                    res.decode_s = now - t0 - res.ttft_s
                    res.token_ids += out.token_ids
                    res.text += out.text
                    res.drafted_tokens = out.drafted_tokens
                    res.accepted_tokens = out.accepted_tokens
                    if out.finish_reason == "error":
                        raise RuntimeError(f"generation failed: {out.error}")
                    if out.finished:
                        res.finish_reason = out.finish_reason
                        res.stats = {"cached_prompt_tokens": out.cached_tokens}
                    yield res.text, res
                    if out.finished:
                        return
        finally:
            if not res.stats:  # abandoned by the caller: free it at the next step
                self.engine.abort(request.id)
