"""Disaggregated prefill and decode through the whole stack: one prefill worker, two
decode workers (``Stack.prefill_workers``). A long prompt is placed on a decode worker
with a prefill leg on the prefill worker, which the placement record, the trace (a
``kv prefill`` span on the prefill worker, a ``kv fetch`` span on the decode worker) and
telemetry show; the text equals the prefill worker's own run of the request, whole. A
prefill worker that stops answering costs the request the wait and a local prefill,
never its text."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time

import httpx

from tests.e2e.conftest import make_stack, read_spans
from tests.e2e.test_ctl import lamina_ctl
from tests.e2e.test_kv_moves import ctl, placed

PROMPT = list(range(5, 305))  # 300 tokens: 18 full blocks of 16 and 12 tokens
OTHER = list(range(100, 400))
DECODERS = ("worker-1", "worker-2")


def wait_until(capsys, url: str, worker: str, state: str, within_s: float = 60.0) -> None:
    """``lamina ctl status`` shows ``worker`` in ``state`` (three workers start on two
    loaded cores: longer than ``wait_for_status``'s bound)."""
    deadline = time.monotonic() + within_s
    while True:
        code, out = lamina_ctl(capsys, url, "status")
        line = next((row for row in out.splitlines() if row.startswith(worker + " ")), "")
        if code == 0 and f" {state} " in line:
            return
        assert time.monotonic() < deadline, f"{worker} never showed {state}: {out}"
        time.sleep(0.2)


def cluster_once(stack, shows) -> dict[str, dict]:
    """Telemetry's ``/v1/cluster`` workers by id once ``shows(workers)`` (heartbeats
    come every 2 s here)."""
    deadline = time.monotonic() + 15
    while True:
        cluster = httpx.get(stack.metrics_url.replace("/metrics", "/v1/cluster"), timeout=10)
        workers = {w["worker_id"]: w for w in cluster.json()["workers"]}
        if shows(workers) or time.monotonic() > deadline:
            return workers
        time.sleep(0.2)


def test_a_prefill_worker_computes_long_prompts_for_the_decode_workers(stories, tmp_path, capsys):
    # Heartbeats every 2 s: a stopped prefill worker stays placeable for 6 s.
    args = ["--max-model-len", "512", "--kv-prefill-timeout", "3", "--stats-interval", "2"]
    spans_at = tmp_path / "spans.jsonl"
    env = {"LAMINA_TRACE_FILE": str(spans_at)}
    with make_stack(
        stories, tmp_path, workers=3, prefill_workers=1, worker_args=args, extra_env=env
    ) as stack:
        url = stack.nats_url
        for worker in ("worker-0", *DECODERS):
            wait_until(capsys, url, worker, "ready")

        def complete(prompt: list[int], trace_id: str = "") -> dict:
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            traced = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
            response = httpx.post(
                stack.base_url + "/v1/completions",
                json=body,
                headers=traced if trace_id else {},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            return response.json()

        # The reference: with the decode workers cordoned, the prefill worker is the only
        # one placeable, and runs each request whole; then it forgets what it cached.
        for worker in DECODERS:
            ctl(capsys, url, "cordon", worker)
            wait_until(capsys, url, worker, "cordoned")
        whole = {}
        for name, prompt in (("prompt", PROMPT), ("other", OTHER)):
            whole[name], record = asyncio.run(placed(url, lambda p=prompt: complete(p)))
            assert record.worker_id == "worker-0" and not record.scored[0].prefill
        ctl(capsys, url, "reset-prefix-cache", "worker-0")
        for worker in DECODERS:
            ctl(capsys, url, "uncordon", worker)
            wait_until(capsys, url, worker, "ready")

        trace_id = secrets.token_hex(16)
        split, record = asyncio.run(placed(url, lambda: complete(PROMPT, trace_id)))
        decoder = record.worker_id
        assert decoder in DECODERS
        (chosen,) = [s for s in record.scored if s.worker_id == decoder]
        assert (chosen.fetch_from, chosen.fetch_blocks, chosen.prefill) == ("worker-0", 18, True)
        assert {s.worker_id for s in record.scored} == set(DECODERS)
        assert split["choices"][0]["text"] == whole["prompt"]["choices"][0]["text"]
        assert split["usage"]["prompt_tokens_details"]["cached_tokens"] == 288

        # A heartbeat carries the KV counters as they are and the engine's as of its last
        # stats (0.1 s old at most): wait for one with the decoder's prompt counted too.
        workers = cluster_once(
            stack,
            lambda w: (
                w["worker-0"]["kv_prefills_total"]
                and w[decoder]["kv_fetches_total"]
                and w[decoder]["prompt_tokens_total"]
            ),
        )
        assert workers["worker-0"]["role"] == "prefill"
        assert workers["worker-0"]["kv_prefills_total"] == 1
        assert workers["worker-0"]["kv_sent_blocks_total"] == 18
        assert workers[decoder]["role"] == "decode"
        assert workers[decoder]["kv_fetches_total"] == 1
        computed = (
            workers[decoder]["prompt_tokens_total"] - workers[decoder]["prompt_tokens_cached"]
        )
        assert computed == 12  # the last partial block: the rest was computed elsewhere
        metrics = httpx.get(stack.metrics_url, timeout=10).text
        leg = f'decode_worker_id="{decoder}",prefill_worker_id="worker-0"'
        assert f"lamina:disaggregated_placements_total{{{leg}}} 1.0" in metrics
        # Both legs in the request's trace: the prefill under the placement, the fetch
        # under the decode worker's side of the request.
        deadline, names = time.monotonic() + 10, set()
        want = {f"kv prefill for {decoder}", "kv fetch worker-0"}
        while not want <= names and time.monotonic() < deadline:
            names = {s["name"] for s in read_spans(spans_at) if s["trace_id"] == trace_id}
            time.sleep(0.2)
        assert want <= names, names

        # The prefill worker stops (its last heartbeat still places legs on it): the decode
        # worker waits its --kv-prefill-timeout, then computes the prompt itself.
        # (It is killed after: continued, it would keep the abandoned grant, and its
        # shutdown would wait for that grant's receiver until the grant lapsed.)
        prefiller = stack.procs["worker-0"]
        os.kill(prefiller.pid, signal.SIGSTOP)
        try:
            fallback, record = asyncio.run(placed(url, lambda: complete(OTHER)))
        finally:
            os.kill(prefiller.pid, signal.SIGKILL)
        (chosen,) = [s for s in record.scored if s.worker_id == record.worker_id]
        assert (chosen.fetch_from, chosen.prefill) == ("worker-0", True)
        assert fallback["choices"][0]["text"] == whole["other"]["choices"][0]["text"]
        assert not (fallback["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        failed = record.worker_id
        workers = cluster_once(stack, lambda w: w[failed]["kv_fetch_failures_total"])
        assert workers[failed]["kv_fetch_failures_total"] == 1
