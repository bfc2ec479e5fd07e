"""LoRA adapters loaded and unloaded at run time (gateway → worker)."""

from __future__ import annotations

from lamina.schemas.v1.base import Id, Message, OpenEnum, Text


class LoadLora(Message):
    """``worker.<id>.lora``: read the PEFT adapter at ``path`` (on the worker's host) and
    serve it as ``name``. Answered with :class:`LoraAck`."""

    name: Id
    path: Text


class UnloadLora(Message):
    """``worker.<id>.lora``: stop serving adapter ``name`` (refused while a request of
    the worker uses it). Answered with :class:`LoraAck`."""

    name: Id


LoraCommand = LoadLora | UnloadLora


class LoraError(OpenEnum):
    """Why a worker refused a :data:`LoraCommand`."""

    UNKNOWN = "unknown"
    """A reason this reader does not know (a newer worker's), or no answer."""
    DISABLED = "disabled"
    """The worker serves no adapters (started without ``--enable-lora``)."""
    INVALID = "invalid"
    """The adapter cannot be loaded (not found, a format or shape the engine refuses)."""
    EXISTS = "exists"
    """An adapter of that name (or the model's own name) is already served."""
    NOT_FOUND = "not_found"
    """No adapter of that name is served."""
    IN_USE = "in_use"
    """Requests of the worker are using the adapter."""


class LoraAck(Message):
    """A worker's answer to a :data:`LoraCommand`."""

    worker_id: Id
    ok: bool
    error: LoraError = LoraError.UNKNOWN
    """Why not, when not ``ok``."""
    message: Text = ""
