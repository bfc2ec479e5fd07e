from __future__ import annotations

import pytest

from lamina.libs.nats_server import NatsServer


@pytest.fixture(scope="session")
def nats_url():
    """A real nats-server for the session: the embedded binary (the CI path)."""
    with NatsServer() as server:
        yield server.url
