"""`rvrun serve --config FILE` (runtime/serve/config.py): every key read and checked, the API
key taken from the environment variable the file names, errors in one line naming the file and
the key, and the command line overriding the file (seen through what serve then fails on, so no
artifact is needed)."""

from __future__ import annotations

import argparse

import pytest

from rvcompile.runtime.cli import main
from rvcompile.runtime.serve.config import (
    KEYS,
    SPECULATIVE,
    ServeConfig,
    ServeConfigError,
    apply,
    given_on_command_line,
    load_serve_config,
)
from rvcompile.runtime.speculative import METHODS

FULL = """\
artifact: g31.rvp
host: 0.0.0.0
port: 8081
model_name: gemma-4-31b
max_num_seqs: 8
max_model_len: 4096
kv_blocks: 1024
kv_sliding_blocks: 256
gpu_memory_utilization: 0.85
prefill_budget: 1024
max_waiting: 64
max_body_bytes: 1048576
body_timeout: 12.5
drain_timeout: 5
api_key_env: MY_KEY
trusted_key: [release.pub]
trust_executables: true
no_verify: false
speculative: ngram
num_draft_tokens: 3
"""


def load(tmp_path, text: str, environ: dict | None = None) -> ServeConfig:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return load_serve_config(path, environ if environ is not None else {})


def test_every_key_is_read(tmp_path):
    cfg = load(tmp_path, FULL, {"MY_KEY": "sk-local-123"})
    assert cfg == ServeConfig(
        artifact="g31.rvp", host="0.0.0.0", port=8081, model_name="gemma-4-31b", max_num_seqs=8,
        max_model_len=4096, kv_blocks=1024, kv_sliding_blocks=256, gpu_memory_utilization=0.85,
        prefill_budget=1024, max_waiting=64,
        max_body_bytes=1 << 20, body_timeout=12.5, drain_timeout=5.0, api_key="sk-local-123",
        trusted_key=("release.pub",), trust_executables=True, no_verify=False,
        speculative="ngram", num_draft_tokens=3)
    assert len(KEYS) == len(FULL.splitlines())
    assert load(tmp_path, "") == ServeConfig()
    assert load(tmp_path, "port: null\n") == ServeConfig()


BAD = [
    ("prot: 80\n", "prot: unknown key (known: artifact, host, port"),
    ("api_key: sk-123\n", "api_key: unknown key"),
    ("port: 70000\n", "port: expected an int in [0, 65535], got 70000"),
    ("port: '80'\n", "port: expected an int in [0, 65535], got '80'"),
    ("max_num_seqs: 0\n", "max_num_seqs: expected an int in [1, 2147483647], got 0"),
    ("kv_blocks: 2.5\n", "kv_blocks: expected an int"),
    ("prefill_budget: 0\n", "prefill_budget: expected an int in [1, 2147483647], got 0"),
    ("gpu_memory_utilization: 0\n", "gpu_memory_utilization: expected a fraction in (0, 1], "
                                      "got 0"),
    ("gpu_memory_utilization: 1.5\n", "gpu_memory_utilization: expected a finite number in"),
    ("body_timeout: 0\n", "body_timeout: expected a positive number of seconds, got 0"),
    ("drain_timeout: .nan\n", "drain_timeout: expected a finite number"),
    ("no_verify: maybe\n", "no_verify: expected true or false"),
    ("speculative: medusa\n", "speculative: expected one of"),
    ("num_draft_tokens: 0\n", "num_draft_tokens: expected an int in [1, 2147483647], got 0"),
    ("trusted_key: release.pub\n", "trusted_key: expected a list"),
    ("host: 'a b'\n", "host: expected a string matching"),
    ("api_key_env: UNSET_VAR\n", "api_key_env: environment variable UNSET_VAR is not set"),
    ("api_key_env: EMPTY\n", "api_key_env: environment variable EMPTY must hold printable"),
    ("api_key_env: 'my key'\n", "api_key_env: expected a string matching"),
    ("port: 1\nport: 2\n", "key 'port' given twice"),
    ("port: [1\n", "not YAML"),
    ("- port\n", "expected a mapping of options, got a list"),
    ("port: !!python/object/apply:os.getpid []\n", "not YAML"),
]


@pytest.mark.parametrize(("text", "needle"), BAD, ids=[n for _, n in BAD])
def test_bad_configs_are_refused_naming_the_file_and_key(tmp_path, text, needle):
    with pytest.raises(ServeConfigError) as e:
        load(tmp_path, text, {"EMPTY": ""})
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'serve.yaml'}: ") and "\n" not in msg
    assert needle in msg, msg


def test_the_command_line_wins_over_the_file():
    p = argparse.ArgumentParser()
    p.add_argument("artifact", nargs="?")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--trusted-key", action="append", default=[])
    argv = ["--port", "9000", "--trusted-key", "a.pub"]
    a = p.parse_args(argv)
    assert given_on_command_line(p, argv) == {"port", "trusted_key"}
    apply(a, ServeConfig(artifact="f.rvp", port=1, max_waiting=7, no_verify=True,
                         trusted_key=("b.pub",)), given_on_command_line(p, argv))
    assert vars(a) == {"artifact": "f.rvp", "port": 9000, "max_waiting": 7, "no_verify": True,
                       "trusted_key": ["a.pub"]}


def serve(capsys, *argv: str) -> str:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_rvrun_serve_reads_the_file_and_the_flags_override_it(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"artifact: {tmp_path / 'from-file.rvp'}\nhost: 256.1.1.1\nport: 0\n")
    assert "cannot listen on 256.1.1.1:0" in serve(capsys, "--config", str(cfg))
    err = serve(capsys, "--config", str(cfg), "--host", "127.0.0.1")
    assert "from-file.rvp" in err
    err = serve(capsys, str(tmp_path / "from-cli.rvp"), "--config", str(cfg), "--host",
                "127.0.0.1")
    assert "from-cli.rvp" in err
    cfg.write_text("port: 0\nmax_waiting: 0\n")
    assert serve(capsys, "x.rvp", "--config", str(cfg)) == (
        f"rvrun: error: {cfg}: max_waiting: expected an int in [1, 2147483647], got 0")
    assert serve(capsys, "x.rvp", "--port", "0", "--gpu-memory-utilization", "1.5") == (
        "rvrun: error: --gpu-memory-utilization must be a fraction in (0, 1], got 1.5")
    cfg.write_text("port: 0\n")
    assert serve(capsys, "--config", str(cfg)) == (
        "rvrun: error: missing ARTIFACT: give it, or artifact: in the --config file")
    monkeypatch.delenv("SERVE_TEST_KEY", raising=False)
    cfg.write_text("api_key_env: SERVE_TEST_KEY\n")
    assert "api_key_env: environment variable SERVE_TEST_KEY is not set" in serve(
        capsys, "x.rvp", "--config", str(cfg))


def test_the_example_config_loads():
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "serve.yaml"
    cfg = load_serve_config(example, {"RVRUN_API_KEY": "sk-example"})
    assert cfg.api_key == "sk-example" and cfg.artifact == "g31-h100.rvp"
    assert example.read_text().count("#") > 5


def test_speculative_keys_name_the_server_flags():
    assert SPECULATIVE == tuple(METHODS)
