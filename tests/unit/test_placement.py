"""Scheduler registry and placement: pure, with exact outcomes."""

from __future__ import annotations

import msgspec
import pytest

from lamina.libs.block_hash import ROOT_HASH, root_hash
from lamina.schemas.v1.generate import GenerateRequest, RejectReason, Sampling
from lamina.schemas.v1.records import PlacementRecord
from lamina.schemas.v1.stats import WorkerState, WorkerStats
from lamina.services.scheduler.placement import (
    REQUEST_WEIGHT_TOKENS,
    CostModel,
    Placer,
    Policy,
    decode_tokens_per_step,
    drain_time,
    kv_block_bytes,
    retry_after,
)
from lamina.services.scheduler.registry import PENDING_MAX_AGE_S, Candidate, Registry
from tests.telemetry.helpers import make_stats


def stats(worker_id: str, **kw) -> WorkerStats:
    """An idle worker serving model ``m`` with a 1024-token context, plus ``kw``."""
    idle = dict(
        model="m", num_running=0, num_waiting=0, num_queued_prefill_tokens=0, max_model_len=1024
    )
    return make_stats(worker_id, **(idle | kw))


def request(prompt_len: int = 10, max_tokens: int = 10, model: str = "m") -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        model=model,
        prompt_token_ids=[1] * prompt_len,
        sampling=Sampling(max_tokens=max_tokens),
    )


def no_overlap(
    prompt: list[int], workers: list[str], root: int = ROOT_HASH
) -> dict[str, tuple[int, int, int]]:
    return dict.fromkeys(workers, (0, 0, 0))


def place(submitted: GenerateRequest, live: list, policy: Policy = Policy.LOAD):
    return Placer(policy).place(submitted, live, no_overlap)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def registry_at(clock: Clock) -> Registry:
    return Registry(clock=clock)


def test_worker_is_dead_after_three_missed_heartbeats():
    clock = Clock()
    registry = registry_at(clock)
    clock.now = 10.0
    registry.heartbeat(stats("a"))
    clock.now = 11.5
    assert [w.stats.worker_id for w in registry.candidates()] == ["a"]
    clock.now = 11.51
    assert registry.candidates() == []
    clock.now = 12.0
    registry.heartbeat(stats("a"))
    clock.now = 12.1
    assert len(registry.candidates()) == 1


def test_least_queued_work_wins_and_pending_placements_count():
    clock = Clock()
    registry = registry_at(clock)
    registry.heartbeat(stats("busy", num_queued_prefill_tokens=500))
    registry.heartbeat(stats("idle"))
    registry.heartbeat(stats("loaded", num_running=10))
    clock.now = 0.1
    decision = place(request(), registry.candidates())
    assert (decision.worker_id, decision.reason, decision.candidates) == ("idle", None, 3)
    # Placed work counts until the next heartbeat, so a burst spreads out.
    for _ in range(10):
        registry.placed("idle", 10)
    assert place(request(), registry.candidates()).worker_id == "busy"
    assert 10 * REQUEST_WEIGHT_TOKENS > 500  # why "loaded" lost to "busy" above
    clock.now = 0.2
    registry.heartbeat(stats("idle"))  # a heartbeat supersedes the estimate
    clock.now = 0.3
    assert place(request(), registry.candidates()).worker_id == "idle"


