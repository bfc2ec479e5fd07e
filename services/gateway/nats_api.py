"""The NATS request API on ``lamina.v1.api.generate``.

A client publishes an ``ApiRequest`` with a reply subject and receives a stream of
``ApiDelta`` events ending in ``ApiFinished`` (or a single ``ApiError``) there. Gateways
share the subject in the ``gateway`` queue group.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.api import ApiDelta, ApiError, ApiFinished, ApiRequest
from lamina.services.gateway.errors import GenerationError
from lamina.services.gateway.frontend import Frontend
from lamina.services.gateway.protocol import InvalidRequest
from lamina.services.gateway.tokenizer import TemplateError

log = logging.getLogger("lamina.gateway.nats")


class NatsApi:
    def __init__(self, bus: Bus, frontend: Frontend) -> None:
        self.bus = bus
        self.frontend = frontend
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.bus.subscribe(
            subjects.API_GENERATE, ApiRequest, self._on_request, queue="gateway"
        )

    async def _on_request(self, request: ApiRequest, msg: Msg) -> None:
        if not msg.reply:
            log.warning("API request without a reply subject dropped")
            return
        task = asyncio.create_task(self._serve(request, msg.reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _prompt_ids(self, request: ApiRequest) -> list[int]:
        given = [
            x is not None for x in (request.prompt, request.prompt_token_ids, request.messages)
        ]
        if sum(given) != 1:
            raise InvalidRequest(
                "exactly one of prompt, prompt_token_ids or messages is required", "prompt"
            )
        tokenizer = self.frontend.tokenizer
        if request.prompt is not None:
            ids = tokenizer.encode(request.prompt)
        elif request.messages is not None:
            ids = tokenizer.encode_chat(
                [{"role": m.role, "content": m.content} for m in request.messages]
            )
        else:
            ids = list(request.prompt_token_ids or [])
        if not ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        return ids

    async def _serve(self, request: ApiRequest, reply: str) -> None:
        rid = request.request_id
        try:
            if request.model is not None and request.model != self.frontend.model_name:
                raise GenerationError(
                    404, "not_found_error", f"model {request.model!r} does not exist", "model"
                )
            stream = await self.frontend.open(
                self._prompt_ids(request),
                request.sampling,
                request.sla,
                request.stop,
                request_id=rid,
            )
        except InvalidRequest as exc:
            await self._error(reply, rid, 400, "invalid_request_error", exc.message, exc.param)
            return
        except TemplateError as exc:
            await self._error(reply, rid, 400, "invalid_request_error", str(exc), "messages")
            return
        except GenerationError as exc:
            await self._error(reply, rid, exc.status, exc.error_type, exc.message, exc.param)
            return
        rid = stream.request_id
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
            await self._error(reply, rid, exc.status, exc.error_type, exc.message, exc.param)
        finally:
            await stream.close()

    async def _error(
        self, reply: str, rid: str | None, code: int, kind: str, message: str, param: str | None
    ) -> None:
        await self.bus.publish(
            reply,
            ApiError(request_id=rid, code=code, error_type=kind, message=message, param=param),
        )

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
