"""Acceptance length of speculative decoding (runtime/speculative.py), in tokens per verify call
(accepted drafts + the target's own token), for k = 1..7 drafts a round.

Two measurements:
- text: teacher-forced n-gram lookup, no model. A "target" that emits a given text token for
  token; each round proposes ngram_drafts(text so far, k) and keeps the drafts that equal the
  text's next tokens. This is the acceptance any target that reproduces the text would get, so
  it isolates how predictable the text is from its own past: prose (the default model's
  held-out text) against repetitive text (JSON, Python).
- model: the default model (models/rv-gemma4-tiny) with its trained assistant
  (models/rv-gemma4-tiny-assistant, `--assistant`) generating greedily on xla-f32, through
  Model.generate(speculative="assistant" | "ngram", num_draft_tokens=k), from prompts taken
  from its held-out prose and from a JSON file: new tokens after the first (which the prefill
  gives) / verify calls, summed over the prompts. Every run's tokens are checked equal to plain
  greedy decoding's. Also the share of drafts accepted.

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
# Prompts of the model measurement: the text, and how many of its tokens each prompt takes.
MODEL_PROMPTS = {
    "prose (heldout.txt)": (MODEL_DIR / "heldout.txt", 32),
    "JSON (models/rv-gemma4-tiny/training_log.json)": (MODEL_DIR / "training_log.json", 128),
}
ASSISTANT_DIR = ROOT / "models" / "rv-gemma4-tiny-assistant"
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


def prompt_sets(m, n_prompts: int) -> dict[str, list[list[int]]]:
    """name -> n_prompts prompts (BOS + tokens at evenly spaced offsets) of each model text."""
    sets = {}
    for name, (path, length) in MODEL_PROMPTS.items():
        ids = m.encode(path.read_text(), add_bos=False)
        step = (len(ids) - length) // n_prompts
        sets[name] = [[m.bos_id, *ids[i * step:i * step + length]] for i in range(n_prompts)]
    return sets


def model_acceptance(n_prompts: int, n_new: int, assistant: Path | None) -> dict:
    """{prompt set: {method: {k: {"tokens_per_verify", "accepted_share"}}}} on xla-f32."""
    from rvcompile import runtime
    from rvcompile.build import BuildOptions, build_artifact

    opts = BuildOptions("xla-f32", max_context=512, prefill_buckets=(16, 64), max_seqs=1,
                        platforms=("cpu",), draft_tokens=max(KS), decode_loop_steps=0)
    methods = ("assistant", "ngram") if assistant else ("ngram",)
    report: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "spec.rvp"
        build_artifact(str(MODEL_DIR), out, opts, progress=False, log=lambda s: None,
                       assistant=str(assistant) if assistant else None)
        m = runtime.load(out)
        for name, prompts in prompt_sets(m, n_prompts).items():
            plain = [m.generate(p, max_tokens=n_new, ignore_eos=True).token_ids for p in prompts]
            report[name] = {}
            for method in methods:
                report[name][method] = {}
                for k in KS:
                    calls0, tokens, drafted, kept = m.engine.stats().verify_calls, 0, 0, 0
                    for p, want in zip(prompts, plain, strict=True):
                        r = m.generate(p, max_tokens=n_new, ignore_eos=True,
                                       speculative=method, num_draft_tokens=k)
                        assert r.token_ids == want, "speculation changed a greedy token"
                        tokens += len(r.token_ids) - 1  # the first comes from the prefill
                        drafted += r.drafted_tokens
                        kept += r.accepted_tokens
                    calls = m.engine.stats().verify_calls - calls0
                    report[name][method][k] = {"tokens_per_verify": tokens / calls,
                                               "accepted_share": kept / max(1, drafted)}
                print(f"{name}, {method}:", " ".join(
                    f"k={k} {v['tokens_per_verify']:.2f}"
                    for k, v in report[name][method].items()), flush=True)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-prompts", type=int, default=8)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--assistant", type=Path, default=ASSISTANT_DIR,
                   help="the drafter to measure; 'none': n-gram only")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    assistant = None if str(a.assistant) == "none" else a.assistant
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    report: dict = {"date": time.strftime("%Y-%m-%d"), "text": {}, "model": {}}
    for name, path in TEXTS.items():
        tokens = tok.encode(path.read_text()).ids[:MAX_TOKENS]
        report["text"][name] = {"tokens": len(tokens),
                                **{k: text_acceptance(tokens, k) for k in KS}}
        print(name, len(tokens), "tokens:",
              " ".join(f"k={k} {report['text'][name][k]:.2f}" for k in KS), flush=True)
    report["model"] = model_acceptance(a.model_prompts, a.new, assistant)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
