"""Wire compatibility of the v1 schemas: golden payloads, an old peer, msgspec's rules.

- ``golden/<Type>.json``: one checked-in payload per concrete v1 type, every field set. It
  must decode with today's type and re-encode byte for byte, so any change to what goes
  on the wire shows up as a diff here.
- ``frozen_v1.py``: the types as released. Today's payloads must decode with them (a new
  service talking to an old one) and theirs with today's types (the other way round), and
  today's JSON Schema must extend theirs only by appending fields with defaults.

Regenerate the goldens after an additive change with ``LAMINA_WRITE_GOLDEN=1 pytest
tests/schemas`` (see ``schemas/README.md``); the normal run never writes.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from lamina.libs.bus import decoder
from lamina.schemas.export import message_types
from lamina.schemas.v1.api import ApiDelta, ApiError, ApiEvent, ApiFinished, ApiRequest, ChatMessage
from lamina.schemas.v1.base import Message, OpenEnum
from lamina.schemas.v1.control import (
    Cancel,
    ControlAck,
    ControlCommand,
    Cordon,
    Drain,
    Ping,
    ResetPrefixCache,
    Resume,
    Uncordon,
)
from lamina.schemas.v1.errors import BadMessage
from lamina.schemas.v1.generate import (
    Accepted,
    EngineTimings,
    Failed,
    Finished,
    GenerateRequest,
    PromptLogprobs,
    Queued,
    Rejected,
    Sampling,
    Sla,
    StreamBatch,
    StreamedEvent,
    StreamEvent,
    StructuredOutput,
    TokenLogprob,
    Tokens,
    Usage,
)
from lamina.schemas.v1.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvSnapshot,
    KvSyncRequest,
    Medium,
)
from lamina.schemas.v1.kv_transfer import KvGrant, KvSource
from lamina.schemas.v1.lora import LoadLora, LoraAck, LoraCommand, UnloadLora
from lamina.schemas.v1.ranks import RankRendezvous, RanksRequest
from lamina.schemas.v1.records import (
    BusHealth,
    PlacementRecord,
    RequestRecord,
    ScoredWorker,
    ServiceStarted,
)
from lamina.schemas.v1.stats import (
    ClusterStatus,
    ClusterStatusRequest,
    GatewayAlive,
    Rank,
    WorkerState,
    WorkerStats,
    WorkerView,
)
from tests.schemas import frozen_v1

GOLDEN_DIR = Path(__file__).parent / "golden"
WRITE_GOLDEN_ENV = "LAMINA_WRITE_GOLDEN"

TYPES = message_types()
TYPE_IDS = [t.__name__ for t in TYPES]
FROZEN = frozen_v1.MESSAGE_TYPES


# --- golden payloads ----------------------------------------------------------------------


CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def golden_instances() -> dict[str, Message]:
    """One realistic instance per v1 type with every field set (no ``None``, no empty
    list, no default left out by ``omit_defaults``), so every field reaches the wire.
    ``ApiRequest`` sets all three prompt forms: the API takes one, the schema carries all.
    """
    request_id, worker_id, model = "req-7f3a9c21", "gpu-node-3-4127", "lamina-tiny"
    sampling = Sampling(
        max_tokens=128,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        seed=1234,
        stop_token_ids=[2, 32000],
        ignore_eos=True,
        min_tokens=4,
        logprobs=2,
        prompt_logprobs=1,
        logit_bias={50256: -100.0, 13: 2.5},
        allowed_token_ids=[13, 198, 50256],
        bad_words_token_ids=[[464], [1820, 2187]],
        structured=StructuredOutput(
            json='{"type": "object", "properties": {"city": {"type": "string"}}}',
            disable_any_whitespace=True,
        ),
    )
    sla = Sla(priority=1, deadline_ms=1767225630000, ttft_target_ms=250)
    usage = Usage(prompt_tokens=42, completion_tokens=3, cached_tokens=32)
    logprobs = [
        TokenLogprob(logprob=-0.105, top=[(1576, -0.105), (278, -2.42)]),
        TokenLogprob(logprob=-1.37, top=[(4996, -0.61), (17354, -1.37)]),
    ]
    hashes = [1843199445059184293, 5776358722608970243, 6106059961509430927]
    stats = WorkerStats(
        worker_id=worker_id,
        model=model,
        device="cuda:0",
        state="draining",
        block_size=16,
        total_kv_blocks=4096,
        free_kv_blocks=3712,
        kv_cache_usage=0.09375,
        prefix_cache_hit_ratio=0.62,
        prefix_cache_queries=1800,
        prefix_cache_hits=1116,
        num_running=12,
        num_waiting=3,
        num_queued_prefill_tokens=1536,
        max_num_batched_tokens=2048,
        max_num_seqs=128,
        max_model_len=2048,
        prefill_tokens_per_s=18250.5,
        decode_tokens_per_s=940.25,
        num_preemptions=2,
        prompt_tokens_total=512000,
        generation_tokens_total=98304,
        timestamp_ms=1767225600500,
        heartbeat_interval_s=0.25,
        state_reason="3 requests left to finish before exit (SIGTERM)",
        incarnation="5c1e0a9b7d3f4e21",
        cordoned=True,
        prompt_tokens_cached=204800,
        iteration_tokens=[5, 900, 40, 12, 8, 3, 2, 1, 0, 0, 0, 0, 0, 0],
        iteration_tokens_sum=61440,
        kv_cache_dtype="fp8",
        enable_prefix_caching=False,
        dtype="bfloat16",
        weight_dtype="int8",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        ranks=[
            Rank(
                rank=rank,
                host="gpu-node-7",
                device=f"cuda:{rank}",
                pid=4100 + rank,
                stage=rank // 2,
                weight_bytes=7_516_192_768,
                kv_bytes=60_129_542_144,
            )
            for rank in range(4)
        ],
        host_kv_blocks=65536,
        host_kv_blocks_used=40960,
        host_kv_loads_total=1024,
        host_kv_saves_total=52000,
        host_kv_load_blocks_per_s=31250.5,
        disk_kv_blocks=262144,
        disk_kv_blocks_used=131072,
        disk_kv_loads_total=256,
        disk_kv_saves_total=20000,
        disk_kv_load_blocks_per_s=2500.25,
        kv_layout="16/bfloat16/32/8/128",
        kv_address="10.0.0.2:40123",
        kv_fetches_total=12,
        kv_fetch_failures_total=1,
        kv_fetched_blocks_total=3072,
        kv_sent_blocks_total=2048,
        kv_fetch_blocks_per_s=812.5,
        role="decode",
        kv_prefills_total=0,
        spec_decode_num_drafts=9000,
        spec_decode_num_draft_tokens=27000,
        spec_decode_num_accepted_tokens=15000,
        spec_decode_num_accepted_tokens_per_pos=[7000, 5000, 3000],
        lora_adapters=["sql", "chat"],
        max_loras=2,
        running_lora_adapters=["sql"],
        waiting_lora_adapters=["chat"],
        placements_seen={"scheduler-0/5e1f09a2": 4182, "scheduler-1/0b7c33d4": 977},
    )
    timings = EngineTimings(queued_s=0.012, prefill_s=0.0705, decode_s=0.0488, num_preemptions=1)
    instances: list[Message] = [
        ApiRequest(
            prompt="Once upon a time",
            prompt_token_ids=[1, 450, 4996, 17354],
            messages=[
                ChatMessage(role="system", content="You are a terse storyteller."),
                ChatMessage(role="user", content="Tell me about the engine."),
            ],
            model=model,
            sampling=sampling,
            sla=sla,
            stop=["\n\n", "The end"],
            request_id=request_id,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
        ),
        ApiDelta(request_id=request_id, seq=1, text=" there was", token_ids=[1576, 4996]),
        ApiFinished(
            request_id=request_id,
            seq=3,
            text=" a tiny engine.",
            finish_reason="length",
            usage=usage,
        ),
        ApiError(
            request_id=request_id,
            code=400,
            error_type="invalid_request_error",
            message="max_tokens (9000) is larger than max_model_len (2048)",
            param="max_tokens",
            error_code="invalid_request",
            retry_after_s=2.0,
        ),
        GenerateRequest(
            request_id=request_id,
            model=model,
            prompt_token_ids=[1, 450, 4996, 17354],
            sampling=msgspec.structs.replace(
                sampling, structured=StructuredOutput(choice=["yes", "no"])
            ),
            sla=sla,
            attempt=1,
            worker_id=worker_id,
            affinity="9f2c41d07a5b4e1c",
            replayed_output_tokens=2,
            numerics="cuda/bfloat16/int8/fp8",
            kv_source=KvSource(
                worker_id="worker-node-3-7",
                address="10.0.0.3:40123",
                grant_id="5c" * 16,
                token="a7" * 32,
                block_hashes=[4011226427183372811, 772199912007465535],
                prefill=True,
            ),
            placed_by="scheduler-0/5e1f09a2",
            placement_seq=4182,
        ),
        Accepted(
            request_id=request_id, worker_id=worker_id, seq=0, numerics="cuda/bfloat16/int8/fp8"
        ),
        PromptLogprobs(request_id=request_id, seq=1, start=1, logprobs=logprobs, ranks=[1, 7]),
        Tokens(request_id=request_id, seq=1, token_ids=[1576, 4996], logprobs=logprobs),
        StreamBatch(
            events=[
                StreamedEvent(
                    "Qm9vdHN0cmFwcGVkLWF0dA",
                    Tokens(request_id=request_id, seq=2, token_ids=[11], logprobs=logprobs[:1]),
                ),
                StreamedEvent(
                    "c2Vjb25kLWF0dGVtcHQtYQ", Accepted(request_id="cmpl-2", worker_id=worker_id)
                ),
            ]
        ),
        Finished(
            request_id=request_id,
            seq=3,
            finish_reason="stop",
            usage=usage,
            token_ids=[2],
            logprobs=logprobs[:1],
            timings=timings,
        ),
        Rejected(
            request_id=request_id,
            reason="invalid_request",
            message="max_tokens (9000) is larger than max_model_len (2048)",
            retryable=False,
            param="max_tokens",
            retry_after_s=3.0,
            worker_id=worker_id,
        ),
        Queued(request_id=request_id, position=4, max_wait_s=30.0),
        Failed(
            request_id=request_id,
            seq=2,
            message=f"worker {worker_id} stopped sending heartbeats",
            retryable=True,
            tokens_sent=True,
            reason="deadline_exceeded",
        ),
        Cancel(request_id=request_id),
        Drain(move=True),
        Resume(),
        Cordon(),
        Uncordon(),
        ResetPrefixCache(),
        Ping(),
        LoadLora(name="sql", path="/adapters/sql"),
        UnloadLora(name="sql"),
        LoraAck(
            worker_id=worker_id,
            ok=False,
            error="invalid",
            message="/adapters/sql/adapter_config.json: not found",
        ),
        ControlAck(
            worker_id=worker_id,
            ok=True,
            state="draining",
            message="3 requests in flight",
            cordoned=True,
        ),
        BadMessage(
            subject="lamina.v1.sched.submit", error="Object missing required field `request_id`"
        ),
        BlockStored(event_id=41, parent_hash=0, block_hashes=hashes, medium=Medium.HOST),
        BlockRemoved(event_id=42, block_hashes=hashes[2:], medium=Medium.HOST),
        AllBlocksCleared(event_id=43),
        KvEventBatch(
            worker_id=worker_id,
            block_size=16,
            events=[
                BlockStored(event_id=41, parent_hash=hashes[0], block_hashes=hashes[1:]),
                BlockRemoved(event_id=42, block_hashes=hashes[2:]),
                AllBlocksCleared(event_id=43),
            ],
            incarnation="5c1e0a9b7d3f4e21",
        ),
        KvSyncRequest(),
        KvSnapshot(
            worker_id=worker_id,
            incarnation="5c1e0a9b7d3f4e21",
            block_size=16,
            next_event_id=44,
            block_hashes=hashes,
            part=1,
            last=False,
            host_block_hashes=hashes[1:],
            disk_block_hashes=hashes[2:],
        ),
        RequestRecord(
            request_id=request_id,
            model=model,
            worker_id=worker_id,
            outcome="finished",
            finish_reason="stop",
            prompt_tokens=42,
            completion_tokens=3,
            cached_tokens=32,
            ttft_s=0.0825,
            e2e_s=0.131,
            inter_token_s=[0.0241, 0.0244],
            attempts=3,
            moves=1,
            inexact_moves=1,
            accept_s=0.0041,
            max_tokens=64,
            n=2,
            timings=timings,
        ),
        PlacementRecord(
            request_id=request_id,
            worker_id=worker_id,
            reason="placed",
            candidates=3,
            score=0.8125,
            prefix_hit_blocks=2,
            attempt=1,
            scheduler_id="sched-node-1-311",
            policy="kv",
            prompt_tokens=40,
            predicted_ttft_s=0.8125,
            scored=[
                ScoredWorker(
                    worker_id=worker_id,
                    overlap_blocks=2,
                    predicted_ttft_s=0.8125,
                    kv_usage=0.1,
                    num_running=12,
                    host_blocks=1,
                    disk_blocks=1,
                    fetch_from="worker-node-3-7",
                    fetch_blocks=2,
                    prefill=True,
                )
            ],
            timestamp_ms=1767225600600,
            decision_s=0.00018,
            queued_s=0.25,
            queue_depth=7,
            placed_by="scheduler-0/5e1f09a2",
            placement_seq=4182,
        ),
        stats,
        ClusterStatusRequest(),
        GatewayAlive(
            gateway_id="gw-node-2-88",
            inbox_prefix="_INBOX.aB3dE5",
            interval_s=2.0,
            stream_batches=True,
        ),
        WorkerView(stats=stats, alive=True, last_seen_ms=1767225600750, quarantined=True),
        ClusterStatus(
            scheduler_id="sched-a-311",
            workers=[
                WorkerView(stats=stats, alive=True, last_seen_ms=1767225600750, quarantined=True)
            ],
            queued=2,
            queued_tokens=640,
        ),
        ServiceStarted(service="worker", instance=worker_id, restarts=2),
        BusHealth(
            service="gateway",
            instance="gw-node-2-88",
            errors=1,
            disconnects=2,
            reconnects=2,
            refused=3,
        ),
        KvGrant(
            grant_id="5c" * 16,
            token="a7" * 32,
            receiver=worker_id,
            block_hashes=[4011226427183372811, 772199912007465535],
            prefill_token_ids=list(range(1000, 1032)),
        ),
        RanksRequest(stage=1),
        RankRendezvous(
            worker_id=worker_id,
            incarnation="5c1e0a9b7d3f4e21",
            ready=True,
            message="joining pipeline stage 1 of 2",
            store="tcp://10.0.0.1:41234",
            host="10.0.0.1",
            port=41235,
            key="9f" * 32,
            digest="3b" * 32,
            timeout_s=30.0,
            engine={"model": "/models/lamina-small", "pipeline_parallel_size": 2},
        ),
    ]
    return {type(instance).__name__: instance for instance in instances}


def encode_golden(message: Any) -> bytes:
    """The checked-in form: msgspec's JSON, indented, with a final newline."""
    return msgspec.json.format(msgspec.json.encode(message), indent=2) + b"\n"


