"""What a person sees first: `--help` of rvrun and rvcompile (every command listed, every option
with help text and its default, names never cut), "did you mean" for a mistyped rvrun command,
and the warnings a build prints for what it clamps or replaces."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from rvcompile.cli import app
from rvcompile.runtime import cli as rvrun

RVCOMPILE_COMMANDS = ("build", "recipe", "rebuild", "inspect", "verify", "sign", "keygen",
                      "targets")


def _options(help_text: str) -> list[tuple[str, str]]:
    """(option names, its help text) of each option entry of an argparse or click help."""
    entries, current = [], None
    for line in help_text.splitlines():
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if m:
            current = [m.group(1), m.group(2) or ""]
            entries.append(current)
        elif current is not None and line.startswith("      ") and line.strip():
            current[1] += " " + line.strip()
        elif not line.strip() or not line.startswith(" "):
            current = None
    return [(names, text) for names, text in entries]


def _has_default(names: str, text: str) -> bool:
    return "default" in text or "required" in text or names.startswith(("-h", "--help"))


@pytest.mark.parametrize("command", ["run", "chat", "ppl", "serve"])
def test_rvrun_every_option_has_help_and_default(command, capsys):
    argv = ["--help"] if command == "run" else [command, "--help"]
    with pytest.raises(SystemExit) if command != "run" else _nothing():
        rvrun.main(argv)
    out = capsys.readouterr().out
    options = _options(out)
    assert len(options) >= 5
    for names, text in options:
        assert text.strip(), f"rvrun {command}: {names} has no help text"
        assert _has_default(names, text), f"rvrun {command}: {names} shows no default: {text}"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_rvrun_help_lists_every_command(capsys):
    assert rvrun.main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^  (\w+) +\S.*$", out.split("commands:")[1], re.M)
    assert tuple(listed) == tuple(rvrun.COMMANDS) and {"run", "ppl", "serve"} <= set(listed)


def test_rvrun_without_arguments_prints_help(capsys):
    assert rvrun.main([]) == 2
    assert "commands:" in capsys.readouterr().out


@pytest.mark.parametrize(("word", "hint"), [("serv", "serve"), ("pp", "ppl"), ("rn", "run"),
                                             ("zzzz", None)])
def test_rvrun_unknown_command_did_you_mean(word, hint, capsys):
    assert rvrun.main([word, "x.rvp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rvrun: error: {word!r} is neither a command")
    assert len(err.splitlines()) == 1
    assert (f"did you mean {hint!r}?" in err) if hint else "did you mean" not in err


def test_rvrun_missing_artifact_says_so(tmp_path, capsys):
    assert rvrun.main([str(tmp_path / "nothere.rvp"), "--prompt", "x"]) == 2
    assert "No such file" in capsys.readouterr().err


def _invoke(*args: str, columns: int = 80):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})


@pytest.mark.parametrize("command", RVCOMPILE_COMMANDS)
def test_rvcompile_every_option_has_help_and_default(command):
    r = _invoke(command, "--help")
    assert r.exit_code == 0, r.output
    for names, text in _options(r.output.split("Options:")[-1]):
        assert text.strip(), f"rvcompile {command}: {names} has no help text"
        flag = " <" not in names  # a switch: off unless given
        assert flag or _has_default(names, text), f"rvcompile {command}: {names}: {text}"


def test_rvcompile_help_never_cuts_option_names():
    r = _invoke("build", "--help", columns=40)
    for name in ("--random-weights", "--prefill-buckets", "--decode-loop-steps",
                 "--num-draft-tokens", "--progress / --no-progress", "--kv-cache"):
        assert name in r.output
    assert "…" not in r.output


def test_rvcompile_help_lists_every_command():
    r = _invoke("--help")
    for c in RVCOMPILE_COMMANDS:
        assert re.search(rf"^  {c} +\S", r.output, re.M), c


def test_missing_model_directory_says_it_does_not_exist(tmp_path):
    r = _invoke("build", str(tmp_path / "nope"), "--target", "xla-f32", "-o",
                str(tmp_path / "x.rvp"))
    assert r.exit_code == 2
    assert f"{tmp_path / 'nope'}: no such directory" in r.output
    (tmp_path / "empty").mkdir()
    r = _invoke("build", str(tmp_path / "empty"), "--target", "xla-f32", "-o",
                str(tmp_path / "x.rvp"))
    assert "not a model directory (needs config.json)" in r.output


def test_build_warns_of_clamp_and_replaced_weights(tmp_path):
    """--max-context beyond the model's positions is clamped, and --random-weights on a
    checkpoint directory replaces its trained weights: each one warning line on stderr."""
    out = tmp_path / "w.rvp"
    r = _invoke("build", "models/rv-gemma4-tiny", "--target", "xla-f32", "--platforms", "cpu",
                "--random-weights", "--max-context", "100000000", "--prefill-buckets", "16",
                "--max-seqs", "1", "--no-progress", "-o", str(out))
    assert r.exit_code == 0, r.output
    warnings = [line for line in r.stderr.splitlines() if line.startswith("rvcompile: warning:")]
    assert len(warnings) == 2, r.stderr
    assert "--random-weights" in warnings[0] and "2 safetensors file(s)" in warnings[0]
    assert "--max-context 100000000" in warnings[1] and "building for 4096 tokens" in warnings[1]
    assert out.is_file()


def test_rvcompile_unknown_command_did_you_mean():
    r = _invoke("buidl", "x")
    assert r.exit_code == 2 and "No such command 'buidl'. Did you mean 'build'" in r.output
