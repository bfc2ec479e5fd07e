"""OpenAI request bodies (with vLLM's extras) and how they map onto the wire request."""

from __future__ import annotations

import functools
import time
from typing import Annotated, Any, Literal

import msgspec

from lamina.libs.errors import invalid_field
from lamina.schemas.v1.generate import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    Count,
    LogitBias,
    MaxTokens,
    MinP,
    Penalty,
    RepetitionPenalty,
    Sampling,
    Seed,
    Sla,
    StructuredOutput,
    Temperature,
    TokenId,
    TopK,
    TopP,
)
from lamina.services.gateway.errors import InvalidRequest
from lamina.services.gateway.tokenizer import TEMPLATE_VARIABLES, ChatPrompt, TextPrompt
from lamina.services.gateway.tool_calls import tool_constraint
from lamina.services.gateway.truncation import Truncation

MAX_N = 128
"""Most sequences one request may ask for (OpenAI's limit)."""

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
"""Widest beam search: each step scores ``2 * n`` next tokens (``beam_search.py``)."""

LogprobRequest = Annotated[int, msgspec.Meta(ge=-1, le=MAX_LOGPROBS)]
"""A count of logprobs to return; -1 asks for the whole vocabulary (vLLM's), which
:func:`logprob_count` allows only where it is within :data:`MAX_LOGPROBS`."""


def logprob_count(asked: int | None, vocab_size: int, param: str) -> int | None:
    """The count of logprobs ``asked`` for, -1 read as the whole vocabulary; over
    :data:`MAX_LOGPROBS` is refused as vLLM refuses it at its default ``--max-logprobs``."""
    if asked != -1:
        return asked
    if vocab_size > MAX_LOGPROBS:
        raise InvalidRequest(
            f"Requested logprobs of the whole vocabulary ({vocab_size}), which is greater "
            f"than max allowed: {MAX_LOGPROBS}",
            param,
        )
    return vocab_size


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    """A last chunk (``choices: []``) with the whole response's usage."""
    continuous_usage_stats: bool = False
    """With ``include_usage``, every chunk also carries its choice's usage so far (vLLM's)."""


# Fields of OpenAI's and vLLM's request bodies that Lamina does not implement, with the
# values that ask for nothing (what clients send when they mean "off") and why it refuses
# anything else: a 400 naming the field, as vLLM refuses what it cannot do, never a 200
# that quietly did something else. ``tests/unit/test_vllm_fields.py`` checks that every
# field of vLLM's two request schemas is either declared on a body here or listed here.
_NO_MEDIA = "Lamina serves text-only models"
_NOT_SUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "use tools"),
    "function_call": ((None, "none"), "use tool_choice"),
    "suffix": ((None, ""), "no served model is trained to fill in the middle"),
    "best_of": ((None, 1), "use n"),
    "guided_json": ((None,), "use structured_outputs"),
    "guided_regex": ((None,), "use structured_outputs"),
    "guided_choice": ((None,), "use structured_outputs"),
    "guided_grammar": ((None,), "use structured_outputs"),
    "guided_decoding_backend": ((None,), "use structured_outputs"),
    "guided_whitespace_pattern": ((None,), "use structured_outputs.disable_any_whitespace"),
    "early_stopping": ((None, False), "beams end at EOS or max_tokens, as vLLM's do"),
    "watermarking": ((None, False), "no watermark is implemented"),
    "logprob_token_ids": ((None, []), "use logprobs or top_logprobs"),
    "prompt_embeds": ((None, [], ""), "prompts are text or token ids"),
    "mm_payload": ((None, "tensors"), _NO_MEDIA),
    "return_mm_kwargs": ((None, False), _NO_MEDIA),
    "media_io_kwargs": ((None, {}), _NO_MEDIA),
    "mm_processor_kwargs": ((None, {}), _NO_MEDIA),
    "include_reasoning": ((None, True), "no reasoning parser separates reasoning from content"),
    "thinking_token_budget": ((None, -1), "no reasoning parser bounds the thinking"),
    "repetition_detection": ((None,), "use stop strings or repetition_penalty"),
    "stream_interval": ((None, 1), "every token is streamed as it comes"),
    "cache_salt": ((None,), "the prefix cache has no per-tenant salt yet"),
    "kv_transfer_params": ((None,), "KV is not transferred between workers yet"),
    "ec_transfer_params": ((None,), "encoder caches are not transferred"),
    "vllm_xargs": ((None, {}), "there are no engine extension arguments"),
    "return_weight_versions": ((None, False), "weights are not versioned"),
    "return_token_offsets": ((None, False), "use return_token_ids"),
    "return_prompt_text": ((None, False), "use echo"),
    "routed_experts_prompt_start": ((None, 0), "no served model routes experts"),
}
"""Field -> (the values that ask for nothing, why any other value is refused)."""


