"""Every v1 subject, in one place."""

from __future__ import annotations

import re

TOKEN = r"[A-Za-z0-9_-]{1,64}"
"""What a name inside a subject (a worker id, a client name) may be: one subject token."""
_TOKEN = re.compile(TOKEN)

PREFIX = "lamina.v1"
API_GENERATE = f"{PREFIX}.api.generate"
SCHED_SUBMIT = f"{PREFIX}.sched.submit"
SCHED_STATUS = f"{PREFIX}.sched.status"
SCHED_CANCEL = f"{PREFIX}.sched.cancel"
"""``Cancel`` for a request still in a scheduler's queue (every replica listens)."""
EVENTS_REQUEST = f"{PREFIX}.events.request"
EVENTS_PLACEMENT = f"{PREFIX}.events.placement"
EVENTS_SERVICE = f"{PREFIX}.events.service"
"""``ServiceStarted``: each service, once, when it begins to serve."""
WORKER_STATS_ALL = f"{PREFIX}.worker.*.stats"
WORKER_KV_ALL = f"{PREFIX}.worker.*.kv"
GATEWAY_ALIVE_ALL = f"{PREFIX}.gateway.*.alive"


def worker_generate(worker_id: str) -> str:
    return f"{PREFIX}.worker.{worker_id}.generate"


def worker_cancel(worker_id: str) -> str:
    return f"{PREFIX}.worker.{worker_id}.cancel"


def worker_control(worker_id: str) -> str:
    return f"{PREFIX}.worker.{worker_id}.control"


def worker_stats(worker_id: str) -> str:
    return f"{PREFIX}.worker.{worker_id}.stats"


def worker_kv(worker_id: str) -> str:
    return f"{PREFIX}.worker.{worker_id}.kv"


def gateway_alive(gateway_id: str) -> str:
    return f"{PREFIX}.gateway.{gateway_id}.alive"


def worker_ranks(worker_id: str) -> str:
    """Request/reply: a stage host asks the worker how to join its group
    (``RanksRequest`` → ``RankRendezvous``)."""
    return f"{PREFIX}.worker.{worker_id}.ranks"


def worker_lora(worker_id: str) -> str:
    """Request/reply: load or unload a LoRA adapter at run time (``LoraCommand`` →
    ``LoraAck``; the gateway's ``/v1/load_lora_adapter``)."""
    return f"{PREFIX}.worker.{worker_id}.lora"


def worker_kv_send(worker_id: str) -> str:
    """A scheduler's ``KvGrant``: blocks the worker may send to another, once."""
    return f"{PREFIX}.worker.{worker_id}.kv.send"


def worker_kv_sync(worker_id: str) -> str:
    """Request/reply: a scheduler asks the worker for a ``KvSnapshot`` of its cache."""
    return f"{PREFIX}.worker.{worker_id}.kv.sync"


def worker_stream(attempt: str, worker_id: str) -> str:
    """Where worker ``worker_id`` streams the events of a submission whose reply subject is
    ``attempt``: a subject under it that the bus's permissions let only that worker
    publish on (``lamina.libs.nats_auth``), so the gateway knows which worker sent each
    event. The scheduler forwards a request with this as its reply subject."""
    return f"{attempt}.{worker_id}"


STREAM_BATCH = "batch"
"""The ``<attempt>`` token of a gateway inbox's batch subject: no attempt's (an attempt's
is 22 random characters)."""


def stream_batch(inbox: str, worker_id: str) -> str:
    """Where worker ``worker_id`` sends a ``StreamBatch`` for the gateway that reads
    ``inbox``: a :func:`worker_stream` subject of the reserved attempt ``STREAM_BATCH``,
    so the same permission (a worker publishes only on subjects that end in its id) tells
    the gateway who sent it."""
    return worker_stream(f"{inbox}.{STREAM_BATCH}", worker_id)


def stream_inbox(stream: str) -> str:
    """The gateway inbox (``GatewayAlive.inbox_prefix``) a :func:`worker_stream` subject
    belongs to: ``<inbox>.<attempt>.<worker id>`` -> ``<inbox>``."""
    return stream.rsplit(".", 2)[0]


def check_token(what: str, name: str) -> str:
    """``name`` if it can be one subject token, else a ``ValueError`` that says why."""
    if not _TOKEN.fullmatch(name):
        raise ValueError(
            f"{what} {name!r} cannot name a subject: use 1-64 letters, digits, '-' or '_'"
        )
    return name


def sender_worker(subject: str) -> str:
    """The worker id a ``worker.<id>.*`` subject belongs to. The bus's permissions let a
    worker publish only on its own, so a message there speaks for that worker only."""
    return subject[len(PREFIX) + 8 :].split(".", 1)[0]  # "<PREFIX>.worker.<id>...."