def write_goldens() -> None:
    """Write ``golden/<Type>.json`` for every v1 type (only under ``LAMINA_WRITE_GOLDEN=1``)."""
    instances = golden_instances()
    missing = sorted({t.__name__ for t in TYPES} - instances.keys())
    if missing:
        raise RuntimeError(f"add an instance of {missing} to golden_instances() in {__file__}")
    GOLDEN_DIR.mkdir(exist_ok=True)
    for name, instance in instances.items():
        (GOLDEN_DIR / f"{name}.json").write_bytes(encode_golden(instance))


@pytest.fixture(scope="module", autouse=True)
def _write_goldens_when_asked() -> None:
    if os.environ.get(WRITE_GOLDEN_ENV) == "1":
        write_goldens()


def golden_path(message_type: type) -> Path:
    path = GOLDEN_DIR / f"{message_type.__name__}.json"
    if not path.exists():
        pytest.fail(
            f"no golden payload for v1 type {message_type.__name__}: add an instance to "
            f"golden_instances() and run `{WRITE_GOLDEN_ENV}=1 pytest tests/schemas`"
        )
    return path


def unset_fields(value: Any, where: str) -> list[str]:
    """Paths of fields in ``value`` (recursively) that do not reach the wire with data."""
    if isinstance(value, list | tuple):
        return [p for i, item in enumerate(value) for p in unset_fields(item, f"{where}[{i}]")]
    if not isinstance(value, msgspec.Struct):
        return []
    found = []
    omits_defaults = value.__struct_config__.omit_defaults
    # A constraint holds exactly one kind: the others are unset by design (the golden
    # instances carry different kinds).
    one_of: set[str] = set()
    if isinstance(value, StructuredOutput):
        one_of = set(CONSTRAINT_KINDS) - set(value.kinds)
        if not {"json", "json_object"} & set(value.kinds):
            one_of.add("disable_any_whitespace")  # a JSON option
    for field in msgspec.structs.fields(value):
        if field.name in one_of:
            continue
        item, path = getattr(value, field.name), f"{where}.{field.name}"
        omitted = (
            omits_defaults and field.default is not msgspec.NODEFAULT and item == field.default
        )
        if item is None or item == [] or omitted:
            found.append(path)
        found += unset_fields(item, path)
    return found