def test_rejections_are_typed():
    registry = registry_at(Clock())
    assert place(request(), []).reason == RejectReason.NO_WORKER
    registry.heartbeat(stats("a"))
    wrong = place(request(model="other"), registry.candidates())
    assert (wrong.reason, wrong.retryable) == (RejectReason.MODEL_NOT_FOUND, False)
    too_long = place(request(prompt_len=1000, max_tokens=100), registry.candidates())
    assert (too_long.reason, too_long.retryable) == (RejectReason.INVALID_REQUEST, False)
    assert "maximum context length is 1024" in too_long.message
    registry.heartbeat(stats("a", state=WorkerState.DRAINING))
    draining = place(request(), registry.candidates())
    assert (draining.reason, draining.retryable) == (RejectReason.NO_WORKER, True)
    registry.heartbeat(stats("b", state=WorkerState.STARTING))  # loading its model
    waiting = place(request(), registry.candidates())
    assert (waiting.worker_id, waiting.reason, waiting.retryable) == (
        None,
        RejectReason.NO_WORKER,
        True,
    )
    assert "draining, starting" in waiting.message
    registry.heartbeat(stats("c", state=WorkerState.FAILED))
    registry.heartbeat(stats("d", state=WorkerState.UNKNOWN))  # from a newer worker
    assert place(request(), registry.candidates()).worker_id is None


def test_the_predicted_ttft_by_the_numbers():
    cost = CostModel(prefill_rate_prior=1000.0, decode_rate_prior=100.0, decode_weight=1.0)
    busy = Candidate(
        stats(
            "w",
            num_queued_prefill_tokens=300,
            num_running=4,
            prefill_tokens_per_s=2000.0,
            decode_tokens_per_s=50.0,
        ),
        pending=1,
        pending_tokens=100,
        queued_tokens=400.0,  # its 300 queued plus the 100 placed since
    )
    # (400 queued + 600 uncached) / 2000 + 4 running / 50
    assert cost.predict_ttft(busy, 600) == pytest.approx(0.5 + 0.08)
    fresh = Candidate(stats("f", prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0))
    assert cost.predict_ttft(fresh, 500) == pytest.approx(0.5)  # the priors, nothing running
    # A worker that has measured nothing looks like its peers, not like the prior.
    assert cost.peer_rates([busy, fresh]) == (2000.0, 50.0)
    assert cost.peer_rates([fresh]) == (1000.0, 100.0)
    assert cost.predict_ttft(fresh, 500, cost.peer_rates([busy, fresh])) == pytest.approx(0.25)
    # Speculating: 1,000 tokens out, 600 drafted, 400 of them accepted: 600 steps of a
    # sequence, each computing 1 + 600 / 600 tokens, so each step takes twice as long.
    drafting = Candidate(
        stats(
            "s",
            num_queued_prefill_tokens=300,
            num_running=4,
            prefill_tokens_per_s=2000.0,
            decode_tokens_per_s=50.0,
            generation_tokens_total=1000,
            spec_decode_num_draft_tokens=600,
            spec_decode_num_accepted_tokens=400,
        ),
        queued_tokens=400.0,
    )
    assert decode_tokens_per_step(drafting.stats) == pytest.approx(2.0)
    assert decode_tokens_per_step(busy.stats) == 1.0
    assert cost.predict_ttft(drafting, 600) == pytest.approx(0.5 + 0.16)
    # The engine always computes the last prompt token, however much is cached.
    assert cost.uncached_tokens(64, overlap_blocks=4, block_size=16) == 1
    assert cost.uncached_tokens(100, overlap_blocks=2, block_size=16) == 68


def overlap_of(
    hits: dict[str, int], host: dict[str, int] | None = None, disk: dict[str, int] | None = None
):
    """Cached leading blocks per worker (``host``: of which its host tier holds and its
    device does not; ``disk``: of which only its disk tier holds)."""
    host, disk = host or {}, disk or {}
    return lambda prompt, workers, root=ROOT_HASH: {
        w: (hits.get(w, 0), host.get(w, 0), disk.get(w, 0)) for w in workers
    }


