"""Who may connect to the bus, and what each may publish and subscribe to.

Every process connects as an *identity* that names its role: ``gateway``, ``scheduler``,
``telemetry``, ``operator`` (``lamina ctl``), ``worker.<id>`` (one per worker) and
``api.<name>`` (one per NATS API client). An identity's credential is an NATS nkey
seed in ``<identity>.nk`` (owner-only), the format NATS' own tools read; the server's
configuration holds only the public keys, each with the least-privilege permissions of
its role (:func:`permissions`). A client reads its replies on ``_INBOX.<identity>.>``
and may subscribe to nothing else of anyone's.

Streams (tokens to a gateway, answers to an API client) go to inboxes by an explicit
publish grant, not by ``allow_responses``. A worker's grant covers only the stream subjects
that end in its own id (``<gateway inbox>.<attempt>.<worker id>``, the scheduler's
``subjects.worker_stream``), so the gateway knows which worker sent an event from its
subject alone. ``allow_responses`` would not do: the server forgets the responses it allowed
whenever it reloads its configuration, which adding a credential requires, and every
stream in flight would lose its next token. ``allow_responses`` covers only the one-shot
answers (a ``ControlAck``, a ``ClusterStatus``, a ``KvSnapshot``), which a requester
asks again for.

``worker`` without an id is the pooled worker identity for identical replicas whose ids
are not known in advance (``docker compose --scale``): it may act for any worker id, so
one such worker can pose as another. ``lamina up`` gives each worker its own.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lamina.libs.nats_server import NatsCluster
from lamina.schemas.v1 import subjects

P = subjects.PREFIX
SERVICE_ROLES = ("gateway", "scheduler", "telemetry", "operator")
DEPLOYMENT = (*SERVICE_ROLES, "api.default")
"""The identities every deployment has, besides its workers': ``api.default`` is the
first NATS API client's."""
_NAMED = re.compile(rf"(worker|api)\.({subjects.TOKEN})")
SEED_SUFFIX = ".nk"
USERS_FILE = "users.conf"
SERVER_FILE = "server.conf"
ROUTE_SECRET_FILE = "route.secret"

ONE_SHOT_RESPONSES = {"max": 10_000, "expires": "2m"}
"""Replies to a request this identity received: enough for a KV snapshot in parts."""


class BadIdentity(ValueError):
    """Not a name :func:`permissions` knows."""


def inbox_prefix(identity: str) -> str:
    """Where ``identity`` reads its replies (its connection's ``inbox_prefix``)."""
    return f"_INBOX.{identity}"


def api_subject(identity: str) -> str:
    """The subject API client ``api.<name>`` publishes its ``ApiRequest`` on."""
    role, name = _split(identity)
    if role != "api":
        raise BadIdentity(f"{identity!r} is not an API client (api.<name>)")
    return f"{subjects.API_GENERATE}.{name}"


def _split(identity: str) -> tuple[str, str]:
    if identity in SERVICE_ROLES or identity == "worker":
        return identity, ""
    match = _NAMED.fullmatch(identity)
    if match is None:
        raise BadIdentity(
            f"{identity!r} is not an identity: one of {', '.join(SERVICE_ROLES)}, worker, "
            "worker.<id> or api.<name> (letters, digits, '-' and '_')"
        )
    return match.group(1), match.group(2)


