"""The launcher's guard against a second start (no processes are spawned here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.launcher import Stack, UpConfig, stack_of


def test_a_started_stack_refuses_a_second_start():
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    stack = Stack(model=Path("unused"), nats_url="nats://127.0.0.1:1")
    stack.procs["scheduler"] = running
    try:
        with pytest.raises(RuntimeError, match="already started"):
            stack.start()
        assert list(stack.procs) == ["scheduler"]  # nothing else was spawned
    finally:
        stack.stop(timeout=5)
    assert running.poll() is not None


def test_lamina_up_hands_its_keys_and_policies_to_the_gateway_and_telemetry():
    keyed = UpConfig(api_key="k1", api_key_file="keys", api_client_file="clients")
    stack = stack_of(keyed, Path("model"))
    assert stack.gateway_args == [
        "--api-key", "k1", "--api-key-file", "keys", "--api-client-file", "clients"
    ]  # fmt: skip
    # Its cluster is not shown to whoever asks: the gateway's keys, unless its own.
    assert stack.telemetry_args == ["--metrics-api-key", "k1", "--metrics-api-key-file", "keys"]
    own = stack_of(UpConfig(api_key="k1", metrics_api_key="m"), Path("model"))
    assert own.telemetry_args == ["--metrics-api-key", "m"]
    assert stack_of(UpConfig(), Path("model")).telemetry_args == []


def test_every_gateway_setting_is_a_flag_of_up_and_node_and_reaches_the_gateway():
    from lamina.libs.config import parse_config, settings
    from lamina.services.gateway.config import GatewayOptions
    from lamina.services.gateway.service import GatewayConfig
    from lamina.services.node import NodeConfig

    serving = {s.name for s in settings(GatewayOptions)}
    assert serving <= {s.name for s in settings(GatewayConfig)}
    for kind in (UpConfig, NodeConfig):
        assert serving <= {s.name for s in settings(kind)}, kind
    argv = ["--tool-call-parser", "llama3_json", "--tokenizer-workers", "0",
            "--trust-request-chat-template", "--stall-timeout", "90"]  # fmt: skip
    config = parse_config(UpConfig, argv, env={})
    stack = stack_of(config, Path("model"))
    assert parse_config(GatewayConfig, stack.gateway_args, env={}).options == config.gateway
    assert config.gateway.stall_timeout == 90 and config.gateway.trust_request_chat_template


def test_each_tensor_parallel_group_on_cuda_takes_the_next_devices():
    def devices(device: str, size: int, workers: int = 3) -> list[str] | None:
        engine = EngineConfig(device=device, tensor_parallel_size=size)
        stack = stack_of(UpConfig(workers=workers, engine=engine), Path("model"))
        if stack.worker_device is None:
            return None
        return [stack.worker_device(index) for index in range(workers)]

    assert devices("cuda", 2) == ["cuda:0", "cuda:2", "cuda:4"]
    assert devices("cuda:1", 4, workers=2) == ["cuda:1", "cuda:5"]
    engine = EngineConfig(device="cuda", tensor_parallel_size=2, pipeline_parallel_size=2)
    stack = stack_of(UpConfig(workers=2, engine=engine), Path("model"))
    assert stack.worker_device(1) == "cuda:4"  # four ranks each
    assert devices("cuda", 1) is None  # one device per worker: as configured, shared
    assert devices("cpu", 2) is None


def test_help_shows_defaults_and_no_sphinx_markup():
    from lamina.libs.config import plain

    text = subprocess.run(
        [sys.executable, "-m", "lamina.services.cli", "up", "--help"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "``" not in text and ":mod:" not in text and ":class:" not in text
    flat = " ".join(text.split())
    assert "(default: 8000; env LAMINA_HTTP_PORT)" in flat
    assert "$LAMINA_HOME/models/lamina-tiny" in flat
    assert plain("see :mod:`a.b` and ``c``, :class:`~d.E`") == "see a.b and c, d.E"


def test_workers_roles_split_one_hosts_workers_or_give_them_all_one():
    from lamina.services.launcher import preflight

    def roles(**flags) -> list[list[str]]:
        config = UpConfig(workers=3, **flags)
        return [stack_of(config, Path("model")).role_of(index) for index in range(3)]

    assert roles() == [[], [], []]  # each worker's own default: mixed
    assert roles(prefill_workers=1) == [["--role", r] for r in ("prefill", "decode", "decode")]
    assert roles(worker_role="decode") == [["--role", "decode"]] * 3  # a decode host
    model = Path(__file__)  # (never reached: the flags are refused first)
    refused = preflight(UpConfig(workers=2, prefill_workers=1, worker_role="decode"), model, [])
    assert refused is not None and "--worker-role" in refused
    refused = preflight(UpConfig(worker_role="both"), model, [])
    assert refused is not None and "mixed, prefill or decode" in refused


def test_the_embedded_nats_servers_threads_reach_its_stack_and_a_negative_count_is_refused():
    from lamina.services.launcher import NATS_PROCS, preflight

    assert stack_of(UpConfig(), Path("model")).nats_procs == NATS_PROCS
    assert stack_of(UpConfig(nats_procs=0), Path("model")).nats_procs == 0  # Go's default
    refused = preflight(UpConfig(nats_procs=-1), Path(__file__), [])
    assert refused is not None and "--nats-procs -1" in refused


def test_a_hosts_workers_split_its_cpus_unless_openmp_threads_are_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert Stack(model=Path("m"), workers=3).worker_env() == {"OMP_NUM_THREADS": "2"}
    assert Stack(model=Path("m"), workers=16).worker_env() == {"OMP_NUM_THREADS": "1"}
    assert Stack(model=Path("m"), workers=1).worker_env() == {}  # the machine is its own
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the operator's choice stands
    assert Stack(model=Path("m"), workers=3).worker_env() == {}


def test_a_workers_ranks_split_its_share_of_the_cpus(monkeypatch):
    from lamina.services.engine_worker.engine.rank_group import rank_threads

    config = EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert rank_threads(config) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2,1")  # nested levels: the first is the team
    assert rank_threads(config) == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.cpu_count", lambda: 12)
    assert rank_threads(config) == 3