def test_kv_placement_goes_where_the_prefix_is_cached_unless_the_queue_costs_more():
    clock = Clock()
    registry = registry_at(clock)
    registry.heartbeat(stats("cached", num_queued_prefill_tokens=200, prefill_tokens_per_s=1000.0))
    registry.heartbeat(stats("cold", prefill_tokens_per_s=1000.0))
    long_prompt = request(prompt_len=800)
    placer = Placer(Policy.KV)
    # 48 cached blocks of 16 = 768 tokens: (200 + 32) / 1000 beats (0 + 800) / 1000.
    decision = placer.place(long_prompt, registry.candidates(), overlap_of({"cached": 48}))
    assert (decision.worker_id, decision.prefix_hit_blocks) == ("cached", 48)
    assert decision.predicted_ttft_s == pytest.approx(0.232)
    assert {s.worker_id: s.overlap_blocks for s in decision.scored} == {"cached": 48, "cold": 0}
    # A deep enough queue makes the cold worker faster after all.
    registry.heartbeat(stats("cached", num_queued_prefill_tokens=900, prefill_tokens_per_s=1000.0))
    decision = placer.place(long_prompt, registry.candidates(), overlap_of({"cached": 48}))
    assert decision.worker_id == "cold"
    # Load-blind policies ignore the cache.
    registry.heartbeat(stats("cached", num_queued_prefill_tokens=200, prefill_tokens_per_s=1000.0))
    load = Placer(Policy.LOAD).place(long_prompt, registry.candidates(), overlap_of({"cached": 48}))
    assert load.worker_id == "cold"


def test_a_host_tier_hit_costs_its_measured_load_time_between_a_device_hit_and_none():
    registry = registry_at(Clock())
    fast = dict(prefill_tokens_per_s=1000.0, total_kv_blocks=1000, free_kv_blocks=1000)
    registry.heartbeat(stats("device", **fast))
    registry.heartbeat(stats("host", host_kv_load_blocks_per_s=400.0, **fast))
    registry.heartbeat(stats("cold", **fast))
    placer = Placer(Policy.KV, CostModel(decode_weight=0.0))
    cached = overlap_of({"device": 48, "host": 48}, host={"host": 48})
    decision = placer.place(request(prompt_len=800), registry.candidates(), cached)
    scored = {s.worker_id: s for s in decision.scored}
    assert decision.worker_id == "device"
    # 32 uncached tokens at 1000/s; the host tier's 48 blocks at 400/s on top; 800 cold.
    assert scored["device"].predicted_ttft_s == pytest.approx(0.032)
    assert scored["host"].predicted_ttft_s == pytest.approx(0.032 + 48 / 400)
    assert scored["cold"].predicted_ttft_s == pytest.approx(0.8)
    assert (scored["host"].host_blocks, scored["device"].host_blocks) == (48, 0)
    # Its loads take device blocks too.
    assert scored["host"].kv_usage == pytest.approx(scored["device"].kv_usage + 48 / 1000)
    # Without the device worker, the host tier's hit beats computing the prompt.
    registry.heartbeat(stats("device", state="draining", **fast))
    assert placer.place(request(prompt_len=800), registry.candidates(), cached).worker_id == "host"


def test_a_disk_tier_hit_costs_more_than_a_host_tier_hit_and_less_than_none():
    registry = registry_at(Clock())
    fast = dict(prefill_tokens_per_s=1000.0, total_kv_blocks=1000, free_kv_blocks=1000)
    registry.heartbeat(stats("host", host_kv_load_blocks_per_s=400.0, **fast))
    registry.heartbeat(stats("disk", disk_kv_load_blocks_per_s=100.0, **fast))
    registry.heartbeat(stats("both", **fast))  # not measured yet: the priors
    registry.heartbeat(stats("cold", **fast))
    cost = CostModel(decode_weight=0.0)
    placer = Placer(Policy.KV, cost)
    cached = overlap_of(
        {"host": 48, "disk": 48, "both": 48},
        host={"host": 48, "both": 16},
        disk={"disk": 48, "both": 32},
    )
    decision = placer.place(request(prompt_len=800), registry.candidates(), cached)
    scored = {s.worker_id: s for s in decision.scored}
    assert scored["host"].predicted_ttft_s == pytest.approx(0.032 + 48 / 400)
    assert scored["disk"].predicted_ttft_s == pytest.approx(0.032 + 48 / 100)
    both = 0.032 + 16 / cost.host_load_rate_prior + 32 / cost.disk_load_rate_prior
    assert scored["both"].predicted_ttft_s == pytest.approx(both)
    assert scored["cold"].predicted_ttft_s == pytest.approx(0.8)
    assert (scored["disk"].host_blocks, scored["disk"].disk_blocks) == (0, 48)
    assert (scored["both"].host_blocks, scored["both"].disk_blocks) == (16, 32)
    assert decision.worker_id == "both"
    registry.heartbeat(stats("both", state="draining", **fast))
    assert placer.place(request(prompt_len=800), registry.candidates(), cached).worker_id == "host"