@pytest.mark.parametrize("message_type", TYPES, ids=TYPE_IDS)
def test_every_type_has_a_golden_payload(message_type: type) -> None:
    assert golden_path(message_type).stat().st_size > 0


def test_no_golden_payload_for_a_type_that_is_gone() -> None:
    stray = sorted({p.stem for p in GOLDEN_DIR.glob("*.json")} - set(TYPE_IDS))
    assert not stray, f"golden payloads for types no longer in v1 (a breaking change): {stray}"


@pytest.mark.parametrize("message_type", TYPES, ids=TYPE_IDS)
def test_golden_payload_round_trips_byte_for_byte(message_type: type) -> None:
    payload = golden_path(message_type).read_bytes()
    decoded = decoder(message_type).decode(payload)
    assert encode_golden(decoded) == payload


@pytest.mark.parametrize("message_type", TYPES, ids=TYPE_IDS)
def test_golden_payload_sets_every_field(message_type: type) -> None:
    decoded = decoder(message_type).decode(golden_path(message_type).read_bytes())
    assert unset_fields(decoded, message_type.__name__) == []


def test_golden_instances_match_the_checked_in_payloads() -> None:
    """The in-code instances are what the files hold (so regenerating changes nothing
    unless the schema changed)."""
    for name, instance in golden_instances().items():
        assert (GOLDEN_DIR / f"{name}.json").read_bytes() == encode_golden(instance), name


