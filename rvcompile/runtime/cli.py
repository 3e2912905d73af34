"""`rvrun [run] ARTIFACT --prompt ...`: stream generated text to stdout, a summary to stderr.
`rvrun ppl ARTIFACT --text FILE [--window N --stride S]`: the text's perplexity (one line).
`rvrun chat ARTIFACT`: a conversation through the artifact's chat template, one line a user turn
read from stdin, each answer streamed to stdout; on a terminal a `> ` prompt and line editing;
Ctrl-C stops the answer being written (it stays in the history as far as it got), Ctrl-D (the
end of stdin) ends the session with 0; `/reset` forgets the history.
`rvrun serve ARTIFACT [--host H --port P --max-num-seqs N --max-model-len N --kv-blocks N]`: an
OpenAI-compatible HTTP server (rvcompile.runtime.serve.server); SIGTERM drains it and exits 0.
`rvrun prepare ARTIFACT`: compile an XLA artifact's programs on this machine into
ARTIFACT.prepared (runtime/prepare.py), which later loads use instead of compiling.
`rvrun` and `rvrun serve` take `--speculative assistant|ngram [--num-draft-tokens K]`:
speculative decoding with the artifact's drafter or by n-gram lookup (the same tokens, fewer
target steps; runtime/speculative.py); an artifact that cannot do it is refused in one line.
Each takes `--trusted-key PUB` (repeatable): refuse the artifact unless one of these Ed25519
public keys signed it (`rvcompile sign`), before anything past its header and digest table is read.

Bad input or an artifact that does not fit this machine prints one line `rvrun: error: ...` and
exits 2. The sampling flags get the engine's own request check (runtime/request_limits), the
parts that need no artifact before it loads; a generation the engine fails exits 1. Ctrl-C prints
`rvrun: interrupted` and exits 130 (serve: after draining); a closed stdout (`rvrun ... | head`)
ends it quietly with 141.

`rvrun ppl` and `rvrun serve` show the load's phases (and ppl its windows) on stderr: a bar on
a terminal, else one line per finished phase; `rvrun` itself only on a terminal. Once loaded,
`rvrun` and `rvrun serve` print what the load cost (Model.load_report: two lines, `rvrun: load
...` with the time of each phase and `rvrun: weights ...` with the bytes and GB/s).

Commands are the entries of COMMANDS (one line each in `rvrun --help`); a first word that is
neither a command nor an existing file is refused with the closest command, if any ("did you
mean"). Every option's help shows its default.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rvcompile.artifacts import ArtifactError
from rvcompile.artifacts.signature import TrustedKey, load_trusted_key
from rvcompile.progress import Phases
from rvcompile.runtime.executor_api import load_pending


def main(argv: list[str] | None = None) -> int:
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:  # a background job started ignoring Ctrl-C: keep to it
        signal.signal(signal.SIGINT, _exit_on_interrupt)
    try:
        return _main(argv)
    except BrokenPipeError:  # stdout's reader went away (`rvrun ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for the flush at exit
        return 141  # as a process ended by SIGPIPE
    finally:
        signal.signal(signal.SIGINT, previous)


def _exit_on_interrupt(signum: int, frame) -> None:
    """SIGINT (Ctrl-C): one line and exit 130 at once. A KeyboardInterrupt instead may land in
    an import, in a garbage-collector callback that swallows it, or before JAX's teardown, and
    print tracebacks; rvrun holds nothing that needs cleaning up (stdout is flushed per piece)."""
    os.write(2, b"\nrvrun: interrupted\n")
    os._exit(130)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        _run_parser().print_help()
        return 0 if argv else 2
    first = argv[0]
    if first in COMMANDS:
        return COMMANDS[first].main(argv[1:])
    if not first.startswith("-") and not Path(first).exists() and "." not in Path(first).name:
        close = difflib.get_close_matches(first, COMMANDS, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return _fail(f"{first!r} is neither a command ({', '.join(COMMANDS)}) nor an artifact "
                     f"file{hint}")
    return run_main(argv)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help, unless the help already names it; the epilog's
    lines kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required:
            return f"{text} (required)"
        if "default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.default is False:  # a flag
            return f"{text} (default: off)"
        return super()._get_help_string(action)


def _parser(prog: str, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                   formatter_class=_HelpFormatter)


def _run_parser() -> argparse.ArgumentParser:
    commands = "\n".join(f"  {name:8} {c.summary}" for name, c in COMMANDS.items())
    p = _parser("rvrun", "Run an rvcompile artifact: generate from a prompt (the default\n"
                "command, `run`), or one of the commands below.",
                f"commands:\n{commands}\n\n`rvrun COMMAND --help` shows a command's options.")
    p.usage = "rvrun [run] ARTIFACT --prompt TEXT [options]  |  rvrun COMMAND ARTIFACT ..."
    p.add_argument("artifact", help="the artifact (.rvp)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    _add_sampling(p, "prompt")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string, excluded from the output (repeatable; default: none)")
    p.add_argument("--chat", action="store_true", help="apply the artifact's chat template")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-sequence tokens, to --max-tokens")
    _add_speculative(p)
    p.add_argument("--no-verify", action="store_true",
                   help="skip re-hashing the sections at load (header checks still run)")
    _add_trusted_key(p)
    return p


def run_main(argv: list[str]) -> int:
    """Generate from a prompt: the text to stdout as it is made, a summary to stderr."""
    a = _run_parser().parse_args(argv)
    from rvcompile.runtime import request_limits as rl
    from rvcompile.runtime.executor_api import Sampling

    try:  # before the (slow) load; the vocabulary and context limits follow in generate
        rl.check_max_tokens(a.max_tokens)
        rl.check_sampling(Sampling(a.temperature, a.top_k, a.top_p, a.seed), vocab_size=None)
        rl.check_stop(a.stop)
        _speculation(a)
    except rl.RequestError as e:
        return _fail(_flag_error(e))
    problem = _not_utf8("--prompt", a.prompt)
    if problem:
        return _fail(problem)
    try:
        keys = _trusted_keys(a)
    except ValueError as e:
        return _fail(str(e))
    from rvcompile import runtime

    t0 = time.perf_counter()
    try:
        m = runtime.load(a.artifact, verify=not a.no_verify, trusted_keys=keys,
                         trust_executables=a.trust_executables, phases=_phases(logged=False))
    except (ArtifactError, FileNotFoundError) as e:
        return _fail(str(e))
    load_s = time.perf_counter() - t0
    _print_load_report(m)
    deserialized = getattr(m.executor, "deserialized_s", {})  # XLA, before any request: {}
    try:
        for piece in m.generate_stream(a.prompt, max_tokens=a.max_tokens,
                                       temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                                       seed=a.seed, stop=a.stop, ignore_eos=a.ignore_eos,
                                       chat=a.chat, speculative=a.speculative,
                                       num_draft_tokens=a.num_draft_tokens):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except rl.RequestError as e:
        return _fail(_flag_error(e))
    except ValueError as e:  # the chat template refused the prompt
        return _fail(str(e))
    except RuntimeError as e:  # the engine failed the generation
        return _fail(str(e), status=1)
    sys.stdout.write("\n")
    r = m.last_result
    ex = m.executor
    # executables XLA deserialized on their first call in this request: in TTFT and decode
    first_use = {k: v for k, v in getattr(ex, "deserialized_s", {}).items()
                 if k not in deserialized}
    print(f"[rvrun] load {load_s:.2f} s ({ex.load_note}) | prompt "
          f"{r.prompt_tokens} tokens | new {len(r.token_ids)} tokens ({r.finish_reason}) | "
          f"TTFT {r.ttft_s * 1e3:.1f} ms | decode {r.decode_tok_s:.1f} tok/s"
          + (f" | {a.speculative}: {r.accepted_tokens} of {r.drafted_tokens} drafts accepted"
             if a.speculative else "")
          + (f" | of these times, executables deserialized on first use "
             f"{sum(first_use.values()):.2f} s ({', '.join(sorted(first_use))})"
             if first_use else ""), file=sys.stderr)
    return 0


def ppl_main(argv: list[str]) -> int:
    """Teacher-forced perplexity of a text file (rvcompile.runtime.perplexity)."""
    p = _parser("rvrun ppl", ppl_main.__doc__)
    p.add_argument("artifact", help="the artifact (.rvp)")
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

    phases = _phases()
    try:
        m = runtime.load(a.artifact, verify=not a.no_verify, trusted_keys=keys,
                         trust_executables=a.trust_executables, phases=phases)
    except (ArtifactError, FileNotFoundError) as e:
        return _fail(str(e))
    window = m.max_context if a.window is None else a.window
    stride = window // 2 if a.stride is None else a.stride
    t0 = time.perf_counter()
    try:
        with phases.phase("score windows") as bar:
            def on_window(done: int, windows: int, ppl: float) -> None:
                bar.set_total(windows)
                bar.advance(1, info=f"perplexity {ppl:.4f}")

            s = perplexity.text_perplexity(m, text, window=window, stride=stride,
                                           on_window=on_window)
    except ValueError as e:
        return _fail(str(e))
    print(f"perplexity {s.perplexity:.4f} | {s.tokens} tokens | mean NLL {s.mean_nll:.5f} nats "
          f"| {s.windows} windows of {window} (stride {stride}) | "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def chat_main(argv: list[str]) -> int:
    """Chat with an artifact in the terminal, through its chat template."""
    p = _parser("rvrun chat", chat_main.__doc__)
    p.add_argument("artifact", help="the artifact (.rvp)")
    p.add_argument("--system", default=None,
                   help="a system message opening the conversation (default: none)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens of one answer")
    _add_sampling(p, "conversation")
    p.add_argument("--no-verify", action="store_true",
                   help="skip re-hashing the sections at load (header checks still run)")
    _add_trusted_key(p)
    a = p.parse_args(argv)
    from rvcompile.runtime import request_limits as rl
    from rvcompile.runtime.executor_api import Sampling

    try:
        rl.check_max_tokens(a.max_tokens)
        rl.check_sampling(Sampling(a.temperature, a.top_k, a.top_p, a.seed), vocab_size=None)
    except rl.RequestError as e:
        return _fail(_flag_error(e))
    problem = a.system is not None and _not_utf8("--system", a.system)
    if problem:
        return _fail(problem)
    try:
        keys = _trusted_keys(a)
    except ValueError as e:
        return _fail(str(e))
    from rvcompile import runtime

    try:
        m = runtime.load(a.artifact, verify=not a.no_verify, trusted_keys=keys,
                         trust_executables=a.trust_executables)
    except (ArtifactError, FileNotFoundError) as e:
        return _fail(str(e))
    if not m.chat_template:
        return _fail(f"{Path(a.artifact).name}: the artifact has no chat template (rvcompile "
                     "build --chat-template FILE adds one)")
    from rvcompile.runtime.chat_session import ChatSession

    session = ChatSession(m, system=a.system, max_tokens=a.max_tokens,
                          sampling=dict(temperature=a.temperature, top_k=a.top_k,
                                        top_p=a.top_p, seed=a.seed))
    return session.run(sys.stdin, sys.stdout, sys.stderr)


def serve_main(argv: list[str]) -> int:
    """Serve an artifact over HTTP with an OpenAI-compatible API."""
    p = _parser("rvrun serve", serve_main.__doc__)
    p.add_argument("artifact", nargs="?", help="the artifact (.rvp; or the --config file's)")
    p.add_argument("--config", type=Path, default=None,
                   help="the options as a YAML file (runtime/serve/config.py: each key a flag's "
                        "name with underscores, api_key_env naming the API key's environment "
                        "variable); options given here override it (default: none)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences in the running batch (default: the artifact's max_seqs)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + generated tokens of a request (default: the artifact's)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks of the full-attention layers, 16 tokens each (default: XLA "
                        "artifacts a whole context per decode slot, the only count those "
                        "built with --platforms tpu --tp N take; h100 artifacts what "
                        "--gpu-memory-utilization leaves)")
    p.add_argument("--kv-sliding-blocks", type=int, default=None,
                   help="KV blocks of the sliding-window layers (default: XLA artifacts a "
                        "window per slot; h100 artifacts what --gpu-memory-utilization leaves)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="h100 artifacts: the fraction of the GPU's memory the model and its KV "
                        "pools may take, the pools getting what the model leaves (default: "
                        "0.90)")
    p.add_argument("--prefill-budget", type=int, default=None,
                   help="prompt tokens prefilled per engine step, in chunks, besides the decode "
                        "lanes: more admits waiting requests faster, each such step taking "
                        "longer (default: one chunk, the artifact's largest prefill bucket)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests beyond this are refused with 503")
    p.add_argument("--model-name", default=None,
                   help="the model id requests name (default: the artifact's file stem)")
    _add_speculative(p)
    p.add_argument("--no-verify", action="store_true",
                   help="skip re-hashing the sections at load (header checks still run)")
    _add_trusted_key(p)
    p.add_argument("--api-key", default=os.environ.get("RVRUN_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /health and "
                        "/metrics (default: $RVRUN_API_KEY; neither: no key needed)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="longer request bodies get 413 (default: 8 MiB)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive after its headers; then "
                        "408 and the connection is closed")
    p.add_argument("--drain-timeout", type=float, default=20.0,
                   help="on SIGTERM or Ctrl-C, seconds in-flight requests may still run while "
                        "new ones get 503")
    a = p.parse_args(argv)
    if a.config is not None:
        from rvcompile.runtime.serve.config import (
            ServeConfigError,
            apply,
            given_on_command_line,
            load_serve_config,
        )

        try:
            apply(a, load_serve_config(a.config, os.environ), given_on_command_line(p, argv))
        except ServeConfigError as e:
            return _fail(str(e))
    if a.artifact is None:
        return _fail("missing ARTIFACT: give it, or artifact: in the --config file")
    problem = _check_http_flags(a)
    if problem:
        return _fail(problem)
    numbers = {"--max-num-seqs": a.max_num_seqs, "--max-model-len": a.max_model_len,
               "--kv-blocks": a.kv_blocks, "--kv-sliding-blocks": a.kv_sliding_blocks,
               "--max-waiting": a.max_waiting, "--prefill-budget": a.prefill_budget}
    for flag, value in numbers.items():
        if value is not None and value < 1:
            return _fail(f"{flag} must be at least 1, got {value}")
    utilization = a.gpu_memory_utilization
    if utilization is not None and not 0 < utilization <= 1:
        return _fail(f"--gpu-memory-utilization must be a fraction in (0, 1], got {utilization}")
    from rvcompile.runtime.request_limits import RequestError

    try:
        _speculation(a)
    except RequestError as e:
        return _fail(_flag_error(e))
    try:
        keys = _trusted_keys(a)
    except ValueError as e:
        return _fail(str(e))
    import socket

    try:
        sock = socket.create_server((a.host, a.port))
    except (OSError, ValueError) as e:  # ValueError: a host name IDNA or the OS cannot take
        return _fail(f"cannot listen on {a.host}:{a.port}: {e}")
    from rvcompile import runtime

    kv_blocks = {kind: n for kind, n in (("full", a.kv_blocks), ("sliding",
                                                                  a.kv_sliding_blocks))
                 if n is not None}
    try:
        m = runtime.load(a.artifact, verify=not a.no_verify, kv_blocks=kv_blocks or None,
                         max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
                         trusted_keys=keys, trust_executables=a.trust_executables,
                         phases=_phases(), gpu_memory_utilization=utilization,
                         prefill_budget=a.prefill_budget)
        # a server loads what the load left for first use before it listens (executor_api)
        t0 = time.perf_counter()
        pending = load_pending(m.executor)
        pending_s = time.perf_counter() - t0
    except (ArtifactError, FileNotFoundError, ValueError) as e:
        sock.close()
        return _fail(str(e))
    _print_load_report(m)
    if pending:
        print(f"rvrun: {len(pending)} executables deserialized before serving in "
              f"{pending_s:.2f} s ({', '.join(pending)})", file=sys.stderr, flush=True)
    from rvcompile.runtime.serve.server import HttpOptions, ServeOptions, create_app, run

    try:  # once, against the artifact: every request then speculates alike
        speculation = m.engine.limits.speculation(_speculation(a))
    except RequestError as e:
        sock.close()
        return _fail(_flag_error(e))
    name = a.model_name or Path(a.artifact).stem
    app = create_app(m, ServeOptions(name, a.max_waiting, speculation),
                     HttpOptions(a.api_key, a.max_body_bytes, a.body_timeout),
                     access_log=lambda line: print(line, file=sys.stderr, flush=True))
    host, port = sock.getsockname()[:2]
    kv = ", ".join(f"{k.num_blocks} {k.name}" for k in m.executor.kinds.values())
    print(f"rvrun: serving {name} at http://{host}:{port}/v1 | {m.engine.max_num_seqs} seqs, "
          f"context {m.max_context}, KV blocks {kv}"
          + (f", speculative {speculation.method} ({speculation.num_draft_tokens} drafts)"
             if speculation else ""), file=sys.stderr, flush=True)
    return run(app, sock, a.drain_timeout, log=lambda line: print(line, file=sys.stderr,
                                                                  flush=True))


def prepare_main(argv: list[str]) -> int:
    """Compile an XLA artifact's programs once on this machine into ARTIFACT.prepared, beside
    it; later starts load those executables instead of compiling (runtime/prepare.py)."""
    p = _parser("rvrun prepare", prepare_main.__doc__)
    p.add_argument("artifact", help="the XLA artifact (.rvp); the cache is written beside it")
    a = p.parse_args(argv)
    from rvcompile.runtime.prepare import prepare

    try:
        done = prepare(a.artifact)
    except (ArtifactError, FileNotFoundError) as e:
        return _fail(str(e))
    except OSError as e:  # the directory beside the artifact is not writable
        return _fail(f"cannot write beside {a.artifact}: {e.strerror or e}")
    print(f"rvrun: prepared {done.entries} executables for {done.device} in {done.seconds:.1f} s:"
          f" {done.path}", file=sys.stderr)
    return 0


@dataclass(frozen=True)
class Command:
    summary: str  # one line in `rvrun --help`
    main: Callable[[list[str]], int]  # its arguments after the command's name -> exit status


# `rvrun NAME ...` runs COMMANDS[NAME].main; a new command is one entry here.
COMMANDS: dict[str, Command] = {
    "run": Command("generate text from a prompt (the default: `rvrun ARTIFACT --prompt ...`)",
                   run_main),
    "ppl": Command("teacher-forced perplexity of a text file", ppl_main),
    "chat": Command("a conversation in the terminal, through the artifact's chat template",
                    chat_main),
    "serve": Command("an OpenAI-compatible HTTP server", serve_main),
    "prepare": Command("compile an XLA artifact once on this machine; later starts load it",
                       prepare_main),
}


def _print_load_report(m) -> None:
    """What the load cost, phase by phase (runtime/load_report.py), on stderr."""
    for line in m.load_report.lines():
        print(line, file=sys.stderr, flush=True)


def _phases(logged: bool = True) -> Phases:
    """Load (and ppl's scoring) phases on stderr: a bar on a terminal, else one line each when
    `logged` (ppl, serve: long jobs and services whose stderr is a log), else nothing (run: its
    summary line gives the load time; its stderr stays the summary or one error line)."""
    mode = Phases.mode_for(True)
    return Phases("rvrun", mode if logged or mode == "live" else "off")


def _check_http_flags(a: argparse.Namespace) -> str | None:
    """What is wrong with serve's listening and HTTP flags, if anything."""
    if not 0 <= a.port <= 65535:
        return f"--port must be in 0..65535 (0 picks a free port), got {a.port}"
    if a.api_key is not None and not (a.api_key.isascii() and a.api_key.isprintable()
                                      and a.api_key.strip() == a.api_key != ""):
        return ("--api-key (or RVRUN_API_KEY) must be printable ASCII without surrounding "
                "spaces, and not empty")
    if a.max_body_bytes < 1:
        return f"--max-body-bytes must be at least 1, got {a.max_body_bytes}"
    for flag, value in (("--body-timeout", a.body_timeout), ("--drain-timeout", a.drain_timeout)):
        if not (math.isfinite(value) and value > 0):
            return f"{flag} must be a positive number of seconds, got {value}"
    return None


def _not_utf8(flag: str, text: str) -> str | None:
    """Arguments that are not UTF-8 reach Python with each bad byte as a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"U+{bad:04X}"
        return f"{flag} is not valid UTF-8 text ({byte} at character {e.start})"
    return None


def _add_sampling(p: argparse.ArgumentParser, given: str) -> None:
    """--temperature, --top-k, --top-p, --seed; `given`: what the same seed reproduces from."""
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the K likeliest tokens; 0 keeps all")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the likeliest tokens holding this much probability")
    p.add_argument("--seed", type=int, default=0,
                   help=f"sampling seed: the same seed and {given} give the same tokens")


def _add_speculative(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, metavar="assistant|ngram",
                   help="speculative decoding: draft with the artifact's assistant (built with "
                        "--assistant) or by n-gram lookup in the sequence (built with "
                        "--num-draft-tokens); the tokens do not change")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="drafts per verify step, 1 to the artifact's (default: the artifact's)")


def _speculation(a: argparse.Namespace):
    """--speculative and --num-draft-tokens as a Speculation (or None), checked as far as
    they can be without the artifact (RequestError)."""
    from rvcompile.runtime.request_limits import RequestError, speculation_of

    spec = speculation_of(a.speculative, a.num_draft_tokens)
    if spec is not None and spec.num_draft_tokens is not None and spec.num_draft_tokens < 1:
        raise RequestError("num_draft_tokens", f"must be at least 1, got {spec.num_draft_tokens}")
    return spec


def _add_trusted_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trusted-key", action="append", default=[], metavar="PUB",
                   help="PEM Ed25519 public key: refuse the artifact unless this key (or another "
                        "--trusted-key) signed it (repeatable; default: none, unsigned "
                        "artifacts run)")
    p.add_argument("--trust-executables", action="store_true",
                   help="load the artifact's precompiled XLA executables (--topology builds); XLA "
                        "runs them unchecked, like a program, so this needs --trusted-key "
                        "(default: compile the StableHLO)")


def _trusted_keys(a: argparse.Namespace) -> list[TrustedKey] | None:
    """The --trusted-key files read, or None without the flag; ValueError (one line) if a file
    is not an Ed25519 public key, the flag comes with --no-verify, or --trust-executables
    without it."""
    if a.trust_executables and not a.trusted_key:
        raise ValueError("--trust-executables needs --trusted-key: XLA runs an executable "
                         "unchecked, so only a signer you trust may supply one")
    if not a.trusted_key:
        return None
    if a.no_verify:
        raise ValueError("--trusted-key needs the sections verified: a signature vouches for "
                         "them only through their digests; drop --no-verify")
    return [load_trusted_key(k) for k in a.trusted_key]


def _flag_error(e) -> str:
    """A RequestError in the CLI's words: its field as the flag that set it."""
    return f"--{e.param.replace('_', '-')}: {e.problem}"


def _fail(msg: str, status: int = 2) -> int:
    print(f"rvrun: error: {msg.splitlines()[0]}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
