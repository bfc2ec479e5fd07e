"""Service configuration: flags over ``LAMINA_*`` variables over defaults, nested configs
flattened, and ``to_argv`` as the inverse that a launcher uses."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from lamina.libs.config import parse_config, settings, to_argv
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.lora import LoraModule, LoraModules
from lamina.services.engine_worker.engine.speculative import SpeculativeConfig
from lamina.services.engine_worker.service import WorkerConfig, transfer_host
from lamina.services.launcher import UpConfig


def test_every_engine_setting_is_a_worker_flag_and_variable():
    engine_fields = {s.name for s in settings(EngineConfig)}
    worker = {s.name: s for s in settings(WorkerConfig)}
    assert engine_fields <= worker.keys()
    assert worker["num_kv_blocks"].flag == "--num-kv-blocks"
    assert worker["num_kv_blocks"].env == "LAMINA_NUM_KV_BLOCKS"
    # The engine's attribute docstrings are the help text.
    assert "Exact number of KV blocks" in worker["num_kv_blocks"].help


def test_flags_override_variables_override_defaults():
    env = {"LAMINA_MAX_NUM_SEQS": "7", "LAMINA_SEED": "3", "LAMINA_WORKER_ID": "w-env"}
    config = parse_config(
        WorkerConfig, ["--seed", "5", "--no-enable-chunked-prefill", "--model", "m"], env=env
    )
    assert config.worker_id == "w-env"
    assert config.engine == EngineConfig(
        model=Path("m"), max_num_seqs=7, seed=5, enable_chunked_prefill=False
    )
    assert parse_config(WorkerConfig, [], env={}).engine == EngineConfig()


def test_tri_state_cuda_graphs():
    assert parse_config(WorkerConfig, [], env={}).engine.cuda_graphs is None  # automatic
    assert parse_config(WorkerConfig, ["--no-cuda-graphs"], env={}).engine.cuda_graphs is False
    assert parse_config(WorkerConfig, [], env={"LAMINA_CUDA_GRAPHS": "1"}).engine.cuda_graphs


def test_a_bad_value_names_its_variable():
    with pytest.raises(ValueError, match="LAMINA_MAX_NUM_SEQS: 'many' is not a valid int"):
        parse_config(WorkerConfig, [], env={"LAMINA_MAX_NUM_SEQS": "many"})
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--max-num-seqs", "many"], env={})


def test_engine_validation_runs_on_parsed_values():
    with pytest.raises(ValueError, match="max_num_seqs"):
        parse_config(WorkerConfig, ["--max-num-seqs", "0"], env={})


def test_to_argv_rebuilds_the_config():
    engine = EngineConfig(
        model=Path("/m"),
        dtype="float32",
        num_kv_blocks=64,
        enable_prefix_caching=False,
        cuda_graphs=False,
        max_model_len=512,
        gpu_memory_utilization=0.5,
    )
    argv = to_argv(engine)
    assert "--no-enable-prefix-caching" in argv and "--dtype" in argv
    assert "--block-size" not in argv  # at its default
    assert parse_config(EngineConfig, argv, env={}) == engine
    up = UpConfig(workers=2, nats_port=0, engine=engine)
    assert parse_config(UpConfig, to_argv(up), env={}) == up


def test_a_json_setting_is_one_flag_that_round_trips():
    flag = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
    config = parse_config(WorkerConfig, ["--speculative-config", flag], env={})
    assert config.engine.speculative_config == SpeculativeConfig(
        num_speculative_tokens=5, prompt_lookup_max=4
    )
    assert parse_config(WorkerConfig, [], env={}).engine.speculative_config is None
    from_env = parse_config(WorkerConfig, [], env={"LAMINA_SPECULATIVE_CONFIG": flag})
    assert from_env.engine == config.engine
    assert parse_config(EngineConfig, to_argv(config.engine), env={}) == config.engine
    with pytest.raises(ValueError, match="unknown keys"):
        parse_config(WorkerConfig, [], env={"LAMINA_SPECULATIVE_CONFIG": '{"k": 3}'})


def test_lora_modules_take_vllms_forms_and_round_trip():
    argv = ["--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "2"]
    config = parse_config(WorkerConfig, argv, env={}).engine
    assert config.lora_modules == LoraModules(
        (LoraModule("sql", Path("/a/sql")), LoraModule("chat", Path("/a/chat")))
    )
    assert config.enable_lora  # implied by the modules
    assert parse_config(EngineConfig, to_argv(config), env={}) == config
    listed = '[{"name": "sql", "path": "/a/sql"}, {"name": "chat", "path": "/a/chat"}]'
    env = {"LAMINA_LORA_MODULES": listed}
    assert parse_config(WorkerConfig, [], env=env).engine.lora_modules == config.lora_modules
    for bad, message in (("sql", "not name=path"), ("a=/x a=/y", "given twice"), ("{", "not JSON")):
        with pytest.raises(ValueError, match=message):
            LoraModules.parse(bad)


def test_lamina_up_takes_every_engine_setting():
    names = {s.name for s in settings(UpConfig)}
    assert {s.name for s in settings(EngineConfig)} <= names
    assert {"model_name", "nats_port", "nats_url", "workers"} <= names


def test_a_workers_role_and_transfer_host():
    """``--role`` is one of three (a typo is refused, naming them); the transfer listener
    is ``--kv-host`` (``auto``: this host's resolved address), else the distributed
    address, else the loopback."""
    assert parse_config(WorkerConfig, ["--role", "decode"], env={}).role == "decode"
    assert parse_config(WorkerConfig, [], env={"LAMINA_ROLE": "prefill"}).role == "prefill"
    assert parse_config(WorkerConfig, [], env={}).role == "mixed"
    with pytest.raises((SystemExit, ValueError)):
        parse_config(WorkerConfig, ["--role", "prefil"], env={})
    assert transfer_host("", "") == "127.0.0.1"
    assert transfer_host("", "10.0.0.2") == "10.0.0.2"
    assert transfer_host("10.0.0.9", "10.0.0.2") == "10.0.0.9"
    assert transfer_host("auto", "") == socket.gethostbyname(socket.gethostname())