def test_a_worker_fetches_a_prefix_another_holds_when_that_beats_computing_it():
    """The holder of a prompt's prefix is draining (or busy): the worker placed fetches
    the blocks from it when F / R_x beats computing them, and the decision names the
    sender; a worker of another KV layout, or a transfer dearer than computing, does not."""
    registry = registry_at(Clock())
    kv = dict(kv_layout="16/float32/2/4/8", kv_address="127.0.0.1:4000")
    fast = dict(prefill_tokens_per_s=1000.0, total_kv_blocks=1000, free_kv_blocks=1000)
    registry.heartbeat(stats("holder", state="draining", **fast, **kv))
    registry.heartbeat(stats("cold", kv_fetch_blocks_per_s=2000.0, **fast, **kv))
    placer = Placer(Policy.KV, CostModel(decode_weight=0.0))
    cached = overlap_of({"holder": 48})
    decision = placer.place(request(prompt_len=800), registry.candidates(), cached)
    (cold,) = decision.scored
    assert (decision.worker_id, decision.fetch_from, decision.fetch_blocks) == (
        "cold",
        "holder",
        48,
    )
    # 32 tokens computed at 1000/s, 48 blocks fetched at 2000/s: not 800 tokens computed.
    assert cold.predicted_ttft_s == pytest.approx(0.032 + 48 / 2000)
    assert (cold.fetch_from, cold.fetch_blocks, cold.overlap_blocks) == ("holder", 48, 0)
    assert cold.kv_usage == pytest.approx(50 / 1000)  # 48 fetched and 2 computed blocks
    # Blocks in the holder's host tier are sent as well (its export reads the tier).
    in_tier = overlap_of({"holder": 48}, host={"holder": 48})
    assert placer.place(request(prompt_len=800), registry.candidates(), in_tier).fetch_blocks == 48
    # A transfer slower than computing: none.
    registry.heartbeat(stats("cold", kv_fetch_blocks_per_s=50.0, **fast, **kv))
    slow = placer.place(request(prompt_len=800), registry.candidates(), cached)
    assert (slow.worker_id, slow.fetch_from, slow.fetch_blocks) == ("cold", "", 0)
    # Another layout (here a KV cache of another dtype), or a holder that sends nothing.
    other = dict(kv, kv_layout="16/int8/2/4/8")
    registry.heartbeat(stats("cold", kv_fetch_blocks_per_s=2000.0, **fast, **other))
    assert placer.place(request(prompt_len=800), registry.candidates(), cached).fetch_from == ""
    registry.heartbeat(stats("cold", kv_fetch_blocks_per_s=2000.0, **fast, **kv))
    registry.heartbeat(stats("holder", state="draining", **fast, kv_layout=kv["kv_layout"]))
    assert placer.place(request(prompt_len=800), registry.candidates(), cached).fetch_from == ""
    # A worker that holds the prefix itself computes nothing and fetches nothing.
    registry.heartbeat(stats("holder", **fast, **kv))
    here = placer.place(request(prompt_len=800), registry.candidates(), cached)
    assert (here.worker_id, here.fetch_from) == ("holder", "")