@dataclass(frozen=True)
class Permissions:
    """One identity's grants (NATS subject patterns)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: bool = False
    """May answer requests it received (``allow_responses``, :data:`ONE_SHOT_RESPONSES`)."""

    def to_conf(self) -> dict:
        conf: dict = {
            "publish": {"allow": list(self.publish)} if self.publish else {"deny": [">"]},
            "subscribe": {"allow": list(self.subscribe)} if self.subscribe else {"deny": [">"]},
        }
        if self.responses:
            conf["allow_responses"] = ONE_SHOT_RESPONSES
        return conf


def permissions(identity: str) -> Permissions:
    """The least an identity needs (the module docstring says why streams are grants)."""
    role, name = _split(identity)
    own_inbox = f"{inbox_prefix(identity)}.>"
    gateway_inboxes = f"{inbox_prefix('gateway')}.>"
    if role == "gateway":
        return Permissions(
            publish=(
                subjects.SCHED_SUBMIT,
                subjects.SCHED_CANCEL,
                subjects.SCHED_STATUS,
                subjects.worker_cancel("*"),
                subjects.worker_lora("*"),  # run-time adapters, where the gateway allows it
                subjects.gateway_alive("*"),
                subjects.EVENTS_REQUEST,
                subjects.EVENTS_SERVICE,
                f"{inbox_prefix('api')}.>",  # streams to NATS API clients
            ),
            subscribe=(
                own_inbox,
                subjects.WORKER_STATS_ALL,
                subjects.API_GENERATE,
                f"{subjects.API_GENERATE}.*",
            ),
        )
    if role == "scheduler":
        return Permissions(
            publish=(
                subjects.worker_generate("*"),
                subjects.worker_kv_sync("*"),
                subjects.worker_kv_send("*"),  # grants: which blocks go where
                subjects.worker_control("*"),  # Ping, to take a worker out of quarantine
                subjects.EVENTS_PLACEMENT,
                subjects.EVENTS_SERVICE,
                gateway_inboxes,  # Queued, then the refusal of a request it held
            ),
            subscribe=(
                own_inbox,
                subjects.WORKER_STATS_ALL,
                subjects.WORKER_KV_ALL,
                subjects.EVENTS_PLACEMENT,
                subjects.SCHED_SUBMIT,
                subjects.SCHED_STATUS,
                subjects.SCHED_CANCEL,
            ),
            responses=True,
        )
    if role == "telemetry":
        return Permissions(
            publish=(),
            subscribe=(
                subjects.WORKER_STATS_ALL,
                subjects.EVENTS_REQUEST,
                subjects.EVENTS_PLACEMENT,
                subjects.EVENTS_SERVICE,
            ),
        )
    if role == "operator":
        return Permissions(
            publish=(subjects.worker_control("*"), subjects.SCHED_STATUS),
            subscribe=(own_inbox,),
        )
    if role == "worker":
        wid = name or "*"
        return Permissions(
            publish=(
                subjects.worker_stats(wid),
                subjects.worker_kv(wid),
                subjects.worker_control(wid),  # "is my id free?" at start-up
                subjects.worker_ranks(wid),  # its pipeline stages on other hosts ask
                subjects.EVENTS_SERVICE,
                # Its own stream subjects only (subjects.worker_stream): no worker can
                # publish into a stream another worker holds.
                f"{inbox_prefix('gateway')}.*.*.{wid}",
            ),
            subscribe=(f"{P}.worker.{wid}.>", subjects.GATEWAY_ALIVE_ALL, own_inbox),
            responses=True,
        )
    return Permissions(publish=(api_subject(identity),), subscribe=(own_inbox,))  # api.<name>


def new_seed() -> str:
    """A fresh nkey user seed (``SU...``)."""
    import nkeys

    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()


def public_key(seed: str) -> str:
    import nkeys

    return nkeys.from_seed(bytearray(seed.encode())).public_key.decode()


def identity_of(credential: str | Path) -> str:
    """The identity a credential file ``<identity>.nk`` is for (its name says it)."""
    path = Path(credential)
    if path.suffix != SEED_SUFFIX:
        raise BadIdentity(f"{path}: a NATS credential is named <identity>{SEED_SUFFIX}")
    _split(path.stem)
    return path.stem


class CredentialStore:
    """A directory of credentials and the nats-server configuration that admits them."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, identity: str) -> Path:
        return self.root / f"{identity}{SEED_SUFFIX}"

    def ensure(self, *identities: str) -> list[Path]:
        """Create the credentials that do not exist yet (owner-only); keep the others, so
        clients holding them stay admitted. Rewrites the server's user list."""
        for identity in identities:
            _split(identity)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        paths = []
        for identity in identities:
            path = self.path(identity)
            if not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as out:
                    out.write(new_seed() + "\n")
            paths.append(path)
        self.write_users()
        return paths

    def identities(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob(f"*{SEED_SUFFIX}"))

    def write_users(self) -> Path:
        """``users.conf``: each identity's public key and permissions (no secrets)."""
        users = []
        for identity in self.identities():
            key = public_key(self.path(identity).read_text().strip())
            perms = json.dumps(permissions(identity).to_conf())
            users.append(f"  {{nkey: {json.dumps(key)}, permissions: {perms}}}  # {identity}")
        return _write_private(self.root / USERS_FILE, "users = [\n" + "\n".join(users) + "\n]\n")

    def route_secret(self) -> str:
        """The password a cluster's NATS nodes authenticate their routes with (made once,
        owner-only; every host of a cluster has a copy of the same store)."""
        path = self.root / ROUTE_SECRET_FILE
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path.read_text().strip()
        secret = secrets.token_urlsafe(24)
        with os.fdopen(fd, "w") as out:
            out.write(secret + "\n")
        return secret

    def write_server_config(
        self,
        host: str,
        port: int,
        tls_cert: str = "",
        tls_key: str = "",
        cluster: NatsCluster | None = None,
    ) -> Path:
        """``server.conf`` for ``nats-server -c``: listen, optional TLS, the user list; for
        a node of a cluster, its routes too (authenticated by :meth:`route_secret`), in
        ``server-<its name>.conf``, so hosts that share one store each keep their own."""
        lines = [f"host: {json.dumps(host)}", f"port: {port}"]
        if tls_cert or tls_key:
            lines.append(
                f"tls {{cert_file: {json.dumps(tls_cert)}, key_file: {json.dumps(tls_key)}}}"
            )
        lines.append(f"authorization {{\n  include {json.dumps(USERS_FILE)}\n}}")
        if cluster is not None:
            lines.append(cluster.config(self.route_secret()))
        self.write_users()
        name = SERVER_FILE if cluster is None else f"server-{cluster.server_name}.conf"
        return _write_private(self.root / name, "\n".join(lines) + "\n")


def _write_private(path: Path, text: str) -> Path:
    # A temporary name of its own: processes sharing one store (a cluster's nodes on one
    # file system) may rewrite the same file at once.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    with os.fdopen(fd, "w") as out:
        out.write(text)
    Path(tmp).replace(path)  # a reloading server never reads half a file
    return path
