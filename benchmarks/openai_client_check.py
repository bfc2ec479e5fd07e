"""The stack through every hop, as an OpenAI client sees it: wait for ``/ready``, list the
models (with what each worker says of its numerics), then a chat completion, the same
streamed, and a text completion; prints each answer, its usage and its timing, and exits
non-zero on any failure. ``benchmarks/gpu_stack.sh`` runs it against ``lamina up
--device cuda``; here it runs against ``make up``.

    .venv/bin/python benchmarks/openai_client_check.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from openai import OpenAI
from timing import wait_http


def wait_ready(base_url: str, timeout: float) -> None:
    """Until the gateway's ``/ready`` answers 200 (a worker is ready), or exit."""
    try:
        wait_http(base_url.removesuffix("/v1") + "/ready", timeout)
    except TimeoutError as exc:
        sys.exit(str(exc))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--wait", type=float, default=300.0, help="seconds to wait for /ready")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    wait_ready(args.base_url, args.wait)
    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=60)
    models = client.models.list()
    print("models:", json.dumps([m.model_dump() for m in models.data]))
    model = models.data[0].id
    messages = [{"role": "user", "content": "Tell me a story about a GPU."}]

    # Once to warm up: the prompt's blocks are then cached for both compared below, whose
    # prefills compute the same (uncached) rows alike.
    client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    started = time.perf_counter()
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=args.max_tokens, temperature=0
    )
    print(f"chat ({time.perf_counter() - started:.3f} s): {chat.choices[0].message.content!r}")
    print(f"  finish {chat.choices[0].finish_reason}, usage {chat.usage.model_dump()}")
    assert chat.usage.completion_tokens > 0

    started, first, chunks, text = time.perf_counter(), None, 0, []
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            chunks += 1
            text.append(chunk.choices[0].delta.content)
    total = time.perf_counter() - started
    assert first is not None, "the stream carried no content"
    print(f"streamed chat: {chunks} chunks, first after {(first - started) * 1e3:.1f} ms, "
          f"all in {total * 1e3:.1f} ms: {''.join(text)!r}")  # fmt: skip
    assert "".join(text) == chat.choices[0].message.content, "greedy stream differs"

    completion = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=args.max_tokens, temperature=0
    )
    print(f"completion: {completion.choices[0].text!r}, usage {completion.usage.model_dump()}")
    print("ok")


if __name__ == "__main__":
    main()