def test_a_request_naming_an_adapter_goes_to_a_worker_holding_it():
    """A LoRA adapter is a model of its own to placement: only workers that hold it are
    candidates, its prefix is looked up under the adapter's hash root, and it gets no
    prefill leg or fetch (those carry the base model's KV)."""
    registry = registry_at(Clock())
    kv = dict(kv_layout="16/float32/2/4/8", kv_address="127.0.0.1:4000", role="decode")
    fast = dict(prefill_tokens_per_s=1000.0, total_kv_blocks=1000, free_kv_blocks=1000)
    registry.heartbeat(stats("plain", **fast, **kv))
    registry.heartbeat(stats("p", **dict(kv, role="prefill"), **fast))
    registry.heartbeat(stats("lora", lora_adapters=["sql"], max_loras=1, **fast, **kv))
    roots = []

    def overlap(prompt, workers, root=ROOT_HASH):
        roots.append(root)
        return dict.fromkeys(workers, (16, 0, 0))

    placer = Placer(Policy.KV, prefill_min_tokens=256)
    decision = placer.place(request(prompt_len=801, model="sql"), registry.candidates(), overlap)
    assert (decision.worker_id, decision.fetch_from, decision.prefill) == ("lora", "", False)
    assert [s.worker_id for s in decision.scored] == ["lora"]
    assert roots == [root_hash("sql")] and root_hash("sql") != ROOT_HASH
    base = placer.place(request(prompt_len=801), registry.candidates(), overlap)
    assert base.prefill and roots[-1] == ROOT_HASH  # the base model's requests: as before
    unknown = place(request(model="chat"), registry.candidates())
    assert unknown.reason == RejectReason.MODEL_NOT_FOUND
    assert "['m', 'sql']" in unknown.message
    # LoRA affinity: of two holders, the one whose slots can take it now; when neither
    # can, both stay candidates.
    full, one = dict(max_loras=1, **fast, **kv), ["sql"]
    registry.heartbeat(stats("full", lora_adapters=one, running_lora_adapters=["x"], **full))
    for _ in range(3):
        decision = placer.place(request(model="sql"), registry.candidates(), overlap)
        assert (decision.worker_id, len(decision.scored)) == ("lora", 1)
    registry.heartbeat(stats("lora", lora_adapters=one, running_lora_adapters=["y"], **full))
    decision = placer.place(request(model="sql"), registry.candidates(), overlap)
    assert sorted(s.worker_id for s in decision.scored) == ["full", "lora"]


