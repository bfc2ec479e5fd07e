"""Generation requests and the event stream a worker (or scheduler) sends back."""

from __future__ import annotations

from typing import Annotated

import msgspec

from lamina.schemas.v1.base import Id, Message, OpenEnum, Text
from lamina.schemas.v1.kv_transfer import KvSource

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
MAX_LOGPROBS = 20
"""Most top alternatives a request may ask for per token (OpenAI's limit)."""

# The value range of each sampling knob, declared once: the wire ``Sampling`` and the
# gateway's OpenAI bodies use these types, so a value the engine cannot hold is refused
# where the body is decoded, naming the field, and never reaches the engine thread.
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
Temperature = Annotated[float, msgspec.Meta(ge=0)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]
MinP = Annotated[float, msgspec.Meta(ge=0, le=1)]
RepetitionPenalty = Annotated[float, msgspec.Meta(ge=1e-6, le=1e6)]
"""Logits are divided or multiplied by it in float32: outside these bounds they overflow
(to infinities, then NaN), so such a penalty is refused, naming the field."""
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
LogitBias = Annotated[float, msgspec.Meta(ge=-100, le=100)]
Seed = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
LogprobCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
MAX_GRAMMAR_CHARS = 1 << 18
"""Longest constraint text (a schema, a regex, a grammar) a request may carry."""
GrammarText = Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_CHARS)]


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the output must be (vLLM's ``structured_outputs``): exactly one of the
    constraint fields. The engine masks every token the constraint does not allow and
    the request ends (``stop``) when the output is complete.

    Which schemas and grammars can be compiled is the grammar engine's to say: the
    gateway checks before a worker is used (``libs.grammar.check``), the worker again."""

    json: GrammarText | None = None
    """A JSON Schema, as JSON text: the output is one instance of it."""
    json_object: bool = False
    """The output is any JSON object (OpenAI's ``response_format`` ``json_object``)."""
    regex: GrammarText | None = None
    """The output matches this regular expression, whole."""
    choice: Annotated[list[GrammarText], msgspec.Meta(min_length=1, max_length=4096)] | None = None
    """The output is exactly one of these strings."""
    grammar: GrammarText | None = None
    """An EBNF grammar (GBNF, as xgrammar and llama.cpp read it) whose ``root`` rule the
    output matches, or a Lark grammar (its ``start`` rule)."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (``{"a":1}``); by default the model may format it."""

    def __post_init__(self) -> None:
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError(
                "structured output needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(kinds) if kinds else 'none'}"
            )

    @property
    def kinds(self) -> list[str]:
        """The constraint fields that are set."""
        kinds = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        return [*kinds, "json_object"] if self.json_object else kinds


class Sampling(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick each next token and when to stop (OpenAI and vLLM semantics).

    The sampling knobs on the wire: the gateway builds it from a request body, the worker
    converts it to the engine's ``SamplingParams`` (the same names and defaults). Ranges
    are checked when it is decoded (JSON never carries a NaN or an infinity);
    :meth:`__post_init__` checks what spans two fields. Token ids are checked against the
    vocabulary by the engine, the only one that knows it.
    """

    max_tokens: MaxTokens | None = 16
    """Most tokens to generate; ``None`` means up to the model's context length."""
    temperature: Temperature = 1.0
    """Softmax temperature; 0 (or anything under 1e-5, vLLM's rule) is greedy."""
    top_p: TopP = 1.0
    """Keep the smallest set of tokens whose probability reaches ``top_p``."""
    top_k: TopK = 0
    """Keep the ``top_k`` most likely tokens; 0 or -1 keeps all."""
    min_p: MinP = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one."""
    repetition_penalty: RepetitionPenalty = 1.0
    """Divide positive (multiply negative) logits of tokens already in prompt or output."""
    presence_penalty: Penalty = 0.0
    """Subtract from the logit of every token already generated."""
    frequency_penalty: Penalty = 0.0
    """Subtract, per occurrence, from the logit of tokens already generated."""
    seed: Seed | None = None
    """Per-request seed: the same seed gives the same tokens whatever the batch."""
    stop_token_ids: list[TokenId] = []
    """Extra token ids that end the request (the model's EOS always does unless ignored)."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    min_tokens: Count = 0
    """Suppress EOS and stop tokens until this many tokens exist."""
    logprobs: LogprobCount | None = None
    """Return the sampled token's logprob and this many top alternatives (0: just the token)."""
    prompt_logprobs: LogprobCount | None = None
    """Return each prompt token's logprob (from the second on) and this many top
    alternatives (vLLM's): the prompt is then computed, not read from the prefix cache."""
    logit_bias: dict[TokenId, LogitBias] = {}
    """Added to these tokens' logits before sampling (OpenAI's; -100 all but bans one)."""
    allowed_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)] | None = None
    """Sample only among these tokens (vLLM's)."""
    bad_words_token_ids: list[Annotated[list[TokenId], msgspec.Meta(min_length=1)]] = []
    """Token sequences never to generate: a sequence's last token is banned wherever the
    output ends with the rest of it (vLLM's ``bad_words``, as the gateway tokenizes them)."""
    structured: StructuredOutput | None = None
    """What the output must be: a JSON schema, a regex, a choice, a grammar."""

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )


class Sla(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the client needs from this request: carried down to admission and batching."""

    priority: int = 0
    """Lower is served first."""
    deadline_ms: int | None = None
    """Unix time (ms) after which the result is useless."""
    ttft_target_ms: int | None = None
    """Target time to first token."""


class GenerateRequest(Message):
    """gateway → scheduler (``sched.submit``) → worker (``worker.<id>.generate``).

    The NATS reply subject is the gateway's per-request inbox; every stream event goes
    there. ``attempt`` counts resubmissions.
    """

    request_id: Id
    model: Id
    prompt_token_ids: list[int]
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    sla: Sla = msgspec.field(default_factory=Sla)
    attempt: int = 0
    worker_id: Id | None = None
    """Set by the scheduler when it forwards the request."""
    affinity: Id | None = None
    """Requests with the same key go to the same worker while it can take them (the
    sequences of one ``n > 1`` request: their prompt is computed once, then shared)."""
    numerics: Id | None = None
    """A moved stream's: the numerics (``WorkerStats.numerics``) of the worker that
    began it. Placement prefers workers with the same, where the continuation is what
    that worker would have produced (a quantized and an unquantized worker of one model
    are not interchangeable)."""
    replayed_output_tokens: Count = 0
    """The last this-many ``prompt_token_ids`` are output the request produced before it
    moved (the gateway replays them; ``sampling.max_tokens`` and ``min_tokens`` already
    count them as done). The engine counts them as output where sampling looks at output
    (presence and frequency penalties, a seed's random stream), so a move is exact. A
    worker that predates the field reads them as prompt: the move is then approximate
    under those settings, as it was, but never wrong in length."""
    kv_source: KvSource | None = None
    """Set by the scheduler only (it drops a gateway's): the worker fetches the
    request's leading KV blocks from this other worker before it runs the request, and
    computes them itself if the transfer fails."""
    placed_by: Id | None = None
    """Set by the scheduler only: the placer (one scheduler process) that sent it here."""
    placement_seq: Count = 0
    """Set by the scheduler only: its number among that placer's placements (counting
    up from 1). The worker's heartbeat reports the last it received from each placer
    (``WorkerStats.placements_seen``), so a scheduler knows exactly which of its
    placements the heartbeat's counts include, and counts the rest as pending."""


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TokenLogprob(msgspec.Struct, array_like=True):
    """One sampled token's logprob and its top alternatives ``[[id, logprob], ...]``."""

    logprob: float
    top: list[tuple[int, float]]


class Accepted(Message):
    """The worker queued the request; cancel it at ``worker.<worker_id>.cancel``."""

    request_id: Id
    worker_id: Id
    seq: int = 0
    numerics: Id = ""
    """The worker's ``WorkerStats.numerics`` (empty from a worker that predates it)."""


class Tokens(Message, gc=False):
    """Every token the request produced in one engine step (``seq``: see
    ``StreamEvent``)."""

    request_id: Id
    seq: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class PromptLogprobs(Message):
    """Logprobs of prompt tokens ``start`` to ``start + len(logprobs) - 1`` (the first
    prompt token has none), sent before the request's first ``Tokens``, in several
    messages for a long prompt (``seq``: see ``StreamEvent``). ``ranks``: each prompt
    token's rank in its distribution (1: the most likely)."""

    request_id: Id
    seq: int
    start: Annotated[int, msgspec.Meta(ge=1)]
    logprobs: list[TokenLogprob]
    ranks: list[Annotated[int, msgspec.Meta(ge=1)]]


class FinishReason(OpenEnum):
    """Why a stream ended (OpenAI's ``finish_reason``)."""

    STOP = "stop"
    """EOS, a stop token or a stop string."""
    LENGTH = "length"
    """``max_tokens`` or the context length."""
    UNKNOWN = "unknown"
    """A reason this peer does not know; passed on to clients as ``unknown``."""


Duration = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
"""Seconds, as measured by one process's monotonic clock."""


class EngineTimings(msgspec.Struct, kw_only=True):
    """Where a request's time went in the engine that finished it (its monotonic clock;
    after a move, the last worker's part only). vLLM's request phases: queue, prefill,
    decode; inference is prefill plus decode."""

    queued_s: Duration
    """From the engine taking the request to its first step."""
    prefill_s: Duration
    """From its first step to its first token (preemptions included)."""
    decode_s: Duration
    """From its first token to its last."""
    num_preemptions: Count = 0


class Finished(Message):
    """The last event of a successful stream; may carry the step's final tokens."""

    request_id: Id
    seq: int
    finish_reason: FinishReason
    usage: Usage
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    timings: EngineTimings | None = None


class RejectReason(OpenEnum):
    """Why a request was not run (``Rejected.reason``; the gateway maps each to an HTTP
    status in ``gateway/errors.py``)."""

    NO_WORKER = "no_worker"
    """No live worker of the model is ready."""
    MODEL_NOT_FOUND = "model_not_found"
    """No live worker serves the model."""
    INVALID_REQUEST = "invalid_request"
    """The request can never run (``param`` names the field)."""
    DRAINING = "draining"
    """The worker is draining (cordoned or shutting down)."""
    DEGRADED = "degraded"
    """The worker's last engine step failed; it waits for an operator's ``Resume``."""
    FAILED = "failed"
    """The worker's engine is gone."""
    OVERLOADED = "overloaded"
    """Every worker is saturated and the scheduler's queue is full: retry after
    ``retry_after_s`` (HTTP 429)."""
    DEADLINE_UNMEETABLE = "deadline_unmeetable"
    """No worker is predicted to produce a first token before the request's deadline
    (HTTP 429)."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The deadline passed while the request waited in the queue (or, on ``Failed``, while
    it ran) (HTTP 504)."""
    UNKNOWN = "unknown"
    """A reason this peer does not know: treated as retryable when the message says so."""


class Rejected(Message):
    """The request was not run. ``retryable``: another worker or a later try may run it."""

    request_id: Id
    reason: RejectReason
    message: Text
    retryable: bool = False
    param: Id | None = None
    """For ``invalid_request``: the offending field."""
    retry_after_s: float | None = None
    """For ``overloaded`` and ``deadline_unmeetable``: when trying again is likely to
    work, from the cluster's measured drain rate."""
    worker_id: Id = ""
    """The worker that refused it (empty: a scheduler did). A worker's ``overloaded``
    means it was placed there on a stale view: the gateway submits it again instead of
    answering 429, and the scheduler, knowing more by then, queues it."""


class Queued(Message):
    """scheduler → reply subject: no worker has room yet; the request waits in the
    scheduler's queue (``position`` 0 is next) until ``Accepted`` or ``Rejected`` follows.
    Cancel it there with ``Cancel`` on ``sched.cancel``."""

    request_id: Id
    position: int
    max_wait_s: Duration | None = None
    """The longest it may wait there before it is refused (``overloaded``): the gateway
    waits that long past its own stall timeout for what follows (None: a scheduler that
    predates the field)."""


class Failed(Message):
    """The request broke after it was accepted. ``tokens_sent`` says whether the client may
    already have seen output (a retry then has to resume, not restart)."""

    request_id: Id
    seq: int
    message: Text
    retryable: bool
    tokens_sent: bool
    reason: RejectReason | None = None
    """Set when the cause is one of the typed ones (``deadline_exceeded``)."""


StreamEvent = Accepted | PromptLogprobs | Tokens | Finished | Rejected | Failed | Queued
"""What a submission's reply subject receives: from the scheduler, ``Rejected`` or
``Queued`` (then, later, ``Rejected`` or the worker's events); from the worker,
``Rejected``, or ``Accepted`` (``seq`` 0) and then ``PromptLogprobs`` (if asked for),
``Tokens`` and a last ``Finished`` or ``Failed`` numbered 1, 2, 3, ... without gaps (a
``Tokens`` without tokens is a keep-alive: the request waits in the engine). The
``seq`` contract: the worker publishes a reply subject's events from one task, in order;
each submission (each retry or move of a request) has its own reply subject and
numbering; a receiver that sees a gap has lost events, not reordered ones (the gateway
then moves the request on from before the gap, as after a lost worker)."""


class StreamedEvent(msgspec.Struct, array_like=True, gc=False):
    """One event of a :class:`StreamBatch`: the submission it belongs to (the
    ``<attempt>`` token of its reply subject, ``<inbox>.<attempt>``) and the event, as it
    would have gone on that submission's stream subject."""

    attempt: Id
    event: StreamEvent


class StreamBatch(Message, gc=False):
    """worker → gateway, on ``subjects.stream_batch(<inbox>, <worker id>)``: the events of
    several of one gateway's streams in one message (what an engine step produced for
    them, or several steps' when the publisher fell behind), each stream's in its ``seq``
    order. A gateway reads each event as if it had come on that attempt's own stream
    subject from the same worker. Sent only to a gateway whose ``GatewayAlive`` says it
    reads batches (``stream_batches``): one message per step per gateway instead of one
    per stream."""

    events: list[StreamedEvent]