# --- the old peer: frozen copies of v1 as released ----------------------------------------


def as_json(message: Any) -> Any:
    """``message`` as the untyped JSON value it encodes to."""
    return msgspec.json.decode(msgspec.json.encode(message))


def is_subset(old: Any, new: Any) -> bool:
    """``new`` holds everything ``old`` does (objects may have gained keys)."""
    if isinstance(old, dict):
        return isinstance(new, dict) and all(
            k in new and is_subset(v, new[k]) for k, v in old.items()
        )
    if isinstance(old, list):
        return (
            isinstance(new, list)
            and len(old) <= len(new)
            and all(is_subset(o, n) for o, n in zip(old, new, strict=False))
        )
    return old == new and type(old) is type(new)


def test_every_type_has_a_frozen_copy_and_every_frozen_type_still_exists() -> None:
    assert sorted(FROZEN) == TYPE_IDS, (
        "frozen_v1.py must hold a copy of every v1 type as released: copy a new type there "
        "when it is added; a type that disappeared from v1 is a breaking change"
    )


@pytest.mark.parametrize("message_type", TYPES, ids=TYPE_IDS)
def test_todays_payload_decodes_with_the_frozen_copy(message_type: type) -> None:
    today = msgspec.json.encode(
        decoder(message_type).decode(golden_path(message_type).read_bytes())
    )
    old_view = msgspec.json.decode(today, type=FROZEN[message_type.__name__])
    assert is_subset(as_json(old_view), msgspec.json.decode(today))


