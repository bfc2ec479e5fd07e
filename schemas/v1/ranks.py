"""How a worker's pipeline stages on other hosts join it: the stage host asks the worker
for its rendezvous (``services/engine_worker/engine/remote_ranks.py`` says what each part
is for)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from lamina.schemas.v1.base import Id, Message, Text
from lamina.schemas.v1.generate import Count


class RanksRequest(Message):
    """stage host → ``worker.<id>.ranks`` (request/reply): how do this worker's ranks on
    other hosts join it? Only the worker's own identity may publish there (the bus's
    permissions), so a stage host connects as the worker it serves."""

    stage: Count
    """The pipeline stage the asking host runs."""


class RankRendezvous(Message):
    """The worker's reply to :class:`RanksRequest`. ``ready`` false: there is none to
    join (yet: the worker is starting, or it runs that stage itself), ``message`` says
    which; the stage host asks again."""

    worker_id: Id
    incarnation: Id
    """The worker's run: a restarted worker publishes a new rendezvous."""
    ready: bool
    message: Text = ""
    store: Id = ""
    """``tcp://host:port``: the ``torch.distributed`` store the worker's process hosts."""
    host: Id = ""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Where the worker's step channel listens."""
    key: Annotated[str, msgspec.Meta(max_length=128)] = ""
    """The rendezvous's secret, hex: each remote rank proves it holds it."""
    digest: Id = ""
    """The worker's checkpoint digest (a stage host refuses a copy that differs)."""
    timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Most seconds a collective of the group waits."""
    engine: dict[str, Any] = {}
    """The worker's engine configuration (``EngineConfig``'s fields); the stage host
    runs it with its own model path and device."""
