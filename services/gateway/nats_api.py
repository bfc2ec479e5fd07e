"""The NATS request API on ``lamina.v1.api.generate``.

A client publishes an ``ApiRequest`` with a reply subject and receives a stream of
``ApiDelta`` events ending in ``ApiFinished`` (or a single ``ApiError``) there. Gateways
share the subject in the ``gateway`` queue group.

On a bus with credentials (``lamina.libs.nats_auth``), client ``api.<name>`` publishes on
``lamina.v1.api.generate.<name>``, the only subject it may publish on, and reads only its
own inbox. NATS does not check a message's reply subject against its sender's
permissions, so the gateway does: a request whose answers would go to another client's
inbox is dropped unanswered (any answer would land in that inbox), so one client cannot
write into another's stream.

A client's ``request_id`` is only echoed on its events: the request runs under an id the
gateway makes, so no client's id can name (or cancel, or collide with) another's work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import msgspec
from nats.aio.msg import Msg

from lamina.libs.bus import Bus
from lamina.libs.errors import invalid_field
from lamina.libs.nats_auth import inbox_prefix
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.api import ApiDelta, ApiError, ApiFinished, ApiRequest
from lamina.schemas.v1.generate import Sampling, Sla
from lamina.services.gateway.errors import GenerationError, InvalidRequest
from lamina.services.gateway.intake import Caller, Intake, Sequence
from lamina.services.gateway.tokenizer import ChatPrompt, Prompt, TextPrompt

log = logging.getLogger("lamina.gateway.nats")

ANY_CLIENT = "api.*"
"""The policy line for every API identity that has none of its own."""


def _prompt(request: ApiRequest) -> Prompt | list[int]:
    """The request's one prompt, in the form ``Intake.admit`` takes."""
    given = [x is not None for x in (request.prompt, request.prompt_token_ids, request.messages)]
    if sum(given) != 1:
        raise InvalidRequest(
            "exactly one of prompt, prompt_token_ids or messages is required", "prompt"
        )
    if request.messages is not None:
        return ChatPrompt([{"role": m.role, "content": m.content} for m in request.messages])
    if request.prompt is not None:
        return TextPrompt(request.prompt)
    return list(request.prompt_token_ids or [])


_SAMPLING_FIELDS = frozenset(f.name for f in msgspec.structs.fields(Sampling))
_OWN_NAMES = {"structured_outputs": "sampling.structured", "bad_words": "sampling.bad_words"}


def _field(param: str | None) -> str | None:
    """A refused field as this API names it (``sampling.logit_bias``, not the HTTP body's
    ``logit_bias``)."""
    if param is None or "." in param:
        return param
    if param in _OWN_NAMES:
        return _OWN_NAMES[param]
    return f"sampling.{param}" if param.split("[", 1)[0] in _SAMPLING_FIELDS else param


def _check_deadline(sla: Sla) -> None:
    """An absolute deadline already past is a 400 saying so (not an estimate of how far
    past it the first token would be)."""
    now_ms = int(time.time() * 1000)
    if sla.deadline_ms is not None and sla.deadline_ms <= now_ms:
        raise InvalidRequest(
            f"sla.deadline_ms ({sla.deadline_ms}) has passed: it is a Unix time in "
            f"milliseconds (now {now_ms})",
            "sla.deadline_ms",
        )


def _api_error(request_id: str | None, exc: GenerationError) -> ApiError:
    return ApiError(
        request_id=request_id,
        code=exc.status,
        error_type=exc.error_type,
        message=exc.message,
        param=_field(exc.param),
        error_code=exc.code,
        retry_after_s=exc.retry_after_s,
    )


def _refuse_logprobs(request: ApiRequest) -> None:
    """The API's events carry text and token ids, no logprobs: asking for them is refused,
    not ignored (the HTTP API returns them)."""
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(request.sampling, name) is not None:
            raise InvalidRequest(
                f"{name} are not returned by the NATS request API; use the HTTP API",
                f"sampling.{name}",
            )


def _undecodable(msg: Msg, exc: msgspec.DecodeError) -> ApiError:
    """The answer to an ``ApiRequest`` that does not decode: a 400 a client can read."""
    param = invalid_field(exc) if isinstance(exc, msgspec.ValidationError) else None
    return ApiError(
        request_id=None,
        code=400,
        error_type="invalid_request_error",
        message=f"invalid ApiRequest: {exc}",
        param=param,
    )


class NatsApi:
    """``callers``: each API identity's best priority and rate limits (``api.<name>``;
    ``api.*`` for identities not listed, and for requests on the unnamed subject of an
    open bus)."""

    def __init__(
        self, bus: Bus, intake: Intake, callers: Mapping[str, Caller] | None = None
    ) -> None:
        self.bus = bus
        self.intake = intake
        self.callers = dict(callers or {})
        self._tasks: set[asyncio.Task] = set()

    def caller(self, client: str) -> Caller:
        """The policy of API client ``client`` (``""``: the unnamed subject)."""
        found = self.callers.get(f"api.{client}") if client else None
        return found or self.callers.get(ANY_CLIENT) or Caller()

    async def start(self) -> None:
        for subject in (subjects.API_GENERATE, f"{subjects.API_GENERATE}.*"):
            await self.bus.subscribe(
                subject, ApiRequest, self._on_request, queue="gateway", bad_reply=_undecodable
            )

    async def _on_request(self, request: ApiRequest, msg: Msg) -> None:
        if not msg.reply:
            log.warning("API request without a reply subject dropped")
            return
        client = msg.subject[len(subjects.API_GENERATE) + 1 :]
        if client and not msg.reply.startswith(inbox_prefix(f"api.{client}") + "."):
            # Answer nobody: the reply subject is exactly what cannot be trusted.
            log.warning("API request from %s with another's reply subject refused", client)
            return
        task = asyncio.create_task(self._serve(request, msg.reply, self.caller(client)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, request: ApiRequest, reply: str, caller: Caller) -> None:
        rid = request.request_id
        try:
            _refuse_logprobs(request)
            _check_deadline(request.sla)
            (stream,) = await self.intake.start(  # under an id of the gateway's own
                request.model,
                [Sequence(_prompt(request), request.sampling)],
                request.sla,
                request.stop,
                caller=caller,
                include_stop=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens,
                structured_param="sampling.structured",
                priority_param="sla.priority",
            )
        except GenerationError as exc:
            await self.bus.publish(reply, _api_error(rid, exc))
            return
        rid = rid or stream.request_id
        seq = 0
        try:
            async for delta in stream.deltas():
                if delta.finish_reason is None:
                    await self.bus.publish(
                        reply,
                        ApiDelta(
                            request_id=rid, seq=seq, text=delta.text, token_ids=delta.token_ids
                        ),
                    )
                else:
                    await self.bus.publish(
                        reply,
                        ApiFinished(
                            request_id=rid,
                            seq=seq,
                            text=delta.text,
                            finish_reason=delta.finish_reason,
                            usage=delta.usage,
                        ),
                    )
                seq += 1
        except GenerationError as exc:
            await self.bus.publish(reply, _api_error(rid, exc))
        finally:
            await stream.close()

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