@pytest.mark.parametrize("message_type", TYPES, ids=TYPE_IDS)
def test_old_payload_decodes_with_todays_type(message_type: type) -> None:
    old_type = FROZEN[message_type.__name__]
    old_payload = msgspec.json.encode(
        msgspec.json.decode(golden_path(message_type).read_bytes(), type=old_type)
    )
    decoded = decoder(message_type).decode(old_payload)
    assert is_subset(msgspec.json.decode(old_payload), as_json(decoded))


def _without_docs(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_docs(v) for k, v in node.items() if k not in ("title", "description")}
    if isinstance(node, list):
        return [_without_docs(v) for v in node]
    return node


def _fields(schema: dict, members: str) -> list[tuple[str, Any]]:
    """(label, schema) per field: object properties by name, array_like items by index."""
    if members == "prefixItems":
        return [(f"[{i}]", item) for i, item in enumerate(schema.get(members, []))]
    return list(schema.get(members, {}).items())


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "maxLength")


def _refines(old: Any, new: Any, new_defs: dict) -> bool:
    """Whether field schema ``new`` is ``old`` or one of the two refinements the rules
    allow (``schemas/README.md``): value bounds added to a number or a string's length
    (validation moved into the decoder), or a string made an open enum (``OpenEnum``:
    unknown values decode as ``unknown``, so no payload an old peer sends is refused for
    it)."""
    if old == new:
        return True
    if isinstance(old, dict) and isinstance(new, dict):
        ref = new.get("$ref", "").removeprefix("#/$defs/")
        if "default" in old and old["default"] == new.get("default"):  # a default kept
            old = {k: v for k, v in old.items() if k != "default"}
            new = {k: v for k, v in new.items() if k != "default"}
        if old == {"type": "string"} and ref:
            values = new_defs[ref].get("enum", [])
            return bool(values) and "unknown" in values and all(isinstance(v, str) for v in values)
        old, new = _tightened(old, new)
        if old.keys() - new.keys():
            return False
        added = new.keys() - old.keys()
        return all(k in _BOUNDS for k in added) and all(
            _refines(v, new[k], new_defs) for k, v in old.items()
        )
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return all(_refines(o, n, new_defs) for o, n in zip(old, new, strict=True))
    return False


