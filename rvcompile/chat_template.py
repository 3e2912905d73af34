"""Chat templates, compiled and rendered in jinja2's immutable sandbox.

A chat template is Jinja text that came with the checkpoint: data from the file, never code to
trust. It is compiled by `jinja2.sandbox.ImmutableSandboxedEnvironment`, set up as Hugging Face
transformers sets up theirs (trim_blocks, lstrip_blocks, loop controls; the `tojson` filter
without HTML escaping; `raise_exception`, `strftime_now`, a `dict` and a `namespace` that cannot
be used to reach Python internals; the `{% generation %}` tag, rendered as its body), so that a
template written for transformers renders the same text here. A template that reaches for Python
internals (`''.__class__`, `cycler.__init__.__globals__`), calls a method that mutates an object
(`messages.append`) or fails in any other way raises ChatTemplateError, one line. Everything a
template sees is rebuilt from plain JSON values first, so no object with methods of its own
reaches it.

The build checks the checkpoint's template with `check`; the runtime compiles it once
(`compile_template`) and renders each conversation. Both run this one module, so what builds
renders. So it is a shared leaf, like dtypes.py: the compiler (sources/checkpoint.py) and the
runtime (runtime/model.py) may both import it, and it imports nothing of either
(tests/test_layering.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# What `check` renders: every template must accept one user turn and a generation prompt.
SAMPLE_MESSAGES = ({"role": "user", "content": "Hello"},)


class ChatTemplateError(ValueError):
    """A chat template that does not compile or render; the message is one line."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with it):
    rendered as its body; rvcompile never asks for the mask."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """The template's `dict`: builds dicts, but is no type to climb from."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """The template's `namespace`: refuses attribute names starting with an underscore."""

    def __init__(*args, **kwargs):  # Jinja's signature trick: `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"a namespace attribute may not start with an underscore: {name!r}")


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, refusing an unsafe attribute where it is read (Jinja returns
    an Undefined that only raises when used further, so `{{ ''.__class__ }}` printed nothing)."""

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            "object is unsafe")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_Dict(), namespace=_Namespace)
    return env


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    where = f"line {e.lineno}: " if isinstance(e, jinja2.TemplateSyntaxError) else ""
    return f"chat template: {where}{text[0] if text else type(e).__name__}"


def _plain(value: Any, where: str) -> Any:
    """`value` rebuilt from JSON types (str subclasses and the like become their base type)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, dict):
        return {_plain(k, where): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ChatTemplateError(f"{where}: a {type(value).__name__} is not JSON data")


@dataclass(frozen=True)
class ChatTemplate:
    """A template compiled in the sandbox; compile once, render per conversation."""

    template: jinja2.Template

    def render(self, messages, *, add_generation_prompt: bool = True, **variables: Any) -> str:
        """The template over `messages` (a list of dicts) and `variables` (bos_token, ...), all
        rebuilt from plain JSON values first."""
        messages = _plain(messages, "messages")
        variables = _plain(variables, "variables")
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt, **variables)
        except Exception as e:  # the template's failure: sandbox, raise_exception, types, ...
            raise ChatTemplateError(_one_line(e)) from e


def compile_template(text: str) -> ChatTemplate:
    try:
        return ChatTemplate(_environment().from_string(text))
    except Exception as e:  # syntax, an unknown tag or filter
        raise ChatTemplateError(_one_line(e)) from e


def check(text: str, **variables: Any) -> None:
    """Raise ChatTemplateError unless `text` compiles in the sandbox and renders one user turn
    with a generation prompt (what `rvrun --chat` renders)."""
    compile_template(text).render(list(SAMPLE_MESSAGES), **variables)
