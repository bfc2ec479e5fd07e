"""How the gateway serves: the settings ``lamina gateway``, ``lamina up`` and ``lamina node``
share (a module of its own so the launchers read them without the gateway's imports)."""

from __future__ import annotations

from dataclasses import dataclass

from lamina.libs.config import option
from lamina.libs.http_server import HEADER_TIMEOUT_S, MAX_CONNECTIONS, MIN_BODY_RATE
from lamina.services.gateway.tool_calls import PARSERS


@dataclass(frozen=True)
class GatewayOptions:
    """How the gateway serves: its timeouts, bounds and request features (every one is a
    flag of ``lamina up`` and ``lamina node`` too)."""

    accept_timeout: float = option(5.0, "seconds to wait for a worker to accept a request")
    stall_timeout: float = option(60.0, "seconds without events before a request fails")
    max_attempts: int = option(3, "submissions per request before giving up")
    graceful_shutdown: float = option(60.0, "seconds SIGTERM waits for open HTTP requests")
    http_header_timeout: float = option(
        HEADER_TIMEOUT_S, "seconds a client may take to send a request's head (then a 408)"
    )
    http_min_body_rate: float = option(
        MIN_BODY_RATE, "bytes/s a request body must keep up after the head, past that grace"
    )
    http_max_connections: int = option(
        MAX_CONNECTIONS, "open HTTP connections held; beyond, a new one is answered 503"
    )
    http_reuse_port: bool = option(
        False,
        "share the HTTP port with other gateway processes (SO_REUSEPORT: the kernel spreads "
        "new connections between them; lamina up --gateways N starts them so)",
    )
    max_open_requests: int = option(4096, "requests held at once before new ones get a 429")
    max_open_prompt_tokens: int = option(1 << 24, "their prompt tokens, likewise")
    max_sequences_per_request: int = option(
        256, "sequences one request may ask for: its prompts times n (more: a 400)"
    )
    tool_call_parser: str = option(
        "hermes",
        "how tool calls are read from output for tool_choice auto (vLLM's names: hermes, "
        "llama3_json; empty: refuse auto)",
    )
    tokenizer_workers: int = option(
        1, "processes that tokenize long prompts off the event loop (0: all on it)"
    )
    trust_request_chat_template: bool = option(
        False, "let a chat request bring its own chat_template (rendered in the sandbox)"
    )
    allow_runtime_lora_updating: bool = option(
        False,
        "serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): callers make workers read paths on their hosts",
    )

    def __post_init__(self) -> None:
        if self.tool_call_parser and self.tool_call_parser not in PARSERS:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser!r}: use one of "
                + ", ".join(PARSERS)
                + " (or empty)"
            )
