"""Chat templates render in jinja2's immutable sandbox (rvcompile/chat_template.py, issue 12).

- What real Gemma templates use works and renders as transformers renders it: a template in the
  style of Gemma 4's (macros, namespace, dictsort, tests, string methods, undefined keys as
  false, raise_exception, tojson, loop controls, trim_blocks / lstrip_blocks) renders the exact
  text below; the built-in default template is unchanged.
- Templates reaching for Python internals, mutating objects or building on `dict` / `namespace`
  are refused in one line and run nothing (a marker file stays absent).
- The build refuses such a checkpoint template in one line naming the file; an artifact that
  carries one anyway (written by hand) is refused at render: ValueError from Model, 400 from
  `rvrun serve` (tests/test_serve.py).
"""

from __future__ import annotations

import json

import pytest

from rvcompile.chat_template import ChatTemplateError, check, compile_template
from rvcompile.sources.checkpoint import load_model_source
from rvcompile.sources.model_source import CheckpointError
from rvcompile.sources.tokenizer_files import default_chat_template

# Written for this test in the style of the Gemma 4 template: the constructs it relies on.
GEMMA_STYLE = """\
{%- macro fmt(value) -%}
    {%- if value is string -%}<|"|>{{ value }}<|"|>
    {%- elif value is boolean -%}{{ 'true' if value else 'false' }}
    {%- elif value is mapping -%}
        {%- set ns = namespace(first=true) -%}
        {{- '{' -}}
        {%- for k, v in value | dictsort -%}
            {%- if not ns.first %},{% endif -%}
            {%- set ns.first = false -%}
            {{- k }}:{{ fmt(v) -}}
        {%- endfor -%}
        {{- '}' -}}
    {%- elif value is sequence -%}[{{ value | map('string') | join(',') }}]
    {%- else -%}{{ value }}
    {%- endif -%}
{%- endmacro -%}
{%- macro strip_thinking(text) -%}
    {%- set ns = namespace(out='') -%}
    {%- for part in text.split('<channel|>') -%}
        {%- set ns.out = ns.out + part.split('<|channel>')[0] -%}
    {%- endfor -%}
    {{- ns.out | trim -}}
{%- endmacro -%}
{{- bos_token }}
{%- set loop_messages = messages -%}
{%- if tools or messages[0]['role'] == 'system' %}
<|turn>system
{% if messages[0]['role'] == 'system' %}
    {{- messages[0]['content'] | trim }}
    {%- set loop_messages = messages[1:] %}
{% endif %}
{% for tool in tools or [] %}
<|tool>{{ tool['name'] | upper }}{{ fmt(tool['parameters']) }}<tool|>
{% endfor %}
<turn|>
{% endif %}
{% for message in loop_messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] -%}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {%- endif -%}
    {%- if message['role'] == 'tool' %}{% continue %}{% endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
<|turn>{{ role }}
{% if message['tool_calls'] %}
    {%- for call in message['tool_calls'] -%}
<|tool_call>{{ call['name'] | default('?') }}{{ call['arguments'] | tojson }}<tool_call|>
    {%- endfor %}
{% endif %}
{% if role == 'model' %}{{ strip_thinking(message['content']) }}{% else %}
{{- message['content'] | trim }}{% endif %}
<turn|>
{% endfor %}
{% if add_generation_prompt %}
<|turn>model
{% endif %}
"""

MESSAGES = [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "  Weather in Paris?"},
    {"role": "assistant", "content": "<|channel>thinking<channel|>Let me check.",
     "tool_calls": [{"name": "get", "arguments": {"city": "Paris", "unit": "°C"}}]},
    {"role": "tool", "content": "21"},
    {"role": "user", "content": "Thanks"},
]
TOOLS = [{"name": "get", "parameters": {"city": "string", "metric": True, "n": [1, 2]}}]

