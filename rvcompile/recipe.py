"""The build recipe: one YAML file that says how an artifact is made, `rvcompile build --config
FILE` (options on the command line override the file). Every build stores its recipe in the
artifact (manifest "provenance", artifacts/manifest.py), with every option filled in as the
target took it, so `rvcompile recipe ART` writes back a file that `build --config` makes the
same artifact from, byte for byte, and `rvcompile rebuild ART` does so directly.

Keys (each one the `rvcompile build` option named beside it; only model.source and target are
required; a missing option takes the CLI's default):

    model:
      source: gemma-4-31B        # MODEL: a preset name or a Hugging Face checkpoint directory
      weights: /models/g31       # --weights: the checkpoint directory of a preset
      random_weights: false      # --random-weights: seeded random weights of the real shapes
      seed: 0                    # --seed (with random_weights; default 0)
      digest: sha256:...         # the checkpoint's input files (provenance.py); checked at build
    assistant:                   # --assistant (optional): a drafter for speculative decoding
      source: DIR | PRESET
      digest: sha256:...
    chat_template:               # --chat-template (optional): sets or replaces the model's
      source: FILE               # a Jinja file
      digest: sha256:...         # its sha256; checked at build
    target: h100-fp8             # --target
    options:
      max_context: 2048          # --max-context
      max_seqs: 4                # --max-seqs
      prefill_buckets: [16, 64, 256]   # --prefill-buckets
      platforms: [tpu, cuda, cpu]      # --platforms
      topologies: []             # --topology (repeatable), e.g. [v6e:2x2]
      tp: 1                      # --tp
      kv_cache: auto             # --kv-cache
      decode_loop_steps: null    # --decode-loop-steps (null: the target's default)
      draft_tokens: null         # --num-draft-tokens (null: 3 with an assistant, else 0)

Relative paths are relative to the current directory, as on the command line; a leading ~ is
the home directory. The artifact records paths as written. A recipe is
checked once, where it is read: an unknown key, a wrong type or a value out of range is a
one-line RecipeError naming the file and the key, e.g.

    recipe.yaml: options.max_seqs: expected an int in [1, 2147483647], got 0

What depends on the target or the model (a target refusing an option, a bucket above the
model's positions) is checked by the build, as for the CLI. `--dump-ir` and `--progress` change
no byte of the artifact and are not recipe keys. Without chat_template the chat template is the
checkpoint's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rvcompile.artifacts.schema import INT32_MAX, At, SchemaError
from rvcompile.build import BuildOptions
from rvcompile.sources.model_source import CheckpointError
from rvcompile.targets.api import KV_CACHE_CHOICES, PLATFORMS
from rvcompile.yaml_file import known_keys, parse_yaml

DIGEST = r"sha256:[0-9a-f]{64}"
# The keys under options: every BuildOptions field but target (a top-level key) and dump_ir
# (prints, changes nothing); tests/test_recipe.py checks that the lists agree, so a new build
# option joins the recipe in the same change.
OPTION_KEYS = ("max_context", "max_seqs", "prefill_buckets", "platforms", "topologies", "tp",
               "kv_cache", "decode_loop_steps", "draft_tokens")
NOT_RECIPE_OPTIONS = ("target", "dump_ir")


class RecipeError(ValueError):
    """A recipe that breaks the schema; one line, 'FILE: key: what is wrong'."""


@dataclass(frozen=True)
class Source:
    """Where the model's weights come from."""

    source: str  # preset name or checkpoint directory
    weights: str | None = None  # a preset's checkpoint directory (model only)
    random_weights: bool = False
    seed: int | None = None  # with random_weights; None: 0
    digest: str | None = None  # "sha256:<hex>" of its input files; None: not checked


@dataclass(frozen=True)
class Assistant:
    """The drafter compiled in beside the model; its weights are random when the model's are."""

    source: str  # assistant preset name or checkpoint directory
    digest: str | None = None  # "sha256:<hex>" of its input files; None: not checked


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template file that sets or replaces the model's."""

    source: str  # the file's path
    digest: str | None = None  # "sha256:<hex>" of the file; None: not checked


@dataclass(frozen=True)
class Options:
    """The build options a recipe sets; None: the CLI's default (`build_options` fills them)."""

    max_context: int = 2048
    max_seqs: int = 4
    prefill_buckets: tuple[int, ...] = (16, 64, 256)
    platforms: tuple[str, ...] = PLATFORMS
    topologies: tuple[str, ...] = ()
    tp: int = 1
    kv_cache: str = "auto"
    decode_loop_steps: int | None = None  # None: the target's default
    draft_tokens: int | None = None  # None: 3 with an assistant, else 0


