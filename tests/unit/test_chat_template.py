"""The gateway renders chat prompts as ``transformers`` does, from the same files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lamina.services.gateway.tokenizer import ModelTokenizer, TemplateError

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there, what is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And  ünïcödé — 3 + 3?\n"},
]

# A Llama-3-style template: the BOS token from the config, role headers, a check that
# raises for roles it does not know.
LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def with_template(model: Path, template: str, tmp_path: Path) -> Path:
    """A copy of ``model`` whose tokenizer config carries ``template``."""
    copy = tmp_path / "model"
    shutil.copytree(model, copy)
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) | {"chat_template": template}
    config_path.write_text(json.dumps(config))
    return copy


@pytest.fixture(params=["model's own", "llama3-style"])
def model_dir(request, tiny_model, tmp_path):
    if request.param == "model's own":
        return tiny_model
    return with_template(tiny_model, LLAMA3_STYLE, tmp_path)


def test_chat_prompts_render_and_tokenize_as_transformers_does(model_dir):
    ours = ModelTokenizer(model_dir)
    theirs = AutoTokenizer.from_pretrained(model_dir)
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.render_chat(messages) == text
        assert ours.encode_chat(messages) == theirs(text, add_special_tokens=False).input_ids


def test_a_template_that_raises_is_a_template_error(tiny_model, tmp_path):
    tokenizer = ModelTokenizer(with_template(tiny_model, LLAMA3_STYLE, tmp_path))
    with pytest.raises(TemplateError, match="unknown role tool"):
        tokenizer.render_chat([{"role": "tool", "content": "x"}])
