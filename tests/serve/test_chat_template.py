"""Chat templates (tokenizer_config.json's chat_template): loading, rendering as transformers does, and
every failure as an ArgumentError (the server's 400)."""

from __future__ import annotations

import json

import pytest

import dlmrt
from dlmrt.core.chat_template import ChatTemplate, load_chat_template
from dlmrt.core.errors import ArgumentError
from dlmrt.models import checkpoint
from dlmrt.export.export_manifest import ExportManifest

CHATML = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'assistant' %}
<|im_start|>assistant
{{ message['content'] }}{{ eos_token }}
    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]

ADDED_BOS = {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
             "special": True}


def model_dir(tmp_path, **config):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("directory", [dlmrt.TINY_MODEL_DIR, dlmrt.TINY_ORL_MODEL_DIR], ids=["llada", "orl"])
def test_the_tiny_models_take_the_user_text_as_the_prompt(directory):
    template = load_chat_template(directory)
    assert template.render([{"role": "system", "content": "x"}, {"role": "user", "content": "sort:3142="}]) \
        == "sort:3142="
    assert template.special == {"eos_token": "<|eos|>", "pad_token": "<|pad|>", "mask_token": "<|mask|>"}


def test_the_tiny_diffusion_gemma_has_no_template():
    assert load_chat_template(dlmrt.TINY_MODEL_DIR.parent / "tiny-diffusion-gemma") is None


def test_a_chatml_template_renders_with_special_tokens_and_the_generation_prompt(tmp_path):
    template = load_chat_template(model_dir(tmp_path, chat_template=CHATML, bos_token=ADDED_BOS, eos_token="</s>",
                                            add_bos_token=True))
    assert template.special == {"bos_token": "<s>", "eos_token": "</s>"}
    history = ("<s>\n"
               "<|im_start|>system\nBe brief.<|im_end|>\n"
               "<|im_start|>user\nHi<|im_end|>\n"
               "<|im_start|>assistant\nHello</s>\n"
               "<|im_start|>user\n2+2?<|im_end|>\n")
    assert template.render(CONVERSATION) == history + "<|im_start|>assistant\n"
    assert template.render(CONVERSATION, add_generation_prompt=False) == history


def test_of_named_templates_the_default_is_taken(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0].content }}!"}]
    assert load_chat_template(model_dir(tmp_path, chat_template=named)).render(user("hi")) == "hi!"


def test_named_templates_without_a_default_are_refused(tmp_path):
    directory = model_dir(tmp_path, chat_template=[{"name": "tool_use", "template": "tools"}])
    with pytest.raises(ArgumentError, match="'tool_use' but none 'default'"):
        load_chat_template(directory)


@pytest.mark.parametrize("value", [42, {"default": "x"}, [{"name": "default"}], ["x"]])
def test_a_chat_template_of_the_wrong_type_is_refused(tmp_path, value):
    directory = model_dir(tmp_path, chat_template=value)
    with pytest.raises(ArgumentError, match=r"tokenizer_config.json: chat_template must be a string or a list"):
        load_chat_template(directory)


def test_raise_exception_is_an_argument_error_with_its_message():
    template = ChatTemplate("{% if messages[0].role != 'user' %}"
                            "{{ raise_exception('Conversations must start with a user message.') }}{% endif %}ok")
    assert template.render(user("hi")) == "ok"
    with pytest.raises(ArgumentError, match="refused the messages: Conversations must start with a user message.$"):
        template.render([{"role": "system", "content": "x"}, *user("hi")])


def test_an_undefined_variable_is_an_argument_error():
    with pytest.raises(ArgumentError, match="'system_prompt' is undefined"):
        ChatTemplate("{{ system_prompt.strip() }}").render(user("hi"))


def test_the_template_cannot_change_the_messages():
    messages = user("hi")
    with pytest.raises(ArgumentError, match="unsafe"):
        ChatTemplate("{% set _ = messages.append(1) %}").render(messages)
    assert messages == user("hi")


def test_a_template_that_does_not_compile_is_refused_with_its_line(tmp_path):
    directory = model_dir(tmp_path, chat_template="{% for m in messages %}\n{{ m.content }}\n{% endfor")
    with pytest.raises(ArgumentError, match=r"tokenizer_config.json: the chat template does not compile \(line 3"):
        load_chat_template(directory)


def test_a_file_that_is_not_json_is_refused_by_name(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "x",}')
    with pytest.raises(ArgumentError, match=r"tokenizer_config.json is not valid JSON .*fix it, or remove it"):
        load_chat_template(tmp_path)


def test_no_file_or_no_template_is_none(tmp_path):
    assert load_chat_template(tmp_path) is None
    assert load_chat_template(model_dir(tmp_path, eos_token="</s>")) is None


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([*user("a"), {"role": "user"}], r"messages\[1\] has no content"),
    ([{"content": "a"}], r"messages\[0\] has no role"),
    ([{"role": "user", "content": ["a"]}], r"messages\[0\].content must be a string, not list"),
    ([*user("a"), *user("b"), {"role": None, "content": "c"}], r"messages\[2\].role must be a string, not NoneType"),
])
def test_bad_messages_are_refused_by_index(messages, message):
    with pytest.raises(ArgumentError, match=message):
        ChatTemplate("{{ messages[0].content }}").render(messages)


def test_tojson_keeps_text_as_is_and_indents_on_request():
    template = ChatTemplate("{{ messages | tojson }}|{{ {'b': [1], 'a': none} | tojson(indent=2) }}")
    assert template.render(user("héllo <b>")) == ('[{"role": "user", "content": "héllo <b>"}]|'
                                                  '{\n  "b": [\n    1\n  ],\n  "a": null\n}')


def test_strftime_now_formats_the_time():
    assert ChatTemplate("{{ strftime_now('%Y') }}").render(user("hi")).isdigit()


def test_a_saved_model_carries_the_tokenizer_config(tmp_path):
    saved = checkpoint.save(dlmrt.load(), tmp_path / "saved")
    assert (saved / "tokenizer_config.json").read_bytes() == \
        (dlmrt.TINY_MODEL_DIR / "tokenizer_config.json").read_bytes()


def test_an_export_carries_the_chat_template(tiny_export):
    """The session's shared tiny export (about a minute on 2 cores, paid once for the whole suite)."""
    assert "tokenizer_config.json" in ExportManifest.load(tiny_export).files
    assert load_chat_template(tiny_export).render(user("rev:abc=")) == "rev:abc="