@dataclass(frozen=True)
class Recipe:
    model: Source
    target: str
    options: Options = Options()
    assistant: Assistant | None = None
    chat_template: ChatTemplate | None = None

    def build_options(self, dump_ir: str | None = None) -> BuildOptions:
        """The options as `build` takes them (their own range checks run here: CheckpointError
        naming the CLI option)."""
        o = self.options
        drafts = o.draft_tokens if o.draft_tokens is not None else (
            3 if self.assistant is not None else 0)
        return BuildOptions(target=self.target, max_context=o.max_context,
                            prefill_buckets=o.prefill_buckets, max_seqs=o.max_seqs,
                            platforms=o.platforms, dump_ir=dump_ir, topologies=o.topologies,
                            decode_loop_steps=o.decode_loop_steps, tp=o.tp,
                            kv_cache=o.kv_cache, draft_tokens=drafts)

    def with_options(self, opts: BuildOptions) -> Recipe:
        """This recipe with every option as `opts` has it (a target's filled-in defaults)."""
        return dataclasses.replace(self, target=opts.target, options=Options(
            **{k: getattr(opts, k) for k in OPTION_KEYS}))

    def to_json(self) -> dict[str, Any]:
        """The recipe as JSON values, every key present (what the artifact stores)."""
        d = dataclasses.asdict(self)
        d["options"] = {k: list(v) if isinstance(v, tuple) else v
                        for k, v in d["options"].items()}
        return {"model": d["model"], "assistant": d["assistant"],
                "chat_template": d["chat_template"], "target": d["target"],
                "options": d["options"]}

    def to_yaml(self, comment: str = "") -> str:
        """The recipe as a YAML file (`comment` lines first, each prefixed with '# ')."""
        head = "".join(f"# {line}\n" for line in comment.splitlines())
        return head + yaml.dump(self.to_json(), Dumper=_Dumper, sort_keys=False,
                                default_flow_style=False, width=100)


class _Dumper(yaml.SafeDumper):
    """Mappings as blocks, one key a line; lists inline ([16, 64, 256]), as a person writes
    a recipe."""


_Dumper.add_representer(list, lambda dumper, value: dumper.represent_sequence(
    "tag:yaml.org,2002:seq", value, flow_style=True))


# ---------------------------------------------------------------------------------------------
# Reading