def _tightened(old: dict, new: dict) -> tuple[dict, dict]:
    """``old`` and ``new`` with a bound that ``new`` replaced by a tighter one of the other
    kind taken out of both (``exclusiveMinimum: 0`` -> ``minimum: 1e-6``): a value bound
    made stricter is a bound added, not a retype."""
    old, new = dict(old), dict(new)
    for exclusive, inclusive, tighter in (
        ("exclusiveMinimum", "minimum", lambda o, n: n > o),
        ("exclusiveMaximum", "maximum", lambda o, n: n < o),
    ):
        replaced = exclusive in old and exclusive not in new and inclusive in new
        if replaced and tighter(old[exclusive], new[inclusive]):
            del old[exclusive], new[inclusive]
    return old, new


def _extension_problems(name: str, old: dict, new: dict, new_defs: dict) -> list[str]:
    """Why the schema ``new`` is not ``old`` plus trailing fields with defaults."""
    if old.get("type") == "object":
        members, required = "properties", "required"
    elif old.get("type") == "array" and "prefixItems" in old:  # an array_like struct
        members, required = "prefixItems", "minItems"
    else:
        return [] if old == new else [f"{name}: changed from {old} to {new}"]
    old_fields, new_fields = _fields(old, members), _fields(new, members)
    problems = []
    for i, (label, schema) in enumerate(old_fields):
        if i >= len(new_fields):
            problems.append(f"{name}.{label}: removed")
        elif new_fields[i][0] != label:
            problems.append(f"{name}: field {i} was {label!r}, now {new_fields[i][0]!r}")
        elif not _refines(schema, new_fields[i][1], new_defs):
            problems.append(
                f"{name}.{label}: retyped or default changed: {schema} -> {new_fields[i][1]}"
            )
    if old.get(required) != new.get(required):
        problems.append(
            f"{name}: required fields changed from {old.get(required)} to {new.get(required)}"
            " (a new field needs a default; a released one keeps its own)"
        )
    rest_old = {k: v for k, v in old.items() if k not in (members, required)}
    rest_new = {k: v for k, v in new.items() if k not in (members, required)}
    if rest_old != rest_new:
        problems.append(f"{name}: struct options changed from {rest_old} to {rest_new}")
    return problems


