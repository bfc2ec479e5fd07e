"""The typed reply to a request whose payload could not be decoded."""

from __future__ import annotations

from lamina.schemas.v1.base import Id, Message, Text


class BadMessage(Message):
    """Sent to a message's reply subject when its payload does not decode."""

    subject: Id
    error: Text
