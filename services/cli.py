"""The ``lamina`` command line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

#: ``lamina <name> ...`` runs the service's own entry point with the remaining arguments.
SERVICES = {
    "gateway": "lamina.services.gateway.__main__",
    "scheduler": "lamina.services.scheduler.__main__",
    "worker": "lamina.services.engine_worker.__main__",
    "telemetry": "lamina.services.telemetry.__main__",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:
        import importlib

        return importlib.import_module(SERVICES[argv[0]]).main(argv[1:])
    if argv and argv[0] == "ctl":
        from lamina.services.ctl import main as ctl

        return ctl(argv[1:])
    if argv and argv[0] == "creds":
        from lamina.services.creds import main as creds

        return creds(argv[1:])
    if argv and argv[0] == "up":
        from lamina.services.launcher import main as up

        return up(argv[1:])
    if argv and argv[0] == "node":
        from lamina.services.node import main as node

        return node(argv[1:])
    if argv and argv[0] == "stage":  # a worker's companion on another host, not a service
        from lamina.services.engine_worker.stage_host import main as stage

        return stage(argv[1:])
    if argv[:2] == ["schemas", "export"]:
        from lamina.schemas.export import main as export

        return export(argv[2:])
    parser = argparse.ArgumentParser(prog="lamina", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in SERVICES:
        commands.add_parser(name, help=f"run the {name} service (see `lamina {name} --help`)")
    commands.add_parser("up", help="run the whole stack locally (see `lamina up --help`)")
    commands.add_parser(
        "node", help="run one host's share of a multi-host stack (see `lamina node --help`)"
    )
    commands.add_parser(
        "stage", help="run a pipeline stage of a worker on another host (`lamina stage --help`)"
    )
    commands.add_parser("ctl", help="operate a running cluster (see `lamina ctl --help`)")
    commands.add_parser("creds", help="the bus's credentials (see `lamina creds --help`)")
    schemas = commands.add_parser("schemas", help="wire schema tools")
    schemas.add_subparsers(dest="schemas_command").add_parser(
        "export", help="write JSON Schema for every wire type (`lamina schemas export DIR`)"
    )

    model = commands.add_parser("model", help="manage local models")
    model_cmds = model.add_subparsers(dest="model_command", required=True)
    init = model_cmds.add_parser("init", help="create the default model (no network)")
    init.add_argument(
        "--preset", default="tiny", help="tiny (default), small, or medium (0.7B parameters)"
    )
    init.add_argument("--dir", type=Path, help="target directory (default: the cache)")
    init.add_argument("--force", action="store_true", help="recreate it even if present")

    gen = commands.add_parser("generate", help="run the engine in-process on one prompt")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--model", type=Path, help="checkpoint directory (default model if unset)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)

    args = parser.parse_args(argv)
    if args.command == "model":
        from lamina.services.engine_worker.default_model import ensure_default_model

        print(ensure_default_model(args.preset, args.dir, args.force))
        return 0
    if args.command == "generate":
        return _generate(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


def _generate(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from lamina.services.engine_worker.default_model import ensure_default_model
    from lamina.services.engine_worker.engine import Engine, EngineConfig, SamplingParams

    model = args.model or ensure_default_model()
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    engine = Engine(EngineConfig(model=model))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    engine.add_request("cli", tokenizer.encode(args.prompt).ids, params)
    started, tokens = time.perf_counter(), []
    while engine.has_work():
        for output in engine.step().outputs:
            tokens += output.new_token_ids
            if output.finished:
                reason = output.finish_reason
    elapsed = time.perf_counter() - started
    print(tokenizer.decode(tokens))
    print(f"[{len(tokens)} tokens in {elapsed:.2f}s, finish_reason={reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