@functools.cache
def _field_names(kind: type) -> frozenset[str]:
    """``kind``'s fields' wire names, once per type: ``msgspec.structs.fields`` resolves
    the type's annotations at every call, which costs more than decoding the body."""
    return frozenset(f.encode_name for f in msgspec.structs.fields(kind))


def decode_request(body: bytes, kind: type) -> tuple[Any, list[str]]:
    """A completion or chat body decoded as ``kind``, and the fields it had that neither
    Lamina nor vLLM knows (ignored, and the response says so: vLLM's rule for unknown
    fields). A field Lamina knows of but does not implement, asking for anything,
    is refused (:class:`InvalidRequest` naming it)."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request body: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequest("request body is nested too deeply") from exc
    known = _field_names(kind)
    ignored = []
    for name, raw in fields.items():
        if name in known:
            continue
        if name not in _NOT_SUPPORTED:
            ignored.append(name)
            continue
        neutral, why = _NOT_SUPPORTED[name]
        try:
            value = msgspec.json.decode(raw)
        except RecursionError as exc:
            raise InvalidRequest(f"{name} is nested too deeply", name) from exc
        if value not in neutral:
            raise InvalidRequest(f"{name} is not supported: {why}", name)
    try:
        return decode_body(body, kind), sorted(ignored)
    except InvalidRequest as exc:
        if exc.param is not None and exc.param.startswith("logit_bias"):
            raise _logit_bias_error(fields["logit_bias"]) or exc from exc
        raise


def _logit_bias_error(raw: msgspec.Raw) -> InvalidRequest | None:
    """What is wrong with a ``logit_bias``, naming the keys at fault (msgspec's error says
    only where); None if it is not an object of numbers."""
    try:
        bias = msgspec.json.decode(raw, type=dict[str, float])
    except msgspec.DecodeError:
        return None
    not_ids = [k for k in bias if not (k.isascii() and k.isdigit())]
    if not_ids:
        return InvalidRequest(
            "logit_bias contains key(s) that cannot be converted to integer token IDs: "
            f"{not_ids[:8]}",
            "logit_bias",
        )
    out = {k: v for k, v in bias.items() if not -100 <= v <= 100}
    if out:
        return InvalidRequest(
            f"logit_bias values must be within [-100, 100]; got {dict(list(out.items())[:8])}",
            "logit_bias",
        )
    return None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's ``response_format.json_schema``."""

    name: str
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or
    ``json_schema``."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs``: one of ``json`` (a schema, as an object or JSON
    text), ``regex``, ``choice``, ``grammar`` (EBNF or Lark), ``json_object``."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False


def structured_output(
    response_format: ResponseFormat | None, outputs: StructuredOutputs | None
) -> StructuredOutput | None:
    """The wire constraint a body asks for (vLLM's rules: ``response_format`` and
    ``structured_outputs`` may not ask for two different constraints); raises
    :class:`InvalidRequest`."""
    from_format: dict[str, Any] = {}
    if response_format is not None:
        if response_format.type == "structural_tag":
            raise InvalidRequest(
                "response_format type 'structural_tag' is not supported", "response_format"
            )
        if response_format.type == "json_object":
            from_format = {"json_object": True}
        elif response_format.type == "json_schema":
            spec = response_format.json_schema
            if spec is None or spec.schema is None:
                raise InvalidRequest(
                    "response_format type 'json_schema' needs json_schema.schema",
                    "response_format",
                )
            from_format = {"json": msgspec.json.encode(spec.schema).decode()}
    fields: dict[str, Any] = {}
    if outputs is not None:
        if outputs.structural_tag is not None:
            raise InvalidRequest("structural_tag is not supported", "structured_outputs")
        if outputs.json_object is False:
            raise InvalidRequest(
                "structured_outputs.json_object must be true if set", "structured_outputs"
            )
        fields = {
            name: value
            for name in ("json", "regex", "choice", "grammar", "json_object")
            if (value := getattr(outputs, name)) is not None
        }
        if isinstance(fields.get("json"), dict | bool):
            fields["json"] = msgspec.json.encode(fields["json"]).decode()
        if outputs.disable_any_whitespace:
            fields["disable_any_whitespace"] = True
    asked = {k: v for k, v in fields.items() if k != "disable_any_whitespace"}
    if from_format and asked and asked != from_format:
        raise InvalidRequest(
            "response_format and structured_outputs ask for different constraints",
            "structured_outputs",
        )
    fields |= from_format
    if not fields:
        if outputs is not None:
            raise InvalidRequest(
                "structured_outputs needs one of json, regex, choice, grammar, json_object",
                "structured_outputs",
            )
        return None
    try:
        return msgspec.convert(fields, StructuredOutput)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc), "structured_outputs") from exc


