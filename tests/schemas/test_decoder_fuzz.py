"""Every wire decoder under hostile input (hypothesis): arbitrary bytes, arbitrary JSON,
and real messages with one field replaced by arbitrary JSON. A decoder returns a message
of its type or raises ``msgspec.DecodeError`` (a ``ValidationError`` included), or, for
hostile nesting, ``RecursionError``: the two failures the bus turns into a dropped
message or a typed ``BadMessage``. Anything else would reach a service as a crash."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lamina.libs.bus import decoder, encode
from lamina.schemas.v1.api import ApiEvent
from lamina.schemas.v1.control import ControlCommand
from lamina.schemas.v1.errors import BadMessage
from lamina.schemas.v1.generate import StreamEvent
from lamina.schemas.v1.lora import LoraCommand
from tests.schemas.test_evolution import TYPES, golden_instances

#: What the services subscribe with: each message type, and the unions some subjects carry.
DECODED = [*TYPES, StreamEvent | BadMessage, ControlCommand, LoraCommand, ApiEvent]
IDS = [getattr(t, "__name__", None) or str(t) for t in DECODED]

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def survives(message_type, data: bytes) -> None:
    try:
        decoded = decoder(message_type).decode(data)
    except (msgspec.DecodeError, RecursionError):
        return
    assert decoded is not None


@pytest.mark.parametrize("message_type", DECODED, ids=IDS)
@FUZZ
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes(message_type, data):
    survives(message_type, data)


@pytest.mark.parametrize("message_type", DECODED, ids=IDS)
@FUZZ
@given(value=JSON)
def test_arbitrary_json(message_type, value):
    survives(message_type, json.dumps(value).encode())


GOLDEN = golden_instances()


@pytest.mark.parametrize("name", sorted(GOLDEN))
@FUZZ
@given(data=st.data())
def test_real_messages_with_a_field_replaced(name, data):
    message = json.loads(encode(GOLDEN[name]))
    field = data.draw(st.sampled_from(sorted(message)))
    message[field] = data.draw(JSON)
    survives(type(GOLDEN[name]), json.dumps(message).encode())


def test_hostile_nesting():
    for message_type in DECODED:
        survives(message_type, b"[" * 100_000 + b"]" * 100_000)
        survives(message_type, b'{"type":"' + b"x" * 1_000_000 + b'"}')
