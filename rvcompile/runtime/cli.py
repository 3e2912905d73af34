"""`rvrun ARTIFACT --prompt ...`: stream generated text to stdout, a summary to stderr.
`rvrun ppl ARTIFACT --text FILE [--window N --stride S]`: the text's perplexity (one line).
`rvrun serve ARTIFACT [--host H --port P --max-num-seqs N --max-model-len N --kv-blocks N]`: an
OpenAI-compatible HTTP server (rvcompile.runtime.server).
Each takes `--trusted-key PUB` (repeatable): refuse the artifact unless one of these Ed25519
public keys signed it (`rvcompile sign`), before anything past its header and digest table is read.

Bad input or an artifact that does not fit this machine prints one line `rvrun: error: ...` and
exits 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rvcompile.artifacts import ArtifactError
from rvcompile.artifacts.signature import TrustedKey, load_trusted_key


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ppl"]:
        return ppl_main(argv[1:])
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    p = argparse.ArgumentParser(prog="rvrun", description="Run an rvcompile artifact.")
    p.add_argument("artifact")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the artifact's chat template")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-verify", action="store_true",
                   help="skip re-hashing the sections at load (header checks still run)")
    _add_trusted_key(p)
    a = p.parse_args(argv)
    if a.max_tokens < 1 or a.top_k < 0 or not 0 < a.top_p <= 1 or a.temperature < 0:
        return _fail("need --max-tokens >= 1, --top-k >= 0, 0 < --top-p <= 1, --temperature >= 0")
    try:
        keys = _trusted_keys(a)
    except ValueError as e:
        return _fail(str(e))
    from rvcompile import runtime

    t0 = time.perf_counter()
    try:
        m = runtime.load(a.artifact, verify=not a.no_verify, trusted_keys=keys)
    except (ArtifactError, FileNotFoundError) as e:
        return _fail(str(e))
    load_s = time.perf_counter() - t0
    try:
        for piece in m.generate_stream(a.prompt, max_tokens=a.max_tokens,
                                       temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                                       seed=a.seed, stop=a.stop, ignore_eos=a.ignore_eos,
                                       chat=a.chat):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except ValueError as e:
        return _fail(str(e))
    sys.stdout.write("\n")
    r = m.last_result
    ex = m.executor
    print(f"[rvrun] load {load_s:.2f} s ({ex.load_note}) | prompt "
          f"{r.prompt_tokens} tokens | new {len(r.token_ids)} tokens ({r.finish_reason}) | "
          f"TTFT {r.ttft_s * 1e3:.1f} ms | decode {r.decode_tok_s:.1f} tok/s", file=sys.stderr)
    return 0


def ppl_main(argv: list[str]) -> int:
    """Teacher-forced perplexity of a text file (rvcompile.runtime.perplexity)."""
    p = argparse.ArgumentParser(prog="rvrun ppl", description=ppl_main.__doc__)
    p.add_argument("artifact")
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--window", type=int, default=None,
                   help="tokens per window, BOS included (default: the artifact's context)")
    p.add_argument("--stride", type=int, default=None,
                   help="text tokens between window starts (default: window // 2)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip re-hashing the sections at load (header checks still run)")
    _add_trusted_key(p)
    a = p.parse_args(argv)
    from rvcompile.runtime import perplexity

    try:
        keys = _trusted_keys(a)
    except ValueError as e:
        return _fail(str(e))
    try:
        with open(a.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        return _fail(f"--text {a.text}: {e}")
    if a.window is not None:  # checked before the (slow) load; the default needs the artifact
        try:
            perplexity.check_window(a.window, a.window // 2 if a.stride is None else a.stride)
        except ValueError as e:
            return _fail(str(e))
    from rvcompile import runtime

    try:
        m = runtime.load(a.artifact, verify=not a.no_verify, trusted_keys=keys)
    except (ArtifactError, FileNotFoundError) as e:
        return _fail(str(e))
    window = m.max_context if a.window is None else a.window
    stride = window // 2 if a.stride is None else a.stride
    t0 = time.perf_counter()
    try:
        s = perplexity.text_perplexity(m, text, window=window, stride=stride)
    except ValueError as e:
        return _fail(str(e))
    print(f"perplexity {s.perplexity:.4f} | {s.tokens} tokens | mean NLL {s.mean_nll:.5f} nats "
          f"| {s.windows} windows of {window} (stride {stride}) | "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def serve_main(argv: list[str]) -> int:
    """Serve an artifact over HTTP with an OpenAI-compatible API."""
    p = argparse.ArgumentParser(prog="rvrun serve", description=serve_main.__doc__)
    p.add_argument("artifact")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences in the running batch (default: the artifact's decode slots)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + generated tokens of a request (default: the artifact's)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks of the full-attention layers, 16 tokens each (default: a "
                        "whole context per decode slot)")
    p.add_argument("--kv-sliding-blocks", type=int, default=None,
                   help="KV blocks of the sliding-window layers (default: a window per slot)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests beyond this are refused with 503")
    p.add_argument("--model-name", default=None,
                   help="the model id requests name (default: the artifact's file stem)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip re-hashing the sections at load (header checks still run)")
    _add_trusted_key(p)
    a = p.parse_args(argv)
    numbers = {"--max-num-seqs": a.max_num_seqs, "--max-model-len": a.max_model_len,
               "--kv-blocks": a.kv_blocks, "--kv-sliding-blocks": a.kv_sliding_blocks,
               "--max-waiting": a.max_waiting}
    for flag, value in numbers.items():
        if value is not None and value < 1:
            return _fail(f"{flag} must be at least 1, got {value}")
    try:
        keys = _trusted_keys(a)
    except ValueError as e:
        return _fail(str(e))
    import socket

    try:
        sock = socket.create_server((a.host, a.port))
    except OSError as e:
        return _fail(f"cannot listen on {a.host}:{a.port}: {e}")
    from rvcompile import runtime

    kv_blocks = {kind: n for kind, n in (("full", a.kv_blocks), ("sliding",
                                                                  a.kv_sliding_blocks))
                 if n is not None}
    try:
        m = runtime.load(a.artifact, verify=not a.no_verify, kv_blocks=kv_blocks or None,
                         max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
                         trusted_keys=keys)
    except (ArtifactError, FileNotFoundError, ValueError) as e:
        sock.close()
        return _fail(str(e))
    import uvicorn

    from rvcompile.runtime.server import ServeOptions, create_app

    name = a.model_name or Path(a.artifact).stem
    app = create_app(m, ServeOptions(name, a.max_waiting))
    host, port = sock.getsockname()[:2]
    kv = ", ".join(f"{k.num_blocks} {k.name}" for k in m.executor.kinds.values())
    print(f"rvrun: serving {name} at http://{host}:{port}/v1 | {m.engine.max_num_seqs} seqs, "
          f"context {m.max_context}, KV blocks {kv}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0


def _add_trusted_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trusted-key", action="append", default=[], metavar="PUB",
                   help="PEM Ed25519 public key: refuse the artifact unless this key (or another "
                        "--trusted-key) signed it (repeatable)")


def _trusted_keys(a: argparse.Namespace) -> list[TrustedKey] | None:
    """The --trusted-key files read, or None without the flag; ValueError (one line) if a file
    is not an Ed25519 public key or the flag comes with --no-verify."""
    if not a.trusted_key:
        return None
    if a.no_verify:
        raise ValueError("--trusted-key needs the sections verified: a signature vouches for "
                         "them only through their digests; drop --no-verify")
    return [load_trusted_key(k) for k in a.trusted_key]


def _fail(msg: str) -> int:
    print(f"rvrun: error: {msg.splitlines()[0]}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
