"""The tagged base every v1 wire type derives from, and the base of its closed sets."""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

MAX_ID_CHARS = 256
"""Longest name on the wire: an id, a model, a dtype, a subject, an error's type."""
MAX_TEXT_CHARS = 1 << 16
"""Longest human-readable message on the wire (a refusal's reason, an error)."""
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
"""A name: bounded, so that a hostile peer's value is refused where it is decoded rather
than repeated in every event of a stream."""
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
"""A message for people. Prompts, stop strings and generated text are bounded by the
bus's ``max_payload`` (and the gateway's context check), not here."""


class _KeywordOnly(msgspec.StructMeta):
    """msgspec applies ``kw_only`` only to the fields of the class that sets it; this
    metaclass sets it on every subclass, so every field of every message is keyword-only
    and later versions can add defaulted fields without breaking positional callers."""

    def __new__(mcls, name: str, bases: tuple, namespace: dict, **kwargs: Any):
        kwargs.setdefault("kw_only", True)
        return super().__new__(mcls, name, bases, namespace, **kwargs)


class Message(msgspec.Struct, metaclass=_KeywordOnly, tag_field="type", tag=lambda name: name):
    """Base of every v1 message: JSON objects tagged ``{"type": "<ClassName>", ...}``."""


class OpenEnum(enum.StrEnum):
    """A closed set of strings on the wire that stays evolvable.

    A sender can only name a member; a receiver decodes a value it does not know (sent by
    a newer peer) as the member ``UNKNOWN`` instead of refusing the whole message, and
    each receiver says what ``UNKNOWN`` means where it reads the field (see
    ``schemas/README.md``, "Closed sets"). Every subclass declares ``UNKNOWN = "unknown"``.
    """

    @classmethod
    def _missing_(cls, value: object) -> OpenEnum:
        return cls("unknown")
