"""The runtime API every tool, test and server uses, whatever target built the artifact:

    m = rvcompile.runtime.load("tiny.rvp")
    out = m.generate("Hello", max_tokens=32, temperature=0.7, top_k=40, top_p=0.95, seed=1)
    for piece in m.generate_stream(...): ...      # text pieces as tokens arrive
    m.logits(token_ids) -> np.ndarray [T, vocab]  # teacher-forced, every position

Model owns tokenization, chat templating, chunked prefill and the decode loop with stop checks;
the executor only runs entry points. Single-sequence generation uses slot 0.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (a stop string's tokens included, EOS excluded)
    text: str  # decoded new text, cut before any stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int
    ttft_s: float = 0.0  # prompt in -> first new token out
    decode_s: float = 0.0  # time spent producing tokens after the first
    stats: dict = field(default_factory=dict)

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class Model:
    def __init__(self, art, executor):
        self.art, self.executor = art, executor
        self.manifest = art.manifest
        self.tokenizer = Tokenizer.from_str(bytes(art.buffer("tokenizer")).decode())
        self.generation_config = json.loads(bytes(art.buffer("generation_config")))
        self.chat_template = bytes(art.buffer("chat_template")).decode() or None
        cfg = self.manifest["model"]["config"]
        self.vocab_size = cfg["vocab_size"]
        eos = self.generation_config.get("eos_token_id", cfg.get("eos_token_id", 1))
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [eos])
        self.bos_id = int(self.generation_config.get("bos_token_id", 2))
        self.max_context = executor.max_context

    # ------------------------------------------------------------------ text

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and (not ids or ids[0] != self.bos_id) else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not self.chat_template:
            raise ValueError(f"{self.art.path.name}: the artifact has no chat template")
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True, bos_token="<bos>",
            eos_token="<eos>")

    def _prompt_ids(self, prompt: str | Sequence[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if chat:
                return self.encode(self.apply_chat_template([{"role": "user",
                                                              "content": prompt}]), False)
            return self.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    # ------------------------------------------------------------------ model

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(token_ids, np.int32)
        self._check_length(len(ids), 0)
        ex = self.executor
        rows = [ex.logits(0, ids[s:s + ex.max_chunk], s) for s in range(0, len(ids), ex.max_chunk)]
        return np.concatenate(rows, axis=0)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 64,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 stop: Sequence[str] = (), ignore_eos: bool = False,
                 chat: bool = False) -> GenerationResult:
        *_, (_, result) = self._run(prompt, max_tokens, temperature, top_k, top_p, seed, stop,
                                    ignore_eos, chat)
        return result

    def generate_stream(self, prompt: str | Sequence[int], *, max_tokens: int = 64,
                        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False,
                        chat: bool = False) -> Iterator[str]:
        """Yields text pieces as they become final; the last GenerationResult is on
        `self.last_result` afterwards."""
        emitted = 0
        for text, result in self._run(prompt, max_tokens, temperature, top_k, top_p, seed, stop,
                                      ignore_eos, chat):
            self.last_result = result
            if len(text) > emitted:
                yield text[emitted:]
                emitted = len(text)

    def _check_length(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len + max_tokens > self.max_context:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"artifact's context of {self.max_context} tokens")
        if prompt_len == 0:
            raise ValueError("empty prompt")

    def _run(self, prompt, max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, chat):
        """Yields (final text so far, GenerationResult so far) after each new token."""
        ids = self._prompt_ids(prompt, chat)
        self._check_length(len(ids), max_tokens)
        ex = self.executor
        seed = int(seed) & 0x7FFFFFFF
        t0 = time.perf_counter()
        tok = None
        for s in range(0, len(ids), ex.max_chunk):
            chunk = np.asarray(ids[s:s + ex.max_chunk], np.int32)
            tok = ex.prefill(0, chunk, s, ex._sampling(1, temperature, top_k, top_p, seed, 0))
        res = GenerationResult([], "", "length", len(ids))
        res.ttft_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        pos = len(ids)
        slots = ex.slots
        active = np.zeros(slots, np.int32)
        active[0] = 1
        while True:
            if tok in self.eos_ids and not ignore_eos:
                res.finish_reason = "stop"
                break
            res.token_ids.append(tok)
            text, hit = self._stop_check(self.decode(res.token_ids), stop)
            res.decode_s = time.perf_counter() - t1
            if hit:
                res.text, res.finish_reason = text, "stop"
                yield text, res
                break
            res.text = text
            yield _stable_prefix(text, stop), res
            if len(res.token_ids) >= max_tokens:
                break
            tokens = np.zeros(slots, np.int32)
            tokens[0] = tok
            start = np.zeros(slots, np.int32)
            start[0] = pos
            step = len(res.token_ids)
            tok = int(ex.decode(tokens, start, active,
                                ex._sampling(slots, temperature, top_k, top_p, seed, step))[0])
            pos += 1
        res.decode_s = time.perf_counter() - t1
        yield res.text, res

    @staticmethod
    def _stop_check(text: str, stop: Sequence[str]) -> tuple[str, bool]:
        cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)


def _stable_prefix(text: str, stop: Sequence[str]) -> str:
    """Text safe to emit: no trailing partial UTF-8 char, nor a possible start of a stop string."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[:len(text) - hold]
