"""Generation requests and the event stream a worker (or scheduler) sends back."""

from __future__ import annotations

import msgspec

from lamina.schemas.v1.base import Message


class Sampling(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling parameters (OpenAI and vLLM semantics; see the engine's SamplingParams)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None


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

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    sla: Sla = msgspec.field(default_factory=Sla)
    attempt: int = 0
    worker_id: str | None = None
    """Set by the scheduler when it forwards the request."""


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

    request_id: str
    worker_id: str
    seq: int = 0


class Tokens(Message, gc=False):
    """Every token the request produced in one engine step. ``seq`` numbers the stream's
    events without gaps, so a receiver can tell a lost message from a slow one."""

    request_id: str
    seq: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class Finished(Message):
    """The last event of a successful stream; may carry the step's final tokens."""

    request_id: str
    seq: int
    finish_reason: str
    """``stop`` (EOS or a stop token), ``length``, or ``cancelled``."""
    usage: Usage
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None


class Rejected(Message):
    """The request was not run. ``retryable``: another worker or a later try may run it."""

    request_id: str
    reason: str
    """Machine-readable: ``no_worker``, ``draining``, ``invalid_request``, ``overloaded``,
    ``deadline_exceeded``, ``bad_message``."""
    message: str
    retryable: bool = False
    param: str | None = None
    """For ``invalid_request``: the offending field."""


class Failed(Message):
    """The request broke after it was accepted. ``tokens_sent`` says whether the client may
    already have seen output (a retry then has to resume, not restart)."""

    request_id: str
    seq: int
    message: str
    retryable: bool
    tokens_sent: bool


StreamEvent = Accepted | Tokens | Finished | Rejected | Failed