def test_a_decode_workers_long_prompt_gets_a_prefill_leg_on_the_prefill_worker_with_room():
    """Disaggregated: requests go to decode workers; a prompt of prefill_min_tokens or more
    uncached there is computed by the prefill worker predicted soonest (its queue, its
    cache), the decode worker fetching its full blocks; the prediction adds both legs. A
    short prompt, a saturated or full prefill worker, or a mixed worker: no leg."""
    registry = registry_at(Clock())
    kv = dict(kv_layout="16/float32/2/4/8", kv_address="127.0.0.1:4000")
    fast = dict(prefill_tokens_per_s=1000.0, total_kv_blocks=1000, free_kv_blocks=1000)
    registry.heartbeat(stats("p0", role="prefill", num_queued_prefill_tokens=300, **fast, **kv))
    registry.heartbeat(stats("p1", role="prefill", **fast, **kv))
    registry.heartbeat(stats("d", role="decode", kv_fetch_blocks_per_s=2000.0, **fast, **kv))
    placer = Placer(Policy.KV, CostModel(decode_weight=0.0), prefill_min_tokens=256)
    cached = overlap_of({"p1": 16})
    decision = placer.place(request(prompt_len=801), registry.candidates(), cached)
    (d,) = decision.scored  # a prefill worker is no candidate while a decode worker is
    assert (decision.worker_id, decision.fetch_from, decision.fetch_blocks) == ("d", "p1", 50)
    assert decision.prefill and d.prefill
    # p1 computes 800 - 256 cached tokens at 1000/s (p0: 300 queued + 800), 50 blocks move
    # at 2000/s, and d computes the last token.
    assert d.predicted_ttft_s == pytest.approx(0.544 + 50 / 2000 + 0.001)
    assert d.kv_usage == pytest.approx(51 / 1000)
    # p1 saturated (or without room for the blocks): p0 computes it.
    registry.heartbeat(stats("p1", role="prefill", num_waiting=256, max_num_seqs=256, **fast, **kv))
    assert placer.place(request(prompt_len=801), registry.candidates(), cached).fetch_from == "p0"
    full = dict(fast, free_kv_blocks=10)
    registry.heartbeat(stats("p1", role="prefill", **full, **kv))
    assert placer.place(request(prompt_len=801), registry.candidates(), cached).fetch_from == "p0"
    # No prefill worker with room: the decode worker computes the prompt itself (it may
    # still fetch what a prefill worker holds already, as any worker may).
    registry.heartbeat(stats("p0", role="prefill", **full, **kv))
    local = placer.place(request(prompt_len=801), registry.candidates(), cached)
    assert (local.worker_id, local.fetch_from, local.fetch_blocks) == ("d", "p1", 16)
    assert not local.prefill
    assert placer.place(request(prompt_len=801), registry.candidates(), no_overlap).fetch_from == ""
    registry.heartbeat(stats("p0", role="prefill", **fast, **kv))
    registry.heartbeat(stats("p1", role="prefill", **fast, **kv))
    # A short prompt is computed where it decodes.
    short = placer.place(request(prompt_len=200), registry.candidates(), no_overlap)
    assert (short.worker_id, short.fetch_from) == ("d", "")
    # A mixed worker computes its own prompts.
    registry.heartbeat(stats("d", kv_fetch_blocks_per_s=2000.0, **fast, **kv))
    assert placer.place(request(prompt_len=801), registry.candidates(), no_overlap).fetch_from == ""
    # Prefill workers alone: they run requests whole.
    registry.heartbeat(stats("d", state="draining", **fast, **kv))
    alone = placer.place(request(prompt_len=801), registry.candidates(), no_overlap)
    assert alone.worker_id in ("p0", "p1") and not alone.prefill


def test_a_worker_that_has_not_fetched_yet_is_given_the_priors_bytes_over_its_blocks():
    assert kv_block_bytes("16/bfloat16/32/8/128") == 2 << 20  # a 7B model's block
    assert kv_block_bytes("16/float32/2/4/8") == 8192 and kv_block_bytes("") == 0
    cost = CostModel(transfer_bytes_prior=1e9)
    fresh = stats("w", kv_layout="16/bfloat16/32/8/128")
    assert cost.transfer_rate(fresh) == pytest.approx(1e9 / (2 << 20))
    measured = stats("w", kv_layout="16/bfloat16/32/8/128", kv_fetch_blocks_per_s=300.0)
    assert cost.transfer_rate(measured) == 300.0


def test_kv_placement_skips_a_worker_without_room_and_breaks_ties_by_load():
    registry = registry_at(Clock())
    registry.heartbeat(stats("full", total_kv_blocks=100, free_kv_blocks=2))
    registry.heartbeat(stats("roomy", total_kv_blocks=100, free_kv_blocks=90, num_running=3))
    registry.heartbeat(stats("roomier", total_kv_blocks=100, free_kv_blocks=95, num_running=3))
    placer = Placer(Policy.KV, CostModel(decode_weight=0.0))
    decision = placer.place(request(prompt_len=64), registry.candidates(), no_overlap)
    # All three predict the same TTFT; "full" has no room for 4 blocks; "roomier" is less
    # loaded after the request.
    assert decision.worker_id == "roomier"
    assert {s.worker_id: s.kv_usage for s in decision.scored} == pytest.approx(
        {"full": 1.02, "roomy": 0.14, "roomier": 0.09}
    )


def test_round_robin_takes_each_ready_worker_in_turn():
    registry = registry_at(Clock())
    for worker in ("a", "b", "c"):
        registry.heartbeat(stats(worker))
    placer = Placer(Policy.ROUND_ROBIN)
    chosen = [
        placer.place(request(), registry.candidates(), no_overlap).worker_id for _ in range(6)
    ]
    assert chosen == ["a", "b", "c", "a", "b", "c"]


