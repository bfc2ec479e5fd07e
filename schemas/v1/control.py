"""Cancellation and worker control."""

from __future__ import annotations

from lamina.schemas.v1.base import Id, Message, Text
from lamina.schemas.v1.stats import WorkerState


class Cancel(Message):
    """gateway → ``worker.<id>.cancel``: the client went away; free everything."""

    request_id: Id


class Drain(Message):
    """Stop taking new requests, finish in-flight ones (or, with ``move``, hand them to
    other workers)."""

    move: bool = False
    """Fail the running requests as retryable at once, so that their gateways move them,
    and keep serving their KV blocks to the workers they move to (the worker's
    ``--drain-moves`` does this for every drain)."""


class Resume(Message):
    """Take new requests again after a drain (cordon lifted)."""


class Cordon(Message):
    """Place nothing new here (schedulers skip a cordoned worker), but keep serving what
    it has and whatever still reaches it; unlike ``Drain``, it refuses nothing."""


class Uncordon(Message):
    """Lift a cordon."""


class ResetPrefixCache(Message):
    """Forget every cached prefix block."""


class Ping(Message):
    """Is a worker serving this id? It answers ``ControlAck`` with its state and changes
    nothing. A starting worker pings its own id and refuses to start if anyone answers."""


class ControlAck(Message):
    """Reply to a control command."""

    worker_id: Id
    ok: bool
    state: WorkerState
    message: Text = ""
    cordoned: bool = False
    """Whether the worker takes no new requests (its state stays what it was)."""


ControlCommand = Drain | Resume | ResetPrefixCache | Ping | Cordon | Uncordon
