"""`rvrun serve --config FILE`: the server's options as a YAML file; options given on the command
line override it, the file overrides the defaults.

Each key is the flag of the same name with underscores (`max_num_seqs` for `--max-num-seqs`),
and means what the flag means (`rvrun serve --help`); every key is optional:

    artifact: g31.rvp               # ARTIFACT
    host: 0.0.0.0                   # --host
    port: 8080                      # --port, 0 to 65535 (0 picks a free port)
    model_name: gemma-4-31b         # --model-name: the model id requests name
    max_num_seqs: 8                 # --max-num-seqs
    max_model_len: 4096             # --max-model-len
    kv_blocks: 1024                 # --kv-blocks
    kv_sliding_blocks: 256          # --kv-sliding-blocks
    gpu_memory_utilization: 0.9     # --gpu-memory-utilization, in (0, 1] (h100 artifacts)
    prefill_budget: 1024            # --prefill-budget (prompt tokens per engine step)
    max_waiting: 256                # --max-waiting
    max_body_bytes: 8388608         # --max-body-bytes
    body_timeout: 30                # --body-timeout (seconds)
    drain_timeout: 20               # --drain-timeout (seconds)
    api_key_env: RVRUN_API_KEY      # the environment variable that holds the API key
    trusted_key: [release.pub]      # --trusted-key (a list)
    trust_executables: false        # --trust-executables
    no_verify: false                # --no-verify
    speculative: ngram              # --speculative: assistant or ngram
    num_draft_tokens: 3             # --num-draft-tokens (1 to the artifact's; checked at start)

The API key itself never sits in the file (a file is copied, committed and read by more people
than the secret should be): `api_key_env` names the environment variable that holds it, and a
variable that is unset or not a valid key is refused when the file is read. An `api_key` key is
refused as unknown. Relative paths are relative to the current directory, as on the command line.

A file is checked once, where it is read: an unknown key, a wrong type or a value out of range
is a one-line ServeConfigError naming the file and the key, e.g.

    serve.yaml: port: expected an int in [0, 65535], got 70000
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rvcompile.artifacts.schema import INT32_MAX, At, SchemaError
from rvcompile.yaml_file import known_keys, parse_yaml

ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]{0,127}"


class ServeConfigError(ValueError):
    """A serve config that breaks the schema; one line, 'FILE: key: what is wrong'."""


@dataclass(frozen=True)
class ServeConfig:
    """What a file sets, by the argparse destination of its flag; None: not in the file."""

    artifact: str | None = None
    host: str | None = None
    port: int | None = None
    model_name: str | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    kv_blocks: int | None = None
    kv_sliding_blocks: int | None = None
    gpu_memory_utilization: float | None = None
    prefill_budget: int | None = None
    max_waiting: int | None = None
    max_body_bytes: int | None = None
    body_timeout: float | None = None
    drain_timeout: float | None = None
    api_key: str | None = None  # read from the variable the file's api_key_env names
    trusted_key: tuple[str, ...] | None = None
    trust_executables: bool | None = None
    no_verify: bool | None = None
    speculative: str | None = None
    num_draft_tokens: int | None = None

    def set_values(self) -> dict[str, Any]:
        """destination -> value, for what the file sets."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


_COUNTS = ("max_num_seqs", "max_model_len", "kv_blocks", "kv_sliding_blocks", "max_waiting",
           "max_body_bytes", "prefill_budget")
_SECONDS = ("body_timeout", "drain_timeout")
_FLAGS = ("trust_executables", "no_verify")
KEYS = ("artifact", "host", "port", "model_name", *_COUNTS, "gpu_memory_utilization",
        *_SECONDS, "api_key_env", "trusted_key", *_FLAGS, "speculative", "num_draft_tokens")
SPECULATIVE = ("assistant", "ngram")  # runtime/speculative.METHODS


def load_serve_config(path: Path, environ: Mapping[str, str]) -> ServeConfig:
    """Read and check the file at `path`; `environ` holds the variable api_key_env names."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ServeConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        return _config(parse_yaml(data, str(path)), environ)
    except SchemaError as e:
        text = str(e)
        raise ServeConfigError(text if text.startswith(f"{path}: ") else f"{path}: {text}"
                               ) from None


def _config(doc: Any, environ: Mapping[str, str]) -> ServeConfig:
    if doc is None:
        return ServeConfig()  # an empty file sets nothing
    if not isinstance(doc, dict):
        raise SchemaError(f"expected a mapping of options, got a {type(doc).__name__}")
    known_keys(At(doc, ""), KEYS)
    got: dict[str, Any] = {}
    for key, value in doc.items():
        if value is None:
            continue  # null: the default
        at = At(value, key)
        if key in ("artifact", "model_name"):
            got[key] = at.str(max_len=4096, printable=True)
        elif key == "host":
            got[key] = at.str(max_len=253, pattern=r"[A-Za-z0-9_.:%-]+")
        elif key == "port":
            got[key] = at.int(0, 65535)
        elif key in _COUNTS:
            got[key] = at.int(1, INT32_MAX)
        elif key == "gpu_memory_utilization":
            fraction = at.number(0.0, 1.0)
            if fraction <= 0:
                at.expected("a fraction in (0, 1]")
            got[key] = fraction
        elif key in _SECONDS:
            seconds = at.number(0.0, 86400.0)
            if seconds <= 0:
                at.expected("a positive number of seconds")
            got[key] = seconds
        elif key in _FLAGS:
            got[key] = at.bool()
        elif key == "trusted_key":
            got[key] = tuple(k.str(max_len=4096, printable=True) for k in at.items(1, 64))
        elif key == "speculative":
            got[key] = at.str(SPECULATIVE)
        elif key == "num_draft_tokens":
            got[key] = at.int(1, INT32_MAX)
        elif key == "api_key_env":
            got["api_key"] = _api_key(at, environ)
    return ServeConfig(**got)


def _api_key(at: At, environ: Mapping[str, str]) -> str:
    name = at.str(pattern=ENV_NAME)
    key = environ.get(name)
    if key is None:
        at.fail(f"environment variable {name} is not set")
    if not (key.isascii() and key.isprintable() and key.strip() == key != ""):
        at.fail(f"environment variable {name} must hold printable ASCII without surrounding "
                "spaces, and not be empty")
    return key


class _Given(argparse.Namespace):
    """A namespace that argparse takes to have every attribute already, so it sets only what
    the command line gives (it skips defaults for attributes a namespace has)."""

    def __getattr__(self, name: str) -> None:  # called only for attributes not set
        if name.startswith("_"):  # argparse's own bookkeeping, never an option's destination
            raise AttributeError(name)
        return None


def given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations `argv` sets explicitly (parsed again, defaults left out)."""
    ns = parser.parse_args(argv, namespace=_Given())
    return {dest for dest, value in vars(ns).items() if value is not None}


def apply(args: argparse.Namespace, config: ServeConfig, given: set[str]) -> None:
    """Put the file's values into `args` where the command line did not give the option."""
    for dest, value in config.set_values().items():
        if dest not in given:
            setattr(args, dest, list(value) if isinstance(value, tuple) else value)