EXPECTED = """\
<bos><|turn>system
Be brief.<|tool>GET{city:<|"|>string<|"|>,metric:true,n:[1,2]}<tool|>
<turn|>
<|turn>user
Weather in Paris?<turn|>
<|turn>model
<|tool_call>get{"city": "Paris", "unit": "°C"}<tool_call|>Let me check.<turn|>
<|turn>user
Thanks<turn|>
<|turn>model
"""

ATTACKS = [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}",
     "access to attribute '__class__' of 'str' object is unsafe"),
    ("{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
     "access to attribute '__init__' of 'type' object is unsafe"),
    ("{{ joiner.__init__.__globals__['os'].popen('touch MARKER').read() }}",
     "access to attribute '__init__' of 'type' object is unsafe"),
    ("{{ lipsum.__globals__['os'].system('touch MARKER') }}",
     "access to attribute '__globals__' of 'function' object is unsafe"),
    ("{{ self.__init__.__globals__ }}", "of 'TemplateReference' object is unsafe"),
    ("{{ raise_exception.__globals__['__builtins__']['open']('MARKER', 'w') }}",
     "access to attribute '__globals__' of 'function' object is unsafe"),
    ("{{ '{0.__class__.__base__}'.format('') }}",
     "access to attribute '__class__' of 'str' object is unsafe"),
    ("{{ dict.__class__ }}", "access to attribute '__class__' of '_Dict' object is unsafe"),
    ("{{ namespace.__init__.__globals__ }}", "access to attribute '__init__' of 'type'"),
    ("{% set ns = namespace(__class__=1) %}", "may not start with an underscore: '__class__'"),
    ("{{ messages.append(1) }}", "access to attribute 'append' of 'list' object is unsafe"),
    ("{{ messages[0].update(role='system') }}", "attribute 'update' of 'dict' object is unsafe"),
    ("{{ tojson.__globals__ }}", "'tojson' is undefined"),
]


def _render(template: str, messages=MESSAGES, **variables) -> str:
    return compile_template(template).render(messages, bos_token="<bos>", eos_token="<eos>",
                                             **variables)


def test_a_gemma_style_template_renders_what_transformers_renders():
    from transformers.utils.chat_template_utils import render_jinja_template

    assert _render(GEMMA_STYLE, tools=TOOLS) == EXPECTED
    for messages, tools in ((MESSAGES, TOOLS), (MESSAGES, None), (MESSAGES[1:], None)):
        (want,), _ = render_jinja_template([messages], tools=tools, chat_template=GEMMA_STYLE,
                                           add_generation_prompt=True, bos_token="<bos>",
                                           eos_token="<eos>")
        assert _render(GEMMA_STYLE, messages, tools=tools) == want
    no_system = _render(GEMMA_STYLE, MESSAGES[1:2])  # no tools, no system turn: no system block
    assert no_system == "<bos><|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n"
    with pytest.raises(ChatTemplateError, match="^chat template: Unknown role: robot$"):
        _render(GEMMA_STYLE, [{"role": "robot", "content": "hi"}])
    assert _render("{% generation %}{{ 1 + 1 }}{% endgeneration %}") == "2"
    assert _render("{{ strftime_now('%Y') | length }}") == "4"
    assert _render("{{ dict(a=1) | tojson }}") == '{"a": 1}'


