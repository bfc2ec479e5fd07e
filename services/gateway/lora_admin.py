"""vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: adapters loaded
and unloaded at run time on every worker of the model that serves adapters.

Off unless the gateway runs with ``--allow-runtime-lora-updating`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): loading makes workers read a path on their hosts.
Each LoRA-serving worker of the model (from the cluster view) is asked on
``worker.<id>.lora`` and answers ``LoraAck``; the call succeeds when every one of them
did, and returns once the scheduler's view shows the change, so the next request naming
the adapter is placed (or refused) accordingly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from lamina.libs.bus import Bus
from lamina.libs.errors import BusError
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.lora import LoadLora, LoraAck, LoraError, UnloadLora
from lamina.services.gateway.errors import GenerationError
from lamina.services.gateway.intake import Intake
from lamina.services.gateway.protocol import LoadLoraRequest, UnloadLoraRequest, decode_body

WORKER_TIMEOUT_S = 60.0
"""How long a worker may take to read an adapter and answer."""
VIEW_TIMEOUT_S = 5.0
"""How long the call waits for the scheduler's view to show the change."""

_STATUS = {
    LoraError.DISABLED: (400, "invalid_request_error"),
    LoraError.INVALID: (400, "invalid_request_error"),
    LoraError.EXISTS: (400, "invalid_request_error"),
    LoraError.NOT_FOUND: (404, "not_found_error"),
    LoraError.IN_USE: (409, "invalid_request_error"),
}


class LoraAdmin:
    """The two routes' work, over one gateway's bus and :class:`Intake` (whose cluster
    view names the workers and the adapters they hold); ``refresh`` re-reads that view."""

    def __init__(self, bus: Bus, intake: Intake, refresh: Callable[[], Awaitable[None]]) -> None:
        self.bus, self.intake, self.refresh = bus, intake, refresh

    async def load(self, body: bytes) -> str:
        request = decode_body(body, LoadLoraRequest)
        if request.lora_name == self.intake.model_name:
            raise GenerationError(
                400, "invalid_request_error", "an adapter cannot take the model's name", "lora_name"
            )
        if request.lora_name in self.intake.adapters:
            message = f"the LoRA adapter {request.lora_name!r} has already been loaded"
            raise GenerationError(400, "invalid_request_error", message, "lora_name", "exists")
        command = LoadLora(name=request.lora_name, path=request.lora_path)
        await self._on_every_worker(command)
        await self._until_listed(request.lora_name, True)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload(self, body: bytes) -> str:
        request = decode_body(body, UnloadLoraRequest)
        if request.lora_name not in self.intake.adapters:
            message = f"the LoRA adapter {request.lora_name!r} cannot be found"
            raise GenerationError(404, "not_found_error", message, "lora_name", "not_found")
        await self._on_every_worker(UnloadLora(name=request.lora_name))
        await self._until_listed(request.lora_name, False)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    async def _on_every_worker(self, command: LoadLora | UnloadLora) -> None:
        """``command`` to each LoRA-serving worker of the model; the first refusal (by
        worker id) raises, naming the worker."""
        workers = self.intake.lora_workers
        if not workers:
            message = "no live worker of this model serves LoRA adapters (--enable-lora)"
            raise GenerationError(400, "invalid_request_error", message, None, "disabled")

        async def ask(worker_id: str) -> LoraAck:
            try:
                return await self.bus.request(
                    subjects.worker_lora(worker_id), command, LoraAck, timeout=WORKER_TIMEOUT_S
                )
            except BusError as exc:
                return LoraAck(
                    worker_id=worker_id, ok=False, error=LoraError.UNKNOWN, message=str(exc)
                )

        acks = await asyncio.gather(*(ask(w) for w in sorted(workers)))
        for ack in acks:
            if not ack.ok:
                status, kind = _STATUS.get(ack.error, (502, "api_error"))
                message = f"worker {ack.worker_id}: {ack.message}"
                raise GenerationError(status, kind, message, "lora_name", str(ack.error))

    async def _until_listed(self, name: str, present: bool) -> None:
        """Wait (bounded) for the cluster view to show ``name`` held (or not)."""
        deadline = time.monotonic() + VIEW_TIMEOUT_S
        while (name in self.intake.adapters) != present and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            with contextlib.suppress(BusError):  # the view's own watch retries too
                await self.refresh()