def test_another_replicas_placement_counts_until_the_workers_next_heartbeat():
    registry = registry_at(Clock())
    registry.heartbeat(stats("w", timestamp_ms=1_000, block_size=16))
    record = PlacementRecord(
        request_id="r",
        worker_id="w",
        reason="placed",
        candidates=1,
        prefix_hit_blocks=2,
        prompt_tokens=100,
        scheduler_id="other",
        timestamp_ms=1_500,
    )
    registry.placed_by_peer(record)
    (candidate,) = registry.candidates()
    assert (candidate.pending, candidate.pending_tokens) == (1, 100 - 32)
    # An unnumbered record (an older peer's): a heartbeat taken after it includes it, and
    # a record older than the heartbeat is ignored.
    registry.heartbeat(stats("w", timestamp_ms=2_000))
    registry.placed_by_peer(record)
    assert registry.candidates()[0].pending == 0
    # A numbered one counts until a heartbeat reports its number, whatever the clocks.
    numbered = msgspec.structs.replace(record, placed_by="other/1", placement_seq=3)
    registry.heartbeat(stats("w", timestamp_ms=2_500, placements_seen={}))
    registry.placed_by_peer(numbered)
    registry.heartbeat(stats("w", timestamp_ms=3_000, placements_seen={"other/1": 2}))
    assert registry.candidates()[0].pending == 1
    registry.heartbeat(stats("w", timestamp_ms=3_500, placements_seen={"other/1": 3}))
    registry.placed_by_peer(numbered)  # a record arriving after the heartbeat showing it
    assert registry.candidates()[0].pending == 0


def test_a_numbered_placement_counts_until_a_heartbeat_shows_it_received():
    """A heartbeat built before a forward arrived leaves it pending (its tokens still in
    the backlog); one that reports its number, or a later one of its placer's, ends it.
    An unnumbered one (a prefill leg) ends at the next heartbeat, and one no heartbeat
    ever shows (lost on the way) after ``PENDING_MAX_AGE_S``. A worker that predates the
    numbers (no ``placements_seen``) ends every count with each heartbeat, as before."""
    clock = Clock()
    registry = registry_at(clock)
    registry.heartbeat(stats("w", prefill_tokens_per_s=1e-9, placements_seen={}))
    registry.placed("w", 100, "s/1", 1)
    registry.placed("w", 200, "s/1", 2)
    registry.placed("w", 40, "t/1", 9)
    registry.placed("w", 7)  # unnumbered

    def pending() -> tuple[int, int, int]:
        (candidate,) = registry.candidates()
        return candidate.pending, candidate.pending_tokens, round(candidate.queued_tokens)

    assert pending() == (4, 347, 347)
    registry.heartbeat(stats("w", placements_seen={"s/1": 1}, num_queued_prefill_tokens=100))
    assert pending() == (2, 240, 340)  # its 100 tokens now in the heartbeat's
    registry.heartbeat(stats("w", placements_seen={"s/1": 5}))
    assert pending() == (1, 40, 40)
    clock.now = PENDING_MAX_AGE_S - 0.1
    registry.heartbeat(stats("w", placements_seen={}))
    assert pending()[0] == 1
    clock.now = PENDING_MAX_AGE_S
    registry.heartbeat(stats("w", placements_seen={}))
    assert pending() == (0, 0, 0)
    registry.placed("w", 100, "s/1", 6)
    registry.heartbeat(stats("w"))  # an older worker's
    assert pending() == (0, 0, 0)


def test_a_workers_backlog_drains_at_its_rate_between_heartbeats():
    clock = Clock()
    registry = registry_at(clock)
    registry.heartbeat(stats("w", num_queued_prefill_tokens=1000, prefill_tokens_per_s=2000.0))
    clock.now = 0.25  # 500 tokens' worth of prefill later
    assert registry.candidates()[0].queued_tokens == pytest.approx(500)
    registry.placed("w", 300)  # counted in full when placed, then drains too
    clock.now = 0.5
    assert registry.candidates()[0].queued_tokens == pytest.approx(300)
    clock.now = 1.4  # nothing left, however long ago (still alive: 3 intervals)
    assert registry.candidates()[0].queued_tokens == 0


