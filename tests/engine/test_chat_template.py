"""Where the chat template comes from: ``--chat-template`` (a file or the text),
``chat_template.jinja``, ``tokenizer_config.json`` (a string or a list of named ones)."""

from __future__ import annotations

import json

import pytest

from halfmoon.cli import main
from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.tokenizer import (
    CHAT_TEMPLATE_FILE,
    Tokenizer,
    build_preset_tokenizer,
    chat_template_from_config,
    load_chat_template,
)

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return build_preset_tokenizer(512)


def _model_dir(tmp_path, hf_tokenizer, chat_template=None, jinja=None):
    """A model dir with tokenizer.json, a tokenizer_config.json holding ``chat_template``
    (left out when None) and ``chat_template.jinja`` holding ``jinja`` (when given)."""
    hf_tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / CHAT_TEMPLATE_FILE).write_text(jinja)
    return tmp_path


def _rendered(tok: Tokenizer) -> str:
    return tok.decode(tok.apply_chat_template(MESSAGES), skip_special_tokens=False)


def test_string_template_from_tokenizer_config(tmp_path, hf_tokenizer):
    tok = Tokenizer.from_dir(_model_dir(tmp_path, hf_tokenizer, "A:{{ messages[0].content }}"))
    assert _rendered(tok) == "A:hello"


def test_list_form_picks_default_else_first(tmp_path, hf_tokenizer):
    """Some checkpoints carry ``[{"name": ..., "template": ...}]``: before, the list went
    to Jinja as is (a TypeError) and the request failed."""
    named = [
        {"name": "tool_use", "template": "T:{{ messages[0].content }}"},
        {"name": "default", "template": "D:{{ messages[0].content }}"},
    ]
    assert _rendered(Tokenizer.from_dir(_model_dir(tmp_path, hf_tokenizer, named))) == "D:hello"
    assert chat_template_from_config(named[:1]) == "T:{{ messages[0].content }}"
    assert chat_template_from_config([]) is None
    assert chat_template_from_config(None) is None


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path, hf_tokenizer):
    model_dir = _model_dir(tmp_path, hf_tokenizer, "CFG", jinja="J:{{ messages[0].content }}")
    assert _rendered(Tokenizer.from_dir(model_dir)) == "J:hello"


def test_given_template_wins_over_the_model_dirs(tmp_path, hf_tokenizer):
    model_dir = _model_dir(tmp_path, hf_tokenizer, "CFG", jinja="JINJA")
    tok = Tokenizer.from_dir(model_dir, "G:{{ messages[0].content }}")
    assert _rendered(tok) == "G:hello"


def test_no_template_says_how_to_give_one(tmp_path, hf_tokenizer):
    tok = Tokenizer.from_dir(_model_dir(tmp_path, hf_tokenizer))
    with pytest.raises(HalfmoonError, match="--chat-template"):
        tok.apply_chat_template(MESSAGES)


def test_load_chat_template_takes_a_file_or_the_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}!")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}!"
    assert load_chat_template("{% for m in messages %}x{% endfor %}").startswith("{% for")
    with pytest.raises(HalfmoonError, match="no-such.jinja"):
        load_chat_template(str(tmp_path / "no-such.jinja"))


def test_serve_refuses_a_missing_template_file_before_starting(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path / "cache"))
    missing = tmp_path / "missing.jinja"
    assert main(["serve", "--chat-template", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("halfmoon: error:") and "missing.jinja" in err
    assert not (tmp_path / "cache").exists()  # nothing was prepared or started


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if thinking %}<think>{% endif %}"
    "{% endif %}"
)


def test_the_final_message_left_open_and_template_variables(tmp_path, hf_tokenizer):
    """vLLM's continue_final_message (the text ends with the final message's content,
    no end of turn) and chat_template_kwargs (a variable of the template)."""
    tok = Tokenizer.from_dir(_model_dir(tmp_path, hf_tokenizer, CHATML))
    chat = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]

    def text(messages, **options) -> str:
        ids = tok.apply_chat_template(messages, **options)
        return tok.decode(ids, skip_special_tokens=False)

    assert text(chat, add_generation_prompt=False, continue_final_message=True).endswith(
        "<|im_start|>assistant\nThe answer is"
    )
    assert text(chat, add_generation_prompt=False).endswith("The answer is<|im_end|>\n")
    assert text(MESSAGES).endswith("<|im_start|>assistant\n")
    assert text(MESSAGES, template_kwargs={"thinking": True}).endswith("assistant\n<think>")
    with pytest.raises(HalfmoonError, match="cannot set messages"):
        text(MESSAGES, template_kwargs={"messages": []})
    empty = [*MESSAGES, {"role": "assistant", "content": ""}]
    with pytest.raises(HalfmoonError, match="continue_final_message needs"):
        text(empty, add_generation_prompt=False, continue_final_message=True)
