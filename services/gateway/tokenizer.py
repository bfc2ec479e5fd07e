"""The model's own tokenizer and chat template, loaded from its checkpoint directory."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from lamina.libs.bounded import BoundedDict

TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message", "bos_token",
     "eos_token", "chat_template", "tokenize"}
)  # fmt: skip
"""What the gateway itself gives a chat template (a request's kwargs may not set them)."""


class TemplateError(ValueError):
    """The chat template could not render these messages."""


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A completion's prompt text."""

    text: str
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (its BOS, where its config adds one)."""

    @property
    def chars(self) -> int:
        return len(self.text)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat and how its template renders it (``transformers``' ``apply_chat_template``
    options, as vLLM takes them per request)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    """OpenAI's tool definitions, for the template."""
    add_generation_prompt: bool = True
    """End with the opening of the assistant's turn."""
    continue_final_message: bool = False
    """End inside the last message, which the model then continues."""
    add_special_tokens: bool = False
    """Add the tokenizer's special tokens on top of the template's (vLLM's default: no)."""
    template: str | None = None
    """A request's own Jinja template (None: the model's)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """More variables for the template (``documents``, ``reasoning_effort``, ...)."""

    @property
    def chars(self) -> int:
        return sum(len(m.get("content") or "") for m in self.messages)


Prompt = TextPrompt | ChatPrompt
"""A prompt the tokenizer encodes (token ids need no tokenizer)."""

_REQUEST_TEMPLATES = 16
"""Requests' own chat templates kept compiled."""


def _token_text(value: Any) -> str | None:
    """``tokenizer_config.json`` stores special tokens as strings or ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class ModelTokenizer:
    """Encode text, decode tokens and render chat prompts exactly as the model expects."""

    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: the gateway needs the model's tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", False))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        # The environment ``transformers`` renders chat templates in: the same filters and
        # globals, so a prompt is the one ``apply_chat_template`` would make.
        self._env = env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.chat_template = env.from_string(template) if template else None
        self._request_templates: BoundedDict[str, Template] = BoundedDict(_REQUEST_TEMPLATES)
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.max_token_chars = max(len(token) for token in self.tokenizer.get_vocab())
        """The longest token's text: no token covers more characters of a prompt (a
        byte-level token's string has a character per byte it covers)."""

    @property
    def eos_token_id(self) -> int | None:
        """The id of the tokenizer config's EOS token (None: it names none)."""
        return None if self.eos_token is None else self.tokenizer.token_to_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s tokens, with the model's BOS first when its tokenizer config adds one
        (``add_special_tokens``), as a completion prompt is encoded."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's ``bad_words`` as token sequences: each word as it tokenizes on its own
        and, where that differs in its first token only, after a space (a word inside a
        text mostly follows one)."""
        sequences: list[list[int]] = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False).ids
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids
            if alone:
                sequences.append(alone)
            if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
                sequences.append(spaced)
        return sequences

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token's own string in the vocabulary (``Ġ`` and all, as ``transformers``'
        ``convert_ids_to_tokens``)."""
        return [self.tokenizer.id_to_token(i) or "" for i in token_ids]

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat as the model's template (or ``template``, a request's own) writes it,
        ``tools`` (OpenAI's tool definitions) and ``template_kwargs`` passed to it as
        ``transformers`` passes them; with ``continue_final_message``, cut just after
        the last message's content (as ``transformers`` does), so that the model
        continues that message."""
        compiled = self._compiled(template)
        try:
            text = compiled.render(
                **(template_kwargs or {}),
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except Exception as exc:  # template errors are the client's messages' fault
            raise TemplateError(f"chat template failed: {exc}") from exc
        if continue_final_message:
            final = messages[-1]["content"]
            if final not in text:  # a template that trims messages: trim it too
                final = final.strip()
            end = text.rfind(final)
            if not final or end < 0:
                raise TemplateError("the final message does not appear in the rendered chat")
            text = text[: end + len(final)]
        return text

    def _compiled(self, template: str | None) -> Template:
        """The model's template, or a request's own (compiled once while it is in use)."""
        if template is None:
            if self.chat_template is None:
                raise TemplateError("this model has no chat template; use /v1/completions")
            return self.chat_template
        compiled = self._request_templates.get(template)
        if compiled is None:
            try:
                compiled = self._env.from_string(template)
            except Exception as exc:
                raise TemplateError(f"chat_template does not compile: {exc}") from exc
            self._request_templates[template] = compiled
        else:
            self._request_templates.move_to_end(template)
        return compiled

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A completion's text, or a chat through its template."""
        if isinstance(prompt, TextPrompt):
            return self.encode(prompt.text, prompt.add_special_tokens)
        text = self.render_chat(
            prompt.messages,
            prompt.add_generation_prompt,
            prompt.continue_final_message,
            prompt.tools,
            prompt.template,
            prompt.template_kwargs,
        )
        # The rendered template already carries its special tokens (e.g. a BOS); more
        # only where asked (vLLM's add_special_tokens for a chat).
        return self.encode(text, prompt.add_special_tokens)

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """A chat's tokens with the template's defaults."""
        return self.encode_prompt(ChatPrompt(messages, tools))


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``transformers``' ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
