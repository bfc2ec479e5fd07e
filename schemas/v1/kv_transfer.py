"""KV blocks moving between workers: the scheduler's grant to the worker that sends, and
the source it names in the request of the worker that receives
(``services/engine_worker/kv_transfer.py`` says how the transfer runs)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from lamina.schemas.v1.base import Id, Message

Token = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
"""A transfer's one-time secret: 32 random bytes, hex."""
GrantId = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]


class KvGrant(Message):
    """scheduler → ``worker.<id>.kv_send``: the blocks this worker may send, once, to
    the receiver that proves it holds ``token`` (within a short time, or it lapses)."""

    grant_id: GrantId
    token: Token
    receiver: Id
    """The worker the blocks go to (for the sender's log; the token is what it checks)."""
    block_hashes: list[int]
    """A sequence's leading block hashes: the sender sends the leading run it holds."""
    prefill_token_ids: list[int] = []
    """A prefill leg (disaggregated serving): the sender computes these tokens first,
    whose KV the blocks are, and sends once it has (empty: it sends what it holds)."""


class KvSource(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Where the receiving worker fetches a request's prefix from, before it runs it
    (``GenerateRequest.kv_source``, set by the scheduler only)."""

    worker_id: Id
    address: Id
    """``host:port`` of the sender's transfer listener (its ``WorkerStats.kv_address``)."""
    grant_id: GrantId
    token: Token
    block_hashes: list[int]
    """The blocks granted (the request's leading blocks the sender holds)."""
    prefill: bool = False
    """The sender computes the blocks first (a prefill leg): the receiver waits for them
    its ``--kv-prefill-timeout``, not its fetch timeout."""
