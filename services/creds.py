"""``lamina creds``: the bus's credentials (``lamina.libs.nats_auth``).

``init`` makes the services' credentials (and any identities named), the route secret a
cluster's nodes authenticate each other with, and ``server.conf`` for ``nats-server -c``:
what a NATS server that ``lamina up`` did not start (compose, a cluster) needs. A cluster
of ``lamina node`` hosts shares one store: make it once, with every host's worker
identities, and copy it to each host. ``add`` makes more (a worker on another host, an
API client) and rewrites the user list; the ``lamina up`` running on this machine with this
store has its server re-read it at once (another server admits them once its
configuration is reloaded). ``list`` prints the identities and their grants.
Existing credentials are never replaced: whoever holds one stays admitted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from lamina.libs.config import lamina_home
from lamina.libs.nats_auth import DEPLOYMENT, BadIdentity, CredentialStore, permissions
from lamina.services import up_state


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lamina creds", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=lamina_home() / "nats",
        help="the credential store (default: LAMINA_HOME/nats, where lamina up keeps it)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help="the services' credentials and server.conf")
    init.add_argument("identities", nargs="*", help="more: worker.<id>, worker, api.<name>")
    init.add_argument("--host", default="0.0.0.0", help="address the server listens on")
    init.add_argument("--port", type=int, default=4222, help="port the server listens on")
    init.add_argument("--tls-cert", default="", help="server certificate (PEM): TLS only")
    init.add_argument("--tls-key", default="", help="its private key (PEM)")
    add = commands.add_parser("add", help="make credentials for more identities")
    add.add_argument("identities", nargs="+", help="worker.<id>, worker, api.<name>, ...")
    commands.add_parser("list", help="every identity and what it may publish and subscribe")
    return parser.parse_args(argv)


def _reload(store: Path) -> str:
    """Have the NATS server of the ``lamina up`` running with ``store`` re-read it (a
    SIGHUP, as ``nats-server --signal reload`` sends); what happened, on one line."""
    up = up_state.running()
    if up is None or not up.credentials or Path(up.credentials).resolve() != store.resolve():
        return (
            "no lamina up runs with this store here; a NATS server started on it admits them "
            "once its configuration is reloaded (nats-server --signal reload, or SIGHUP)"
        )
    if not up.nats_pid or not _is_nats_server(up.nats_pid):
        return f"lamina up (pid {up.pid}) uses a NATS server it did not start: reload that one"
    os.kill(up.nats_pid, signal.SIGHUP)
    return f"lamina up's NATS server (pid {up.nats_pid}) reloaded its credentials: admitted now"


def _is_nats_server(pid: int) -> bool:
    """Whether ``pid`` is a nats-server (a recorded pid may be stale, and reused)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return Path(command.decode(errors="replace")).name.startswith("nats-server")


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    store = CredentialStore(args.dir)
    try:
        if args.command == "init":
            for path in store.ensure(*DEPLOYMENT, *args.identities):
                print(path)
            store.route_secret()
            if bool(args.tls_cert) != bool(args.tls_key):
                raise BadIdentity("--tls-cert and --tls-key go together")
            conf = store.write_server_config(args.host, args.port, args.tls_cert, args.tls_key)
            print(f"nats-server -c {conf}")
        elif args.command == "add":
            for path in store.ensure(*args.identities):
                print(path)
            print(_reload(args.dir))
        else:
            for identity in store.identities():
                grants = permissions(identity)
                print(f"{identity}\n  publish   {' '.join(grants.publish) or '(nothing)'}")
                print(f"  subscribe {' '.join(grants.subscribe) or '(nothing)'}")
    except BadIdentity as exc:
        print(f"lamina creds: {exc}", file=sys.stderr)
        return 2
    return 0