#: Body fields that are ``Sampling`` fields under the same name and meaning.
_SAMPLING_FIELDS = tuple(
    f.name
    for f in msgspec.structs.fields(Sampling)
    if f.name not in ("max_tokens", "logprobs", "bad_words_token_ids", "structured")
)


class OpenAIBody(msgspec.Struct, kw_only=True):
    """What completions and chat completions bodies share: the sampling knobs (typed with
    the wire ``Sampling``'s own ranges, so a bad value is a 400 naming the field when the
    body is decoded), streaming, stop strings, the SLA. Unknown fields are ignored; fields
    Lamina does not implement are refused (:func:`decode_request`), and combinations it
    cannot serve (:meth:`refuse_unsupported`)."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    """Sequences per prompt, each a choice (``index``: prompt-major, as vLLM numbers them)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    # vLLM extensions
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """Accepted as vLLM accepts it; like vLLM's with a fast tokenizer (every Lamina
    model's ``tokenizer.json``), it changes nothing."""
    return_tokens_as_token_ids: bool | None = None
    """Logprobs name each token ``token_id:<id>`` instead of by its text."""
    return_token_ids: bool | None = None
    """vLLM's: each choice's ``token_ids`` (and the prompt's, ``prompt_token_ids``)."""
    request_id: Annotated[str, msgspec.Meta(pattern=r"^[\x21-\x7e]{1,256}$")] | None = None
    """vLLM's: the client's name for the request, sent back as the ``x-request-id``
    header when that header did not give one. The response's ``id`` stays the gateway's:
    a client's id never names work on the bus. Up to 256 visible ASCII characters."""
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)] | None = None
    """vLLM's: keep only this many of each prompt's tokens (-1: as many as the longest
    context served leaves room for one generated token)."""
    truncation_side: Literal["left", "right"] | None = None
    """Which end truncation cuts: ``left`` (the default, vLLM's for generation) keeps the
    last tokens, ``right`` the first."""
    add_special_tokens: bool | None = None
    """vLLM's: add the tokenizer's special tokens (its BOS) to the prompt; default yes for
    a completion's text, no for a chat (its template writes them)."""
    use_beam_search: bool = False
    """vLLM's: the ``n`` best of a beam search ``n`` wide (``beam_search.py``)."""
    length_penalty: Annotated[float, msgspec.Meta(ge=-10, le=10)] = 1.0
    """Beam search ranks a beam by its logprob over its length to this power."""
    session_id: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    """vLLM's: requests of one session go to the same worker while it can take them, so a
    conversation's growing prefix stays where it is cached."""
    logit_bias: dict[TokenId, LogitBias] | None = None
    allowed_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)] | None = None
    bad_words: list[str] | None = None
    """Words never to generate; the gateway tokenizes them (``Sampling.bad_words_token_ids``)."""
    prompt_logprobs: LogprobRequest | None = None
    """vLLM's: each prompt token's logprob and this many alternatives (not streamed; -1:
    the whole vocabulary, where it is within the limit)."""
    priority: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)] = 0
    # Lamina's SLA, both relative to the request's arrival (the wire's deadline is Unix ms)
    ttft_target_ms: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)] | None = None
    timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=10**12)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def refuse_unsupported(self) -> None:
        """Raise :class:`InvalidRequest` for fields that cannot be served together."""
        if self.use_beam_search:
            self._refuse_with_beams()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream", "stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequest(
                "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )

    def truncation(self) -> Truncation | None:
        """How each prompt is truncated, if it is."""
        if self.truncate_prompt_tokens is None:
            return None
        return Truncation(self.truncate_prompt_tokens, self.truncation_side or "left")

    def _refuse_with_beams(self) -> None:
        """What beam search cannot be combined with (vLLM refuses the same)."""
        for name, asks in (
            ("stream", self.stream),
            ("logprobs", getattr(self, "logprobs", None) not in (None, False)),
            ("prompt_logprobs", self.prompt_logprobs is not None),
            ("structured_outputs", self.structured_outputs is not None),
            ("response_format", self.response_format is not None),
            ("tools", bool(getattr(self, "tools", None))),
        ):
            if asks:
                raise InvalidRequest(f"{name} is not supported with beam search", name)
        if self.n > MAX_BEAM_WIDTH:
            raise InvalidRequest(
                f"beam search is at most {MAX_BEAM_WIDTH} wide (n={self.n}): each step scores "
                f"2n next tokens, and a request may ask for {MAX_LOGPROBS} logprobs",
                "n",
            )

    @property
    def structured_param(self) -> str:
        """The field a constraint came from, for an error about it."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(
        self, default_max_tokens: int | None, logprobs: int | None, vocab_size: int = 0
    ) -> Sampling:
        """The wire ``Sampling`` this body asks for (fields it leaves out keep
        ``Sampling``'s defaults), ``logprobs`` alternatives per output token (-1 read
        already); raises :class:`InvalidRequest` if the fields conflict."""
        values = {n: v for n in _SAMPLING_FIELDS if (v := getattr(self, n)) is not None}
        max_tokens = self.max_completion_tokens or self.max_tokens
        values["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
        values["logprobs"] = logprobs
        if self.prompt_logprobs is not None:
            values["prompt_logprobs"] = logprob_count(
                self.prompt_logprobs, vocab_size, "prompt_logprobs"
            )
        values["structured"] = structured_output(self.response_format, self.structured_outputs)
        try:
            return msgspec.convert(values, Sampling)
        except msgspec.ValidationError as exc:  # e.g. min_tokens over max_tokens
            raise InvalidRequest(str(exc), invalid_field(exc) or "min_tokens") from exc

    def sla(self) -> Sla:
        """The wire ``Sla``: ``timeout_ms`` becomes an absolute deadline from now."""
        deadline = None
        if self.timeout_ms is not None:
            deadline = int(time.time() * 1000) + self.timeout_ms
        return Sla(priority=self.priority, deadline_ms=deadline, ttft_target_ms=self.ttft_target_ms)


class CompletionRequest(OpenAIBody, kw_only=True):
    prompt: str | list[Any]
    logprobs: LogprobRequest | None = None
    echo: bool = False

    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts, each text or token ids: one, or a batch (a list of strings or of
        token-id lists), each of which becomes a choice of its own."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and all(type(t) is int for t in prompt)):
            return [prompt]
        if prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(type(t) is int for t in p))
            for p in prompt
        ):
            return list(prompt)
        raise InvalidRequest(
            "prompt must be a string, a list of token ids, or a non-empty list of strings "
            "or of token-id lists",
            "prompt",
        )

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.stream and self.echo and self.logprobs is not None:
            raise InvalidRequest(
                "echo with logprobs (the prompt's logprobs) is not available when stream is true",
                "echo",
            )

    def sampling(
        self, default_max_tokens: int | None, logprobs: int | None, vocab_size: int = 0
    ) -> Sampling:
        """As for any body; ``echo`` with ``logprobs`` asks for the prompt's logprobs
        too, as many alternatives as for the output (vLLM's rule)."""
        sampling = super().sampling(default_max_tokens, logprobs, vocab_size)
        if self.echo and logprobs is not None and self.prompt_logprobs is None:
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=logprobs)
        return sampling

    def logprobs_count(self, vocab_size: int) -> int | None:
        """Alternatives per output token (``logprobs``; -1: the whole vocabulary)."""
        return logprob_count(self.logprobs, vocab_size, "logprobs")


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
"""OpenAI's rule for a function's name."""


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema for the arguments (none: an object of any shape)."""
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One entry of ``tools``; passed to the chat template as it came (fields it left
    out stay out)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming the function the model must call."""

    type: Literal["function"]
    function: NamedFunction


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str
    """JSON text, as OpenAI sends it back."""


class AssistantToolCall(msgspec.Struct, kw_only=True):
    """A call an earlier assistant message made (the conversation sent back)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    """Checked where both client APIs start a chat (``Intake``)."""
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""
    tool_calls: list[AssistantToolCall] | None = None
    """An ``assistant`` message: the calls it made."""

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise InvalidRequest(
                    f"content part type {part.type!r} is not supported", "messages"
                )
            parts.append(part.text or "")
        return "".join(parts)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (``transformers``' form: a call's
        arguments as an object where they are JSON, as vLLM passes them)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_or_text(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """A chat's messages as its template reads them; only an assistant's content may be
    null (one that only made calls)."""
    if not messages:
        raise InvalidRequest("messages must not be empty", "messages")
    for i, message in enumerate(messages):
        if message.content is None and message.role != "assistant":
            raise InvalidRequest(
                f"a {message.role!r} message needs content (only an assistant's may be null)",
                f"messages[{i}].content",
            )
    return [m.for_template() for m in messages]


def _template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    return [msgspec.to_builtins(t) for t in tools] if tools else None


def _json_or_text(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text


class ChatCompletionRequest(OpenAIBody, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: LogprobRequest | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False
    """vLLM's: where the last message is the assistant's, each choice's content starts
    with it (a continued message comes back whole)."""
    add_generation_prompt: bool = True
    """The template ends with the opening of the assistant's turn."""
    continue_final_message: bool = False
    """The template ends inside the last message, which the model continues."""
    chat_template: Annotated[str, msgspec.Meta(max_length=1 << 16)] | None = None
    """A Jinja chat template for this request (only where the gateway runs with
    ``--trust-request-chat-template``, as vLLM)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the template (e.g. ``enable_thinking``)."""
    documents: list[dict[str, Any]] | None = None
    """Passed to the template as ``documents`` (for RAG templates)."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    """Passed to the template as ``reasoning_effort``."""

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "Cannot set both continue_final_message and add_generation_prompt to true",
                "continue_final_message",
            )
        reserved = sorted(TEMPLATE_VARIABLES.intersection(self.chat_template_kwargs or ()))
        if reserved:
            raise InvalidRequest(
                f"chat_template_kwargs may not set {reserved}: the gateway sets them",
                "chat_template_kwargs",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidRequest("tool_choice needs tools", "tool_choice")
        named = self.named_function
        if named is not None and named not in {t.function.name for t in self.tools or ()}:
            raise InvalidRequest(f"tool_choice names {named!r}, which is not a tool", "tool_choice")
        # A forced call is constrained to be the call: a response_format (which agent
        # frameworks send with every turn, for the final answer) governs only replies
        # that are not calls, as vLLM takes it; structured_outputs says the reply itself.
        forced = named is not None or self.tool_choice == "required"
        if forced and self.structured_outputs:
            raise InvalidRequest(
                "structured_outputs and a required tool call cannot both constrain the reply",
                "tool_choice",
            )

    @property
    def named_function(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    @property
    def tool_mode(self) -> str:
        """``none`` (no tools, or ``tool_choice: none``), ``auto``, ``required`` or
        ``named``."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.named_function is not None:
            return "named"
        return self.tool_choice or "auto"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as the chat template gets them (``transformers``' ``tools``)."""
        return _template_tools(self.tools)

    def sampling(
        self, default_max_tokens: int | None, logprobs: int | None, vocab_size: int = 0
    ) -> Sampling:
        sampling = super().sampling(default_max_tokens, logprobs, vocab_size)
        if self.tool_mode in ("required", "named"):
            tools = self.template_tools() or []
            constraint = tool_constraint(
                tools, self.named_function, self.parallel_tool_calls is not False
            )
            sampling = msgspec.structs.replace(sampling, structured=constraint)
        return sampling

    def chat_prompts(self) -> list[ChatPrompt]:
        """The chat (one; a batch's: each of its conversations), its tools and how its
        template is to render it."""
        return [self._prompt_of(self.messages)]

    def _prompt_of(self, messages: list[ChatMessage]) -> ChatPrompt:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return ChatPrompt(
            _template_messages(messages),
            self.template_tools(),
            self.add_generation_prompt,
            self.continue_final_message,
            bool(self.add_special_tokens),
            self.chat_template,
            kwargs,
        )

    def logprobs_count(self, vocab_size: int) -> int | None:
        """Alternatives per output token (``top_logprobs``, with ``logprobs``; -1: the
        whole vocabulary)."""
        if not self.logprobs:
            return None
        return logprob_count(self.top_logprobs or 0, vocab_size, "top_logprobs")

    def echo_texts(self) -> list[str] | None:
        """With ``echo``, what each chat's choices' content starts with: its last
        message's, where that is the assistant's (vLLM's rule); None: no echo at all."""
        if not self.echo:
            return None
        return [_echo_of(self.messages)]


def _echo_of(messages: list[ChatMessage]) -> str:
    last = messages[-1] if messages else None
    return last.text() if last is not None and last.role == "assistant" else ""


class BatchChatCompletionRequest(ChatCompletionRequest, kw_only=True):
    """vLLM's ``POST /v1/chat/completions/batch``: several conversations sampled alike,
    answered as one chat completion with a choice per conversation (``index``: its
    place). Not streamed, one choice per conversation, no tools (vLLM's limits)."""

    messages: Annotated[list[list[ChatMessage]], msgspec.Meta(min_length=1)]  # type: ignore[assignment]

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name, asks in (
            ("stream", self.stream),
            ("n", self.n != 1),
            ("tools", bool(self.tools)),
            ("tool_choice", self.tool_choice not in (None, "none")),
            ("use_beam_search", self.use_beam_search),
        ):
            if asks:
                raise InvalidRequest(
                    f"batch chat completions do not support {name}: send one request per "
                    "conversation to /v1/chat/completions instead",
                    name,
                )

    def chat_prompts(self) -> list[ChatPrompt]:
        return [self._prompt_of(conversation) for conversation in self.messages]

    def echo_texts(self) -> list[str] | None:
        if not self.echo:
            return None
        return [_echo_of(conversation) for conversation in self.messages]


def invocation_kind(body: bytes) -> type:
    """What SageMaker's ``POST /invocations`` body is, as vLLM routes it: a chat (it has
    ``messages``), else a completion (``prompt``); anything else is refused."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, RecursionError):
        return CompletionRequest  # decoding it again says what is wrong
    if "messages" in fields:
        return ChatCompletionRequest
    if "prompt" in fields:
        return CompletionRequest
    raise InvalidRequest(
        "cannot find a handler for this request: expected a chat completion (messages) or "
        "a completion (prompt)"
    )


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /tokenize``: text (``prompt``) or a chat (``messages``, through the
    model's chat template), as a completion or chat request would send it."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Add the tokenizer's special tokens (a BOS); vLLM's defaults: yes for text, no for
    a chat (its template carries them)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """End the rendering inside the last message (which the model would continue)."""
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    """Tool definitions for the chat template, as a chat completion passes them."""

    def template_tools(self) -> list[dict[str, Any]] | None:
        return _template_tools(self.tools)

    def to_prompt(self) -> TextPrompt | ChatPrompt:
        """The text or chat to tokenize, as a completion would; checks the request's shape."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of prompt and messages", "prompt")
        if self.messages is None:
            assert self.prompt is not None
            return TextPrompt(self.prompt, self.add_special_tokens is not False)
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "Cannot set both continue_final_message and add_generation_prompt to true",
                "continue_final_message",
            )
        return ChatPrompt(
            _template_messages(self.messages),
            self.template_tools(),
            self.add_generation_prompt,
            self.continue_final_message,
            bool(self.add_special_tokens),
        )


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]


class LoadLoraRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /v1/load_lora_adapter``: a PEFT adapter directory on the workers'
    hosts, served as ``lora_name``."""

    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class UnloadLoraRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /v1/unload_lora_adapter``."""

    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


def decode_body(body: bytes, kind: type) -> Any:
    """Decode a JSON body, turning msgspec's errors into :class:`InvalidRequest`."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request body: {exc}", invalid_field(exc)) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequest("request body is nested too deeply") from exc
