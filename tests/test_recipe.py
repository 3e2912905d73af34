"""Build recipes (rvcompile/recipe.py, provenance.py, rebuild.py): `rvcompile build --config`,
`rvcompile recipe ART`, `rvcompile rebuild ART`, run in this process (typer's runner), on the
embedded default model with small options so each build takes a few seconds.

- every BuildOptions field is a recipe key (or deliberately not one);
- round trip: build from a recipe, `rvcompile recipe` writes it back equal;
- the command line overrides the file;
- rebuild is byte-identical for xla-f32 and for h100-fp8 (stub cubins: tests/stub_cubins.py);
  with another toolchain it names the tool; a changed input file is refused, naming the file;
- the XLA programs hold no source path (what made builds depend on where they ran);
- bad recipes: one line naming the file and the key;
- the examples/ recipes load and fit their targets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from stub_cubins import stub_nvcc
from typer.testing import CliRunner

from rvcompile import provenance
from rvcompile.artifacts import Artifact
from rvcompile.build import BuildOptions
from rvcompile.cli import app
from rvcompile.model.presets import PRESETS
from rvcompile.recipe import (
    NOT_RECIPE_OPTIONS,
    OPTION_KEYS,
    Assistant,
    ChatTemplate,
    Options,
    Recipe,
    RecipeError,
    Source,
    load_recipe,
    parse_recipe_yaml,
)
from rvcompile.targets import registry

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "rv-gemma4-tiny"
EXAMPLES = ROOT / "examples"
SMALL = Options(max_context=128, max_seqs=2, prefill_buckets=(8, 32), platforms=("cpu",))


def cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def write(path: Path, recipe: Recipe) -> Path:
    path.write_text(recipe.to_yaml("a test recipe"))
    return path


@pytest.fixture(scope="module")
def digest() -> str:
    return provenance.digest_directory(MODEL_DIR, weights=True).digest


def test_every_build_option_is_a_recipe_key():
    fields = {f.name for f in dataclasses.fields(BuildOptions)}
    assert set(OPTION_KEYS) == fields - set(NOT_RECIPE_OPTIONS)
    assert {f.name for f in dataclasses.fields(Options)} == set(OPTION_KEYS)


ROUND_TRIP = dataclasses.replace(SMALL, decode_loop_steps=8, draft_tokens=0, kv_cache="float")


@pytest.fixture(scope="module")
def default_xla(tmp_path_factory, digest) -> tuple[Path, Recipe]:
    """The default model built for xla-f32 from a recipe that gives every key."""
    tmp = tmp_path_factory.mktemp("default")
    recipe = Recipe(Source(str(MODEL_DIR), digest=digest), "xla-f32", ROUND_TRIP)
    art = tmp / "a.rvp"
    cli("build", "--config", write(tmp / "r.yaml", recipe), "-o", art, "--no-progress")
    return art, recipe


def test_round_trip_build_recipe_back_equal(default_xla, tmp_path):
    """Every key given (as the target resolves them), so what comes back is what went in."""
    art, recipe = default_xla
    text = cli("recipe", art)
    assert parse_recipe_yaml(text, "stdout") == recipe
    assert "config.json" in text and "jax" in text.splitlines()[1]
    (tmp_path / "back.yaml").write_text(text)
    assert parse_recipe_yaml(parse_recipe_yaml(text, "x").to_yaml(), "y") == recipe


def test_rebuild_xla_is_byte_identical(default_xla, tmp_path):
    art, _ = default_xla
    out = cli("rebuild", art, "-o", tmp_path / "again.rvp")
    assert "identical" in out
    assert (tmp_path / "again.rvp").read_bytes() == art.read_bytes()


def test_command_line_overrides_the_file_and_defaults_fill_in(tmp_path):
    recipe = Recipe(Source("gemma-4-tiny-dense", random_weights=True), "tpu-bf16", SMALL)
    art = tmp_path / "a.rvp"
    cli("build", "--config", write(tmp_path / "r.yaml", recipe), "--max-seqs", "1",
        "--target", "xla-f32", "--seed", "5", "-o", art, "--no-progress")
    back = parse_recipe_yaml(cli("recipe", art), "stdout")
    assert back.target == "xla-f32" and back.options.max_seqs == 1
    assert back.options.prefill_buckets == (8, 32) and back.options.max_context == 128
    assert back.options.decode_loop_steps == 32  # the target's default, recorded
    assert back.model == Source("gemma-4-tiny-dense", random_weights=True, seed=5)


def test_a_signed_original_compares_up_to_its_signature_page(default_xla, tmp_path):
    from rvcompile.artifacts.signature import load_signing_key, sign_artifact, write_keypair

    art, _ = default_xla
    signed = tmp_path / "signed.rvp"
    shutil.copyfile(art, signed)
    key = load_signing_key(write_keypair(tmp_path / "k")[0])
    sign_artifact(signed, key, "ci")
    out = cli("rebuild", signed, "-o", tmp_path / "again.rvp")
    assert "identical to" in out and "up to its signature page (1 signature(s)" in out
    sign_artifact(tmp_path / "again.rvp", key, "ci")
    assert (tmp_path / "again.rvp").read_bytes() == signed.read_bytes()


def test_rebuild_h100_is_byte_identical(tmp_path):
    art = tmp_path / "h.rvp"
    recipe = Recipe(Source(str(MODEL_DIR)), "h100-fp8",
                    Options(max_context=128, max_seqs=2, prefill_buckets=(8, 32)))
    with stub_nvcc():
        cli("build", "--config", write(tmp_path / "r.yaml", recipe), "-o", art, "--no-progress")
        out = cli("rebuild", art)
    assert "identical" in out
    assert (tmp_path / "h.rebuilt.rvp").read_bytes() == art.read_bytes()
    stored = yaml.safe_load(cli("recipe", art))
    assert stored["options"]["platforms"] == ["cuda"]
    assert "nvcc Build cuda_13.0" in cli("recipe", art)


def test_xla_programs_hold_no_source_path(tmp_path):
    art = tmp_path / "x.rvp"
    cli("build", "gemma-4-tiny-dense", "--random-weights", "--target", "xla-f32",
        "--max-context", "64", "--prefill-buckets", "8", "--max-seqs", "1", "--platforms",
        "cpu", "-o", art, "--no-progress")
    with Artifact.open(art) as a:
        programs = bytes(a.buffer("programs"))
    assert b"jit(" in programs  # op names stay
    assert not re.search(rb"\.py|rvcompile/|<module>", programs)


@pytest.fixture(scope="module")
def small_xla(tmp_path_factory) -> Path:
    art = tmp_path_factory.mktemp("rebuild") / "x.rvp"
    cli("build", "gemma-4-tiny-dense", "--random-weights", "--seed", "3", "--target", "xla-f32",
        "--max-context", "64", "--prefill-buckets", "8", "--max-seqs", "1", "--platforms",
        "cpu", "-o", art, "--no-progress")
    return art


def test_rebuild_names_a_different_toolchain(small_xla, tmp_path, monkeypatch):
    real = provenance.toolchain

    def newer(manifest):
        return {**real(manifest), "jax": "99.0.0"}

    monkeypatch.setattr(provenance, "toolchain", newer)
    out = cli("rebuild", small_xla, "-o", tmp_path / "b.rvp", code=1)
    jax_version = metadata.version("jax")
    assert f"different toolchain: jax {jax_version} in x.rvp, 99.0.0 here" in out
    assert "manifest provenance.toolchain.jax" in out
    assert "not deterministic" not in out


def test_a_preset_with_random_weights_rebuilds_without_files(small_xla, tmp_path):
    stored = yaml.safe_load(cli("recipe", small_xla))
    assert stored["model"] == {"source": "gemma-4-tiny-dense", "weights": None,
                               "random_weights": True, "seed": 3, "digest": None}
    assert "identical" in cli("rebuild", small_xla, "-o", tmp_path / "b.rvp")
    out = cli("rebuild", small_xla, "--weights", MODEL_DIR, "-o", tmp_path / "c.rvp", code=2)
    assert "rvcompile: error: " in out


def test_an_assistant_recipe_rebuilds_byte_identical(tmp_path):
    recipe = Recipe(Source("gemma-4-tiny", random_weights=True, seed=1), "xla-f32",
                    Options(max_context=64, max_seqs=1, prefill_buckets=(8, 16),
                            platforms=("cpu",)),
                    assistant=Assistant("gemma-4-tiny-assistant"))
    art = tmp_path / "spec.rvp"
    cli("build", "--config", write(tmp_path / "r.yaml", recipe), "-o", art, "--no-progress")
    back = parse_recipe_yaml(cli("recipe", art), "stdout")
    assert back.assistant == Assistant("gemma-4-tiny-assistant")
    assert back.options.draft_tokens == 3  # the default with an assistant, recorded
    assert "identical" in cli("rebuild", art)


def test_a_chat_template_recipe_records_its_digest_and_rebuilds(small_xla, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    art = tmp_path / "chat.rvp"
    cli("build", "gemma-4-tiny-dense", "--random-weights", "--seed", "3", "--target", "xla-f32",
        "--max-context", "64", "--prefill-buckets", "8", "--max-seqs", "1", "--platforms",
        "cpu", "--chat-template", template, "-o", art, "--no-progress")
    back = parse_recipe_yaml(cli("recipe", art), "stdout")
    digest = "sha256:" + hashlib.sha256(template.read_bytes()).hexdigest()
    assert back.chat_template == ChatTemplate(str(template), digest)
    assert Artifact.open(art).manifest["provenance"]["inputs"]["chat_template"] == {
        "t.jinja": digest.removeprefix("sha256:")}
    assert "identical" in cli("rebuild", art, "-o", tmp_path / "b.rvp")
    template.write_text(template.read_text() + " ")
    out = cli("rebuild", art, "-o", tmp_path / "c.rvp", code=2)
    assert "chat_template.digest" in out and "t.jinja has other contents" in out
    # the same model without the template differs from the one with it
    plain = bytes(Artifact.open(small_xla).buffer("chat_template"))
    assert plain != bytes(Artifact.open(art).buffer("chat_template"))


def copy_model(dst: Path) -> Path:
    shutil.copytree(MODEL_DIR, dst, ignore=shutil.ignore_patterns("*.txt", "*.md", "*log*"))
    return dst


def test_rebuild_from_moved_weights_and_a_changed_file(tmp_path):
    model = copy_model(tmp_path / "a" / "rv-gemma4-tiny")
    art = tmp_path / "m.rvp"
    cli("build", model, "--target", "xla-f32", "--max-context", "64", "--prefill-buckets", "8",
        "--max-seqs", "1", "--platforms", "cpu", "-o", art, "--no-progress")
    moved = tmp_path / "b" / "rv-gemma4-tiny"
    moved.parent.mkdir()
    model.rename(moved)
    out = cli("rebuild", art, "--weights", moved, "-o", tmp_path / "r.rvp")
    assert "identical" in out
    gen = moved / "generation_config.json"
    gen.write_text(gen.read_text().replace("}", ', "top_k": 7}', 1))
    out = cli("rebuild", art, "--weights", moved, "-o", tmp_path / "s.rvp", code=2)
    assert "model.digest" in out and "generation_config.json has other contents" in out
    assert not (tmp_path / "s.rvp").exists()
    other = tmp_path / "c" / "elsewhere"
    shutil.copytree(moved, other)
    out = cli("rebuild", art, "--weights", other, "-o", tmp_path / "t.rvp", code=2)
    assert "named 'rv-gemma4-tiny'" in out


def test_a_wrong_digest_is_refused_at_build(tmp_path):
    recipe = Recipe(Source(str(MODEL_DIR), digest="sha256:" + "0" * 64), "xla-f32", SMALL)
    out = cli("build", "--config", write(tmp_path / "r.yaml", recipe), "-o", tmp_path / "a.rvp",
              code=2)
    assert "model.digest: the checkpoint files have digest sha256:" in out
    assert not (tmp_path / "a.rvp").exists()


BAD = [
    ("model: {source: x}\ntarget: xla-f32\nmax_seqs: 2\n", "max_seqs: unknown key"),
    ("model: {source: x}\ntarget: xla-f32\noptions: {max_seq: 2}\n",
     "options.max_seq: unknown key"),
    ("model: {source: x}\ntarget: xla-f32\noptions: {max_seqs: 0}\n",
     "options.max_seqs: expected an int in [1, 2147483647], got 0"),
    ("model: {source: x}\ntarget: xla-f32\noptions: {max_seqs: two}\n",
     "options.max_seqs: expected an int in [1, 2147483647], got 'two'"),
    ("model: {source: x}\ntarget: xla-f32\noptions: {tp: true}\n", "options.tp: expected an int"),
    ("model: {source: x}\ntarget: xla-f32\noptions: {platforms: cpu}\n",
     "options.platforms: expected a list"),
    ("model: {source: x}\ntarget: xla-f32\noptions: {platforms: [gpu]}\n",
     "options.platforms[0]: expected one of"),
    ("model: {source: x}\ntarget: xla-f32\noptions: {kv_cache: int4}\n",
     "options.kv_cache: expected one of"),
    ("model: {source: x}\ntarget: xla-f32\noptions: {max_context: 16}\n",
     "options.max_context: max_context 16 must be >= the largest prefill bucket 256"),
    ("model: {source: x}\ntarget: xla-f32\noptions: {draft_tokens: 300}\n",
     "options.draft_tokens: expected 0 to 255"),
    ("model: {source: x}\ntarget: xla-f32\noptions: {topologies: [v6e]}\n",
     "options.topologies[0]: expected a string matching"),
    ("model: {source: x, digest: abc}\ntarget: xla-f32\n", "model.digest: expected a string"),
    ("model: {source: x, seed: 1}\ntarget: xla-f32\n", "model.seed: 1: only random_weights"),
    ("model: {source: x, seed: -1, random_weights: true}\ntarget: xla-f32\n",
     "model.seed: expected an int >= 0"),
    ("model: {source: x, weights: w, random_weights: true}\ntarget: xla-f32\n",
     "model.weights: either weights or random_weights"),
    ("model: {source: x, random_weights: yes please}\ntarget: xla-f32\n",
     "model.random_weights: expected true or false"),
    ("model: {weights: w}\ntarget: xla-f32\n", "model: missing 'source'"),
    ("model: {source: x}\ntarget: xla-f32\nassistant: {source: a, seed: 2}\n",
     "assistant.seed: unknown key"),
    ("model: {source: x}\n", "target: missing"),
    ("target: xla-f32\n", "model: missing"),
    ("model: {source: x}\ntarget: [xla-f32]\n", "target: expected a string"),
    ("model: {source: x}\ntarget: xla-f32\ntarget: tpu-bf16\n", "key 'target' given twice"),
    ("model: {source: x\ntarget: xla-f32\n", "not YAML"),
    ("- model\n", "expected a mapping"),
    ("", "an empty file"),
    ("model: !!python/object/apply:os.system [true]\ntarget: xla-f32\n", "not YAML"),
]


@pytest.mark.parametrize(("text", "needle"), BAD, ids=[n for _, n in BAD])
def test_bad_recipes_are_refused_naming_the_file_and_key(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg
    assert needle in msg, msg


def test_a_bad_recipe_on_the_command_line_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {source: gemma-4-tiny}\ntarget: xla-f32\noptions: {tp: 0}\n")
    out = cli("build", "--config", path, "-o", tmp_path / "a.rvp", code=2)
    assert out.strip() == (f"rvcompile: error: {path}: options.tp: expected an int in [1, "
                           "2147483647], got 0")
    assert "missing MODEL" in cli("build", "--target", "xla-f32", "-o", tmp_path / "a.rvp",
                                  code=2)


def test_an_artifact_without_a_recipe_is_named(tmp_path):
    from rvcompile.build import build_artifact

    art = tmp_path / "plain.rvp"
    build_artifact("gemma-4-tiny-dense", art, BuildOptions(
        "xla-f32", max_context=64, prefill_buckets=(8,), max_seqs=1, platforms=("cpu",)),
        random_weights=True, progress=False, log=lambda s: None)
    assert "plain.rvp: no recipe stored" in cli("recipe", art, code=2)


@pytest.mark.parametrize("name", ["recipe-31b-h100.yaml", "recipe-31b-tpu-v6e-2x2.yaml"])
def test_example_recipes_load_and_fit_their_targets(name):
    from rvcompile.targets.xla.precompile import parse_topology

    recipe = load_recipe(EXAMPLES / name)
    assert recipe.model.source in PRESETS
    opts = recipe.build_options()
    target = registry()[recipe.target]
    if not opts.topologies:
        target.check_options(opts)  # what the build checks before any work
    for topo in opts.topologies:  # check_options would need libtpu here
        assert parse_topology(topo).chips == opts.tp
        assert "tpu" in opts.platforms
    if opts.tp > 1:
        from rvcompile.model.presets import get_preset
        from rvcompile.targets.xla.sharding import check_tp

        check_tp(get_preset(recipe.model.source), opts.tp)  # heads split evenly
    text = (EXAMPLES / name).read_text()
    assert text.count("#") > 5  # commented


PROVENANCE_DAMAGE = [
    (lambda p: p["toolchain"].pop("nvcc"), "manifest.provenance.toolchain: names"),
    (lambda p: p["toolchain"].update(rvcompile="9.9"),
     "manifest.provenance.toolchain.rvcompile: '9.9' differs from the header's"),
    (lambda p: p["toolchain"].update(jax=3), "manifest.provenance.toolchain.jax: expected a str"),
    (lambda p: p["inputs"].update(weights={}), "manifest.provenance.inputs.weights: an input is"),
    (lambda p: p["inputs"]["model"].update({"config.json": "xyz"}),
     "manifest.provenance.inputs.model.config.json: expected a string matching"),
    (lambda p: p["inputs"]["model"].update({"../x": "0" * 64}), "'../x' is not a file name"),
    (lambda p: p["recipe"].update(target="tpu-int8"),
     "manifest.provenance.recipe.target: 'tpu-int8' differs from the header's 'xla-f32'"),
    (lambda p: p["recipe"].update(options=[]),
     "manifest.provenance.recipe.options: expected an object"),
    (lambda p: p.pop("inputs"), "manifest.provenance: missing required key 'inputs'"),
]


@pytest.mark.parametrize(("damage", "needle"), PROVENANCE_DAMAGE,
                         ids=[n for _, n in PROVENANCE_DAMAGE])
def test_the_manifest_schema_checks_provenance(default_xla, damage, needle):
    import copy

    from rvcompile.artifacts import ArtifactError
    from rvcompile.artifacts.manifest import parse_manifest

    art, _ = default_xla
    with Artifact.open(art) as a:
        header, manifest = a.header, copy.deepcopy(a.manifest)
        sizes = {n: s.size for n, s in a.sections.items()}
    assert parse_manifest(header, manifest, sizes, "a.rvp").provenance is not None
    damage(manifest["provenance"])
    with pytest.raises(ArtifactError) as e:
        parse_manifest(header, manifest, sizes, "a.rvp")
    assert str(e.value).startswith("a.rvp: ") and needle in str(e.value), str(e.value)


def test_a_stored_recipe_with_a_bad_field_is_named(default_xla, tmp_path):
    from rvcompile.recipe import parse_recipe

    art, recipe = default_xla
    stored = recipe.to_json()
    stored["options"]["tp"] = 0
    with pytest.raises(RecipeError, match=r"^a.rvp: manifest.provenance.recipe: options.tp: "):
        parse_recipe(stored, "a.rvp: manifest.provenance.recipe")