def test_a_cordoned_worker_gets_nothing_new_and_says_why():
    registry = registry_at(Clock())
    registry.heartbeat(stats("a", cordoned=True))
    refused = place(request(), registry.candidates())
    assert (refused.worker_id, refused.reason) == (None, RejectReason.NO_WORKER)
    assert "cordoned" in refused.message
    registry.heartbeat(stats("b"))
    assert place(request(), registry.candidates(), Policy.KV).worker_id == "b"


def test_retry_after_is_the_clusters_drain_time_in_whole_seconds():
    workers = [
        Candidate(stats("a", prefill_tokens_per_s=1000.0), queued_tokens=1500.0),
        Candidate(stats("b", prefill_tokens_per_s=3000.0), queued_tokens=500.0),
    ]
    # (1500 + 500 + 6000 queued in the scheduler) / (1000 + 3000) tokens/s = 2 s
    assert drain_time(workers, 6000, rate_prior=100.0) == pytest.approx(2.0)
    assert retry_after(2.0) == 2.0 and retry_after(2.01) == 3.0 and retry_after(0.1) == 1.0
    unmeasured = [Candidate(stats("c", prefill_tokens_per_s=0.0), queued_tokens=300.0)]
    assert drain_time(unmeasured, 0, rate_prior=100.0) == pytest.approx(3.0)


@pytest.mark.parametrize("policy", list(Policy))
def test_a_moved_stream_goes_where_it_continues_as_it_began(policy):
    """A moved stream's numerics (the worker it began on: here int8 weights) pick, among
    the workers that can take it, those that compute the same, even when another
    scores better; with none like it, it goes on elsewhere (the gateway counts that)."""
    busy_int8 = stats("a", weight_dtype="int8", dtype="float32", num_running=3)
    idle_fp32 = stats("b", weight_dtype="float32", dtype="float32")
    moved = msgspec.structs.replace(request(), numerics=busy_int8.numerics())
    live = [Candidate(busy_int8), Candidate(idle_fp32)]
    assert Placer(policy).place(moved, live, no_overlap).worker_id == "a"
    assert busy_int8.numerics() != idle_fp32.numerics()
    assert Placer(policy).place(moved, [Candidate(idle_fp32)], no_overlap).worker_id == "b"
    if policy != Policy.ROUND_ROBIN:
        assert Placer(policy).place(request(), live, no_overlap).worker_id == "b"


@pytest.mark.parametrize("policy", list(Policy))
def test_a_groups_requests_follow_its_first_to_one_worker(policy):
    """The ``n`` sequences of one request share an affinity: placed where the first went
    (there their prompt is computed once), while that worker can take them."""
    clock = Clock()
    registry = registry_at(clock)
    registry.heartbeat(stats("a"))
    registry.heartbeat(stats("b"))
    clock.now = 0.1
    placer = Placer(policy)
    grouped = msgspec.structs.replace(request(), affinity="group-1")
    first = placer.place(grouped, registry.candidates(), no_overlap).worker_id
    for _ in range(5):  # the pending work would send an ungrouped request elsewhere
        registry.placed(first, 10)
        assert placer.place(grouped, registry.candidates(), no_overlap).worker_id == first
    other = "b" if first == "a" else "a"
    if policy != Policy.ROUND_ROBIN:
        assert placer.place(request(), registry.candidates(), no_overlap).worker_id == other
    # Its worker gone, the group goes on elsewhere, and stays there.
    registry.heartbeat(stats(other))
    clock.now = 2.0
    registry.heartbeat(stats(other))
    assert placer.place(grouped, registry.candidates(), no_overlap).worker_id == other