def test_todays_schema_only_appends_fields_with_defaults_to_the_released_one() -> None:
    """Names, tags, order, types and defaults of released fields never change; new fields
    go last with defaults; nested structs follow the same rules."""
    _, old_defs = msgspec.json.schema_components(list(FROZEN.values()))
    _, new_defs = msgspec.json.schema_components(TYPES)
    old_defs, new_defs = _without_docs(old_defs), _without_docs(new_defs)
    problems = [f"{name}: gone (a breaking change)" for name in old_defs if name not in new_defs]
    for name, old in old_defs.items():
        if name in new_defs:
            problems += _extension_problems(name, old, new_defs[name], new_defs)
    assert not problems, "\n".join(problems)


def test_the_schema_check_allows_only_the_two_refinements() -> None:
    defs = {"Open": {"enum": ["a", "unknown"]}, "Closed": {"enum": ["a", "b"]}}
    number = {"type": "integer", "default": 0}
    assert _refines(number, number | {"minimum": 0, "maximum": 9}, defs)
    assert not _refines(number, number | {"default": 1}, defs)
    assert not _refines(number, {"type": "number", "default": 0}, defs)
    assert not _refines(number | {"minimum": 0}, number, defs)  # a bound may not be dropped
    assert _refines(number | {"exclusiveMinimum": 0}, number | {"minimum": 1e-6}, defs)
    assert not _refines(number | {"exclusiveMinimum": 0}, number | {"minimum": -1}, defs)
    text = {"type": "string"}
    assert _refines(text, text | {"maxLength": 256}, defs)
    assert not _refines(text | {"maxLength": 256}, text, defs)
    assert _refines({"type": "string"}, {"$ref": "#/$defs/Open"}, defs)
    assert not _refines({"type": "string"}, {"$ref": "#/$defs/Closed"}, defs)


OPEN_ENUMS = sorted(OpenEnum.__subclasses__(), key=lambda e: e.__name__)


@pytest.mark.parametrize("enum_type", OPEN_ENUMS, ids=[e.__name__ for e in OPEN_ENUMS])
def test_a_closed_set_decodes_a_newer_peers_value_as_unknown(enum_type: type) -> None:
    """The rule for closed sets: members round-trip; a value this peer does not know is
    ``UNKNOWN``, not a refused message."""
    for member in enum_type:
        assert msgspec.json.decode(msgspec.json.encode(member), type=enum_type) is member
    assert msgspec.json.decode(b'"from-a-newer-peer"', type=enum_type) is enum_type.UNKNOWN


def test_a_message_with_an_unknown_state_still_decodes() -> None:
    payload = msgspec.json.decode(golden_path(WorkerStats).read_bytes())
    payload["state"] = "hibernating"
    stats = decoder(WorkerStats).decode(msgspec.json.encode(payload))
    assert stats.state is WorkerState.UNKNOWN and stats.worker_id == payload["worker_id"]
    assert OPEN_ENUMS  # the closed sets were found


@pytest.mark.parametrize("message_type", TYPES, ids=TYPE_IDS)
def test_every_type_is_tagged_with_its_class_name(message_type: type) -> None:
    config = message_type.__struct_config__
    assert (config.tag_field, config.tag) == ("type", message_type.__name__)


def test_every_type_is_keyword_only() -> None:
    positional = [
        t.__name__
        for t in TYPES
        if any(
            p.kind is not inspect.Parameter.KEYWORD_ONLY
            for p in inspect.signature(t).parameters.values()
        )
    ]
    assert not positional, f"v1 types with positional fields: {positional}"


# --- msgspec's evolution rules, shown on a small message ----------------------------------


class _Base(msgspec.Struct, tag_field="type", tag=lambda name: name):
    """Like ``Message``. Tags are inherited; ``kw_only`` is not (it covers only the fields
    of the class that sets it), so each version below sets it itself."""


