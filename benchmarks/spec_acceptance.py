"""Acceptance length of speculative decoding's n-gram drafting (runtime/speculative.py), in tokens
per verify call (accepted drafts + the target's own token), for k = 1..7 drafts a round.

Two measurements:
- text: teacher-forced, no model. A "target" that emits a given text token for token; each
  round proposes ngram_drafts(text so far, k) and keeps the drafts that equal the text's next
  tokens. This is the acceptance any target that reproduces the text would get, so it isolates
  how predictable the text is from its own past: prose (the default model's held-out text)
  against repetitive text (JSON, Python).
- model: the default model (models/rv-gemma4-tiny) generating greedily on xla-f32 from prompts
  taken from its held-out text, through Model.generate(speculative="ngram"): tokens / verify
  calls (the tokens are plain greedy decoding's, whatever k).

    python benchmarks/spec_acceptance.py [--model-prompts 8 --new 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from rvcompile.runtime.speculative import accepted, ngram_drafts

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "rv-gemma4-tiny"
TEXTS = {
    "prose (heldout.txt)": MODEL_DIR / "heldout.txt",
    "JSON (models/rv-gemma4-tiny/training_log.json)": MODEL_DIR / "training_log.json",
    "Python (rvcompile/runtime/engine.py)": ROOT / "rvcompile" / "runtime" / "engine.py",
}
KS = range(1, 8)
WARMUP = 64  # tokens of history before the first round
MAX_TOKENS = 8192  # of each text


def text_acceptance(tokens: list[int], k: int) -> float:
    """Tokens per round when a target emits `tokens` and n-gram lookup drafts k per round."""
    i, rounds = WARMUP, 0
    while i < len(tokens):
        drafts = ngram_drafts(tokens[:i], min(k, len(tokens) - i))
        i += accepted(drafts, tokens[i:]) + 1
        rounds += 1
    return (len(tokens) - WARMUP) / rounds


def model_acceptance(n_prompts: int, n_new: int) -> dict[int, float]:
    from rvcompile import runtime
    from rvcompile.build import BuildOptions, build_artifact

    opts = BuildOptions("xla-f32", max_context=512, prefill_buckets=(16, 64), max_seqs=1,
                        platforms=("cpu",), draft_tokens=max(KS), decode_loop_steps=0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ngram.rvp"
        build_artifact(str(MODEL_DIR), out, opts, progress=False, log=lambda s: None)
        m = runtime.load(out)
        text = (MODEL_DIR / "heldout.txt").read_text()
        ids = m.encode(text, add_bos=False)
        step = len(ids) // n_prompts
        prompts = [[m.bos_id, *ids[i * step:i * step + 32]] for i in range(n_prompts)]
        plain = [m.generate(p, max_tokens=n_new, ignore_eos=True).token_ids for p in prompts]
        result = {}
        for k in KS:
            calls0, tokens = m.engine.stats().verify_calls, 0
            for p, want in zip(prompts, plain, strict=True):
                r = m.generate(p, max_tokens=n_new, ignore_eos=True, speculative="ngram",
                               num_draft_tokens=k)
                assert r.token_ids == want, "speculation changed a greedy token"
                tokens += len(r.token_ids) - 1  # the first comes from the prefill
            result[k] = tokens / (m.engine.stats().verify_calls - calls0)
        return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-prompts", type=int, default=8)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    report: dict = {"date": time.strftime("%Y-%m-%d"), "text": {}, "model": {}}
    for name, path in TEXTS.items():
        tokens = tok.encode(path.read_text()).ids[:MAX_TOKENS]
        report["text"][name] = {"tokens": len(tokens),
                                **{k: text_acceptance(tokens, k) for k in KS}}
        print(name, len(tokens), "tokens:",
              " ".join(f"k={k} {report['text'][name][k]:.2f}" for k in KS), flush=True)
    report["model"] = model_acceptance(a.model_prompts, a.new)
    print("default model, greedy, n-gram:",
          " ".join(f"k={k} {v:.2f}" for k, v in report["model"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