def load_recipe(path: Path) -> Recipe:
    """Read and check the recipe file at `path`."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise RecipeError(f"{path}: cannot read: {e.strerror or e}") from None
    return parse_recipe_yaml(data, str(path))


def parse_recipe_yaml(data: bytes | str, where: str) -> Recipe:
    try:
        doc = parse_yaml(data, where)
    except SchemaError as e:
        raise RecipeError(str(e)) from None
    return parse_recipe(doc, where)


def parse_recipe(doc: Any, where: str) -> Recipe:
    """A recipe from JSON-like values (a YAML file's, or the artifact's stored one); `where`
    prefixes every error (the file, or 'ART: manifest.provenance.recipe')."""
    try:
        return _recipe(doc)
    except SchemaError as e:
        raise RecipeError(f"{where}: {e}") from None


def _recipe(doc: Any) -> Recipe:
    top = At(doc, "")
    if not isinstance(doc, dict):
        raise SchemaError(f"expected a mapping of {', '.join(_TOP)}, got "
                          f"{type(doc).__name__ if doc is not None else 'an empty file'}")
    known_keys(top, _TOP)
    for key in ("model", "target"):
        if key not in doc:
            raise SchemaError(f"{key}: missing (a recipe needs model and target)")
    model = _source(At(doc["model"], "model"))
    if model.weights is not None and model.random_weights:
        raise SchemaError("model.weights: either weights or random_weights, not both")
    if model.seed is not None and not model.random_weights:
        raise SchemaError(f"model.seed: {model.seed}: only random_weights uses a seed")
    target = At(doc["target"], "target").str(pattern=r"[a-z0-9][a-z0-9_-]{0,63}")
    assistant = _input(doc, "assistant", Assistant,
                       "an assistant preset name or a checkpoint directory")
    template = _input(doc, "chat_template", ChatTemplate, "a Jinja chat template file")
    options = Options()
    if doc.get("options") is not None:
        options = _options(At(doc["options"], "options"))
    return Recipe(model, target, options, assistant, template)


def _input(doc: dict, key: str, kind, what: str):
    """doc[key] as `kind(source, digest)` (an assistant, a chat template), or None if absent."""
    if doc.get(key) is None:
        return None
    at = At(doc[key], key)
    known_keys(at, ("source", "digest"))
    if at.obj().get("source") is None:
        at.fail(f"missing 'source' ({what})")
    digest = at.get("digest")
    return kind(_path(at["source"]), None if digest is None or digest.value is None
                else digest.str(pattern=DIGEST))


_TOP = ("model", "assistant", "chat_template", "target", "options")
_MODEL_KEYS = ("source", "weights", "random_weights", "seed", "digest")


def _path(at: At) -> str:
    return at.str(max_len=4096, printable=True)


def _source(at: At) -> Source:
    known_keys(at, _MODEL_KEYS)
    d = at.obj()
    if d.get("source") is None:
        at.fail("missing 'source' (a preset name or a checkpoint directory)")

    def opt(key: str, read):
        return read(at[key]) if d.get(key) is not None else None

    return Source(source=_path(at["source"]), weights=opt("weights", _path),
                  random_weights=bool(opt("random_weights", At.bool)),
                  seed=opt("seed", lambda a: a.int(0, None)),
                  digest=opt("digest", lambda a: a.str(pattern=DIGEST)))


def _options(at: At) -> Options:
    known_keys(at, OPTION_KEYS)
    d = at.obj()
    given: dict[str, Any] = {}
    for key, value in d.items():
        if value is None:
            continue  # null: the default
        v = at[key]
        if key in ("max_context", "max_seqs", "tp"):
            given[key] = v.int(1, INT32_MAX)
        elif key in ("decode_loop_steps", "draft_tokens"):
            given[key] = v.int(0, INT32_MAX)
        elif key == "prefill_buckets":
            sizes = [b.int(1, INT32_MAX) for b in v.items(1, 64)]
            given[key] = tuple(sorted(set(sizes)))
        elif key == "platforms":
            names = [p.str(PLATFORMS) for p in v.items(1, len(PLATFORMS))]
            if len(set(names)) != len(names):
                v.fail(f"names a platform twice: {names}")
            given[key] = tuple(names)
        elif key == "topologies":
            given[key] = tuple(t.str(pattern=r"[a-z0-9]{1,16}:[0-9x]{1,32}")
                               for t in v.items(0, 64))
        elif key == "kv_cache":
            given[key] = v.str(KV_CACHE_CHOICES)
    options = Options(**given)
    # What relates options to each other, named by key (BuildOptions names the CLI option).
    chunk = max(options.prefill_buckets)
    if chunk > options.max_context:
        at["max_context" if "max_context" in given else "prefill_buckets"].fail(
            f"max_context {options.max_context} must be >= the largest prefill bucket {chunk}")
    for key, hi in (("decode_loop_steps", chunk), ("draft_tokens", chunk - 1)):
        value = getattr(options, key)
        if value is not None and value > hi:
            at[key].fail(f"expected 0 to {hi} (the largest prefill bucket"
                         f"{' - 1' if key == 'draft_tokens' else ''}), got {value}")
    return options


def merge(recipe: Recipe | None, given: dict[str, Any]) -> Recipe:
    """`recipe` (None: the CLI's defaults) with the command line's explicitly given values on
    top. `given` keys: "model" (MODEL), "target", "weights", "random_weights", "seed",
    "assistant", "chat_template", and the OPTION_KEYS; CheckpointError (one line, naming the
    option) when the result lacks a model or target."""
    base = recipe
    if base is None:
        if "model" not in given or "target" not in given:
            missing = "MODEL" if "model" not in given else "--target"
            raise CheckpointError(f"missing {missing}: give it, or a recipe with --config")
        base = Recipe(Source(given["model"]), given["target"])
    model = base.model
    if "model" in given and given["model"] != model.source:
        model = Source(given["model"])  # another model: the file's weights and digest are not its
    model_fields = {k: given[k] for k in ("weights", "random_weights", "seed") if k in given}
    if model_fields:
        model = dataclasses.replace(model, digest=None if "weights" in given else model.digest,
                                    **model_fields)
    if model.weights is not None and model.random_weights:
        raise CheckpointError("pass either --weights DIR or --random-weights, not both")
    assistant = base.assistant
    if "assistant" in given:
        assistant = None if given["assistant"] is None else Assistant(given["assistant"])
    template = base.chat_template
    if "chat_template" in given:
        template = None if given["chat_template"] is None else ChatTemplate(given["chat_template"])
    options = dataclasses.replace(base.options,
                                  **{k: given[k] for k in OPTION_KEYS if k in given})
    return Recipe(model, given.get("target", base.target), options, assistant, template)
