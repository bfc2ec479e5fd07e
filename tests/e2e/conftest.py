"""The four services as separate processes on a real nats-server, driven by real clients.

The NATS server is the embedded ``nats-server`` binary (the CI path). Where a Docker
engine is reachable, ``test_compose.py`` additionally brings up ``compose.yaml``.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from lamina.libs.nats_server import free_port
from lamina.services.launcher import Stack


def make_stack(model: Path, tmp: Path, **kwargs) -> Stack:
    return Stack(
        model=model, http_port=free_port(), metrics_port=free_port(), log_dir=tmp / "logs", **kwargs
    )


@pytest.fixture(scope="session")
def trace_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("traces") / "spans.jsonl"


@pytest.fixture(scope="session")
def stack(tiny_model, tmp_path_factory, trace_file):
    """One shared stack: scheduler, telemetry, one worker, gateway; spans to a file."""
    tmp = tmp_path_factory.mktemp("stack")
    s = make_stack(
        tiny_model,
        tmp,
        extra_env={"LAMINA_TRACE_FILE": str(trace_file)},
        worker_args=["--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024"],
        telemetry_args=["--metrics-compat", "vllm"],
    )
    with s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    """The official OpenAI client on the shared stack."""
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    """The default model's tokenizer, as ``tokenizers`` loads it."""
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def read_spans(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
