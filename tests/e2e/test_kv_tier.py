"""A worker's KV lower tiers through the whole stack (``--kv-offload-bytes``, and
``--kv-offload-disk-bytes`` below it): a prompt's prefix evicted from the device by other
prompts, and passed down from the small host tier to the disk tier, comes back from the
tiers, the client sees it cached (``prompt_tokens_details.cached_tokens``) and gets the
text it got when the prefix was computed; the worker's heartbeat, its KV events on the
bus and telemetry say what moved where."""

from __future__ import annotations

import asyncio

import httpx

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.kv import BlockStored, KvEventBatch, Medium
from tests.e2e.conftest import make_stack

PREFIX = list(range(5, 133))  # 8 blocks of 16: a third of the device pool
QUESTION = [*PREFIX, 140, 141, 142]
FILLERS = [[200 + n, *range(300, 340)] for n in range(8)]  # 3 blocks each, unshared
HOST_BYTES = 4 * 5 * 2 * 16 * 4 * 8 * 4  # 4 blocks: 5 layers of K and V, 16 x 4 heads x 8 fp32


def test_an_evicted_prefix_comes_back_from_the_tiers_with_the_same_text(stories, tmp_path):
    args = ["--max-model-len", "256", "--num-kv-blocks", "24", "--kv-offload-bytes"]
    args += [str(HOST_BYTES), "--kv-offload-disk-bytes", str(16 << 20)]
    args += ["--kv-offload-dir", str(tmp_path / "kv")]
    with make_stack(stories, tmp_path, worker_args=args) as stack:

        def complete(prompt: list[int]) -> dict:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            response = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        async def main() -> tuple[str, dict, list[BlockStored]]:
            heard: list[BlockStored] = []
            bus = await Bus.connect(stack.nats_url, "test-kv-tier")
            try:

                async def on_batch(batch: KvEventBatch, _msg) -> None:
                    heard.extend(e for e in batch.events if isinstance(e, BlockStored))

                await bus.subscribe(subjects.WORKER_KV_ALL, KvEventBatch, on_batch)
                first = await asyncio.to_thread(complete, QUESTION)
                for filler in FILLERS:
                    await asyncio.to_thread(complete, filler)
                again = await asyncio.to_thread(complete, QUESTION)
                await asyncio.sleep(1.0)  # the last events' batch
            finally:
                await bus.close()
            return first["choices"][0]["text"], again, heard

        text, again, heard = asyncio.run(main())
        assert again["choices"][0]["text"] == text
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PREFIX)
        media = {e.medium for e in heard}
        assert media == {Medium.DEVICE, Medium.HOST, Medium.DISK}  # saved, passed down, loaded
        url = stack.metrics_url.replace("/metrics", "/v1/cluster")
        (worker,) = httpx.get(url, timeout=10).json()["workers"]
        assert worker["host_kv_blocks"] == 4 and worker["host_kv_saves_total"] >= 8
        assert worker["disk_kv_blocks"] > 0 and worker["disk_kv_saves_total"] >= 4
        assert worker["host_kv_loads_total"] + worker["disk_kv_loads_total"] == 8
        assert worker["disk_kv_loads_total"] >= 4 and worker["disk_kv_load_blocks_per_s"] > 0
        metrics = httpx.get(stack.metrics_url, timeout=10).text
        assert "lamina:disk_kv_loads_total" in metrics