class PingV1(_Base, tag="Ping", kw_only=True):
    request_id: str
    seq: int = 0


class PingV2(_Base, tag="Ping", kw_only=True):
    """A later release: one new field, with a default, after the released ones."""

    request_id: str
    seq: int = 0
    priority: int = 5


class PingRetyped(_Base, tag="Ping", kw_only=True):
    request_id: int
    seq: int = 0


class PingNewRequired(_Base, tag="Ping", kw_only=True):
    request_id: str
    seq: int = 0
    priority: int


class PingRenamed(_Base, tag="Ping", kw_only=True):
    id: str
    seq: int = 0


class PairV1(msgspec.Struct, array_like=True):
    logprob: float


class PairV2(msgspec.Struct, array_like=True):
    logprob: float
    rank: int = 0


def test_adding_a_field_with_a_default_at_the_end_works_both_ways() -> None:
    old = msgspec.json.encode(PingV1(request_id="r1", seq=3))
    assert msgspec.json.decode(old, type=PingV2) == PingV2(request_id="r1", seq=3, priority=5)
    new = msgspec.json.encode(PingV2(request_id="r1", seq=3, priority=1))
    assert msgspec.json.decode(new, type=PingV1) == PingV1(request_id="r1", seq=3)
    # array_like structs (positional on the wire) evolve the same way, by appending.
    assert msgspec.json.decode(msgspec.json.encode(PairV1(-0.5)), type=PairV2) == PairV2(-0.5)
    assert msgspec.json.decode(msgspec.json.encode(PairV2(-0.5, 2)), type=PairV1) == PairV1(-0.5)


@pytest.mark.parametrize(
    ("old_type", "new_type"),
    [
        (PingV1, PingRetyped),
        (PingRetyped, PingV1),
        (PingV1, PingNewRequired),
        (PingV1, PingRenamed),
    ],
    ids=["retyped-old-to-new", "retyped-new-to-old", "new-field-without-default", "renamed"],
)
def test_breaking_changes_fail_to_decode(old_type: type, new_type: type) -> None:
    sample = {PingV1: PingV1(request_id="r1"), PingRetyped: PingRetyped(request_id=7)}[old_type]
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(sample), type=new_type)


# --- what the bus relies on: bad payloads raise, never half-decode -----------------------


@pytest.mark.parametrize(
    ("message_type", "payload", "error"),
    [
        (StreamEvent, b"\x00\x01 not json", msgspec.DecodeError),
        (StreamEvent, b'{"type": "Tokens", "request_id": "r1", "seq": 0', msgspec.DecodeError),
        (StreamEvent, b'{"type": "NoSuchEvent", "request_id": "r1"}', msgspec.ValidationError),
        (StreamEvent, b'{"request_id": "r1", "seq": 0, "token_ids": []}', msgspec.ValidationError),
        (GenerateRequest, b'{"type": "GenerateRequest", "model": "m"}', msgspec.ValidationError),
        (GenerateRequest, b'{"type": "Cancel", "request_id": "r1"}', msgspec.ValidationError),
        (
            ApiEvent,
            b'{"type": "ApiDelta", "request_id": "r", "seq": "1", "text": "", "token_ids": []}',
            msgspec.ValidationError,
        ),
        (ControlCommand, b"[]", msgspec.ValidationError),
        (LoraCommand, b'{"type": "LoadLora", "name": "x"}', msgspec.ValidationError),
        (
            KvEventBatch,
            b'{"type": "KvEventBatch", "worker_id": "w", "block_size": 16, '
            b'"events": [{"type": "BlockStored", "event_id": 1}]}',
            msgspec.ValidationError,
        ),
    ],
    ids=[
        "not-json",
        "truncated",
        "unknown-tag",
        "no-tag",
        "missing-field",
        "wrong-type-tag",
        "wrong-field-type",
        "not-an-object",
        "lora-load-without-path",
        "nested-missing-field",
    ],
)
def test_undecodable_payload_raises(message_type: Any, payload: bytes, error: type) -> None:
    assert issubclass(msgspec.ValidationError, msgspec.DecodeError)  # the bus catches this
    with pytest.raises(error):
        decoder(message_type).decode(payload)
