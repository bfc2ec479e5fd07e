"""The tagged base every v1 wire type derives from."""

from __future__ import annotations

from typing import Any

import msgspec


class _KeywordOnly(msgspec.StructMeta):
    """msgspec applies ``kw_only`` only to the fields of the class that sets it; this
    metaclass sets it on every subclass, so every field of every message is keyword-only
    and later versions can add defaulted fields without breaking positional callers."""

    def __new__(mcls, name: str, bases: tuple, namespace: dict, **kwargs: Any):
        kwargs.setdefault("kw_only", True)
        return super().__new__(mcls, name, bases, namespace, **kwargs)


class Message(msgspec.Struct, metaclass=_KeywordOnly, tag_field="type", tag=lambda name: name):
    """Base of every v1 message: JSON objects tagged ``{"type": "<ClassName>", ...}``."""
