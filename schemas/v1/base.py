"""The tagged base every v1 wire type derives from."""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, tag_field="type", tag=lambda name: name, kw_only=True):
    """Base of every v1 message: JSON objects tagged ``{"type": "<ClassName>", ...}``.

    ``kw_only`` lets later versions add fields with defaults anywhere after the base's.
    """