def test_the_default_template_is_unchanged():
    text = _render(default_chat_template(), MESSAGES[:2])
    assert text == ("<bos><start_of_turn>system\nBe brief. <end_of_turn>\n"
                    "<start_of_turn>user\n  Weather in Paris?<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize("template, says", ATTACKS)
def test_templates_reaching_outside_the_sandbox_are_refused(template, says, tmp_path,
                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ChatTemplateError) as e:
        _render(template)
    msg = str(e.value)
    assert msg.startswith("chat template: ") and says in msg and "\n" not in msg
    assert not (tmp_path / "MARKER").exists()


def test_errors_are_one_line():
    with pytest.raises(ChatTemplateError, match=r"^chat template: line 2: unexpected '}'$"):
        compile_template("ok\n{{ messages }")
    with pytest.raises(ChatTemplateError, match="^chat template: division by zero$"):
        _render("{{ 1 / 0 }}")
    with pytest.raises(ChatTemplateError, match="^chat template: line 1: Encountered unknown "):
        compile_template("{% x %}")
    with pytest.raises(ChatTemplateError, match=r"^messages\[0\].content: a set is not JSON"):
        _render("{{ messages }}", [{"role": "user", "content": {"a"}}])


def test_check_renders_one_user_turn():
    check(default_chat_template())
    with pytest.raises(ChatTemplateError, match="needs a system turn"):
        check("{% if messages[0]['role'] != 'system' %}"
              "{{ raise_exception('needs a system turn') }}{% endif %}")


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
@pytest.mark.parametrize("template, says", [
    ("{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
     "chat template: access to attribute '__init__' of 'type' object is unsafe"),
    ("{% for m in messages %}{{ m['content'] }", "chat template: line 1: unexpected '}'"),
])
def test_the_build_refuses_a_bad_checkpoint_template(where, template, says, tmp_path,
                                                     monkeypatch):
    from rvcompile.build import BuildOptions, build_artifact
    from rvcompile.model.presets import get_preset

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(get_preset("gemma-4-tiny-dense").to_hf_dict()))
    (d / "tokenizer.json").write_text(_synthetic_tokenizer())
    if where == "chat_template.jinja":
        (d / where).write_text(template)
    else:
        (d / where).write_text(json.dumps({"chat_template": template}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as e:
        load_model_source(str(d), random_weights=True)
    assert str(e.value) == f"{d / where}: {says}"
    out = tmp_path / "x.rvp"
    with pytest.raises(CheckpointError, match="is unsafe|unexpected"):
        build_artifact(str(d), out, BuildOptions(target="xla-f32", max_context=64,
                                                 prefill_buckets=(16,), platforms=("cpu",)),
                       random_weights=True, progress=False)
    assert not out.exists() and not (tmp_path / "MARKER").exists()


def _synthetic_tokenizer() -> str:
    from rvcompile.model.presets import get_preset
    from rvcompile.sources.tokenizer_files import synthetic_tokenizer_json

    return synthetic_tokenizer_json(get_preset("gemma-4-tiny-dense").vocab_size)


def test_a_model_refuses_a_hostile_template_at_render(tmp_path, monkeypatch):
    """An artifact written by hand around the build's check: refused where it renders."""
    from rvcompile.artifacts import Artifact, ArtifactWriter
    from rvcompile.build import BuildOptions, build_artifact
    from rvcompile.runtime import load
    from rvcompile.runtime.executors.xla import XlaExecutor

    plain, hostile = tmp_path / "plain.rvp", tmp_path / "hostile.rvp"
    build_artifact("gemma-4-tiny-dense", plain,
                   BuildOptions(target="xla-f32", max_context=64, prefill_buckets=(16,),
                                max_seqs=1, platforms=("cpu",)), random_weights=True,
                   progress=False, log=lambda s: None)
    with Artifact.open(plain) as art, ArtifactWriter(hostile, art.header) as w:
        for name in art.sections:
            w.add(name, b"{{ cycler.__init__.__globals__.os.system('touch MARKER') }}"
                  if name == "chat_template" else art.buffer(name))
        w.commit(art.manifest)
    monkeypatch.setattr(XlaExecutor, "_warm_up", lambda self: 0.0)  # rendering only
    monkeypatch.chdir(tmp_path)
    model = load(hostile)
    for _ in range(2):  # a failed compile is not cached as a success
        with pytest.raises(ValueError, match="^chat template: access to attribute '__init__'"):
            model.apply_chat_template([{"role": "user", "content": "hi"}])
    assert not (tmp_path / "MARKER").exists()
