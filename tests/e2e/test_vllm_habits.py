"""A vLLM user's request fields through the ``openai`` client: each honoured as vLLM
honours it, or refused with a 400 naming it; a field nobody knows is ignored, and the
response says so."""

from __future__ import annotations

import itertools
import json

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.e2e.conftest import make_stack

GREEDY = {"temperature": 0, "max_tokens": 6}
PROMPT = "Once upon a time there was"


def test_a_field_nobody_knows_is_ignored_and_named_in_a_header(client):
    raw = client.completions.with_raw_response.create(
        model=None, prompt=PROMPT, extra_body={"bogus_field": 1, "ignore_eos": True}, **GREEDY
    )
    assert raw.headers["x-lamina-ignored-fields"] == "bogus_field"
    assert raw.parse().choices[0].text
    plain = client.completions.with_raw_response.create(model=None, prompt=PROMPT, **GREEDY)
    assert "x-lamina-ignored-fields" not in plain.headers


@pytest.mark.parametrize(
    ("field", "value"),
    [("early_stopping", True), ("cache_salt", "tenant-a"), ("logprob_token_ids", [1, 2]),
     ("stream_interval", 4)],
)  # fmt: skip
def test_a_field_lamina_does_not_implement_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=None, prompt=PROMPT, extra_body={field: value}, **GREEDY)
    assert refused.value.body["param"] == field
    assert field in refused.value.body["message"]


def test_return_token_ids_gives_the_prompts_and_each_choices_ids(client, tokenizer):
    extra = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(model=None, prompt=PROMPT, extra_body=extra, **GREEDY)
    choice = whole.model_dump()["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode(PROMPT, add_special_tokens=True).ids
    assert len(choice["token_ids"]) == whole.usage.completion_tokens == 6
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    assert choice["prompt_logprobs"] is None  # present, as vLLM's, when not asked for

    chunks = list(
        client.completions.create(
            model=None, prompt=PROMPT, stream=True, extra_body=extra, **GREEDY
        )
    )
    dumped = [c.model_dump()["choices"][0] for c in chunks if c.choices]
    assert dumped[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in dumped[1:])
    assert [t for c in dumped for t in c["token_ids"]] == choice["token_ids"]

    chat = client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": PROMPT}], extra_body=extra, **GREEDY
    ).model_dump()
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == 6
    without = client.completions.create(model=None, prompt=PROMPT, **GREEDY).model_dump()
    assert "token_ids" not in without["choices"][0]


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=None,
            prompt=PROMPT,
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[-1] == 6
    assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}
    chat = list(
        client.chat.completions.create(
            model=None,
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    assert chat[0].usage.completion_tokens == 0  # the role chunk
    assert all(c.usage is not None for c in chat)
    plain = list(
        client.completions.create(
            model=None, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_logprobs_zero_gives_the_sampled_tokens_and_minus_one_the_vocabulary(client):
    body = client.completions.create(model=None, prompt=PROMPT, logprobs=0, **GREEDY)
    logprobs = body.choices[0].logprobs
    assert len(logprobs.tokens) == 6
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top == {token: value}
    # text_offset: where each token's text starts in the choice's text, streamed or not.
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    widths = [b - a for a, b in itertools.pairwise(offsets)]
    assert widths == [len(t) for t in logprobs.tokens[:-1]]
    chunks = client.completions.create(model=None, prompt=PROMPT, logprobs=0, stream=True, **GREEDY)
    streamed = [o for c in chunks if c.choices and c.choices[0].logprobs
                for o in c.choices[0].logprobs.text_offset]  # fmt: skip
    assert streamed == offsets
    two = client.completions.create(model=None, prompt=PROMPT, logprobs=2, **GREEDY)
    scored = two.choices[0].logprobs
    for token, top in zip(scored.tokens, scored.top_logprobs, strict=True):
        assert token in top and 2 <= len(top) <= 3  # the sampled token, then the top two
    for field, extra in (
        ("logprobs", {"logprobs": -1}),
        ("prompt_logprobs", {"prompt_logprobs": -1}),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=None, prompt=PROMPT, extra_body=extra, **GREEDY)
        assert refused.value.body["param"] == field
        assert "whole vocabulary" in refused.value.body["message"]


def test_x_request_id_is_the_clients_or_the_bodys_or_the_responses(stack):
    body = {"prompt": PROMPT, **GREEDY}
    url = stack.base_url + "/v1/completions"
    given = httpx.post(url, json=body, headers={"x-request-id": "client-7"}, timeout=30)
    assert given.headers["x-request-id"] == "client-7"
    in_body = httpx.post(url, json=body | {"request_id": "body-8"}, timeout=30)
    assert in_body.headers["x-request-id"] == "body-8"
    assert in_body.json()["id"] != "cmpl-body-8"  # the response's id stays the gateway's
    plain = httpx.post(url, json=body, timeout=30)
    assert "cmpl-" + plain.headers["x-request-id"] == plain.json()["id"]
    refused = httpx.post(url, json={"prompt": PROMPT, "max_tokens": -1}, timeout=30)
    assert refused.status_code == 400 and refused.headers["x-request-id"]
    assert httpx.get(stack.base_url + "/v1/models", timeout=30).headers["x-request-id"]
    with_space = httpx.post(url, json=body | {"request_id": "a b"}, timeout=30)
    assert with_space.status_code == 400 and with_space.json()["error"]["param"] == "request_id"


def test_a_session_id_is_accepted_and_streamed_requests_carry_it(stack):
    body = {"prompt": PROMPT, "session_id": "conversation-1", "stream": True, **GREEDY}
    with httpx.stream("POST", stack.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert "x-lamina-ignored-fields" not in r.headers
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert json.loads(events[-1][6:])["choices"][0]["finish_reason"] == "length"


def test_truncate_prompt_tokens_keeps_the_prompts_end_or_its_start(client, tokenizer):
    long = " ".join(["the little dog ran far away"] * 8)
    ids = tokenizer.encode(long, add_special_tokens=True).ids
    extra = {"return_token_ids": True, "truncate_prompt_tokens": 10}
    left = client.completions.create(model=None, prompt=long, extra_body=extra, **GREEDY)
    assert left.usage.prompt_tokens == 10
    assert left.model_dump()["choices"][0]["prompt_token_ids"] == ids[-10:]
    right = client.completions.create(
        model=None, prompt=long, extra_body=extra | {"truncation_side": "right"}, **GREEDY
    )
    assert right.model_dump()["choices"][0]["prompt_token_ids"] == ids[:10]
    whole = client.completions.create(
        model=None, prompt=long, extra_body=extra | {"truncate_prompt_tokens": -1}, **GREEDY
    )
    assert whole.usage.prompt_tokens == len(ids)  # shorter than the context: untouched
    for value, words in ((5000, "cannot be greater than max_model_len"), (-2, "-1")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(
                model=None, prompt=long, extra_body={"truncate_prompt_tokens": value}, **GREEDY
            )
        assert refused.value.body["param"] == "truncate_prompt_tokens"
        assert words in refused.value.body["message"]
    # -1 on a prompt longer than the context keeps max_model_len - 1 tokens (1024 here),
    # room for one generated token (vLLM's rule: more is refused as over the context).
    longer = [ids[1]] * 1500
    cut = client.completions.create(
        model=None, prompt=longer, max_tokens=1, extra_body={"truncate_prompt_tokens": -1}
    )
    assert cut.usage.prompt_tokens == 1023


CONTINUED = [
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon a time there"},
]


def test_a_continued_assistant_message_is_echoed_and_tokenized_as_tokenize_says(client, stack):
    options = {"add_generation_prompt": False, "continue_final_message": True}
    extra = options | {"echo": True, "return_token_ids": True, "ignore_eos": True}
    reply = client.chat.completions.create(
        model=None, messages=CONTINUED, extra_body=extra, **GREEDY
    ).model_dump()
    content = reply["choices"][0]["message"]["content"]
    assert content.startswith("Once upon a time there") and len(content) > 22
    tokenized = httpx.post(
        stack.base_url + "/tokenize", json={"messages": CONTINUED} | options, timeout=30
    ).json()
    assert reply["prompt_token_ids"] == tokenized["tokens"]
    streamed = list(
        client.chat.completions.create(
            model=None, messages=CONTINUED, stream=True, extra_body=extra, **GREEDY
        )
    )
    assert streamed[0].choices[0].delta.role == "assistant"
    assert streamed[1].choices[0].delta.content == "Once upon a time there"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == content
    with pytest.raises(openai.BadRequestError) as refused:  # both at once: vLLM's 400
        client.chat.completions.create(
            model=None,
            messages=CONTINUED,
            extra_body={"continue_final_message": True},
            **GREEDY,
        )
    assert refused.value.body["param"] == "continue_final_message"


def test_a_custom_role_the_template_takes_and_template_kwargs(client, stack):
    custom = [{"role": "narrator", "content": "It was dark."}, {"role": "user", "content": "Go"}]
    reply = client.chat.completions.create(model=None, messages=custom, **GREEDY)
    assert reply.choices[0].finish_reason in ("length", "stop")
    for kwargs, param in (({"messages": []}, "chat_template_kwargs"), ({}, "chat_template")):
        extra = {"chat_template_kwargs": kwargs} if kwargs else {"chat_template": "{{ 1 }}"}
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=None, messages=custom, extra_body=extra, **GREEDY)
        assert refused.value.body["param"] == param
    without = client.completions.create(
        model=None, prompt=PROMPT, extra_body={"return_token_ids": True}, **GREEDY
    ).model_dump()["choices"][0]["prompt_token_ids"]
    plain = client.completions.create(
        model=None,
        prompt=PROMPT,
        extra_body={"return_token_ids": True, "add_special_tokens": False},
        **GREEDY,
    ).model_dump()["choices"][0]["prompt_token_ids"]
    tokenized = httpx.post(
        stack.base_url + "/tokenize",
        json={"prompt": PROMPT, "add_special_tokens": False},
        timeout=30,
    ).json()["tokens"]
    assert plain == tokenized and len(without) >= len(plain)


@pytest.fixture(scope="module")
def trusting(tiny_model, tmp_path_factory):
    """A stack whose gateway takes a request's own chat template."""

    s = make_stack(
        tiny_model,
        tmp_path_factory.mktemp("trusting"),
        worker_args=["--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "512"],
        gateway_args=["--trust-request-chat-template"],
        services=frozenset({"scheduler", "worker", "gateway"}),
    )
    with s:
        yield s


def test_a_trusted_requests_own_template_and_its_kwargs_are_rendered(trusting):
    template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ flavour }}]{% endfor %}"
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template": template,
        "chat_template_kwargs": {"flavour": "mint"},
        "max_tokens": 1,
        "return_token_ids": True,
    }
    reply = httpx.post(trusting.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    tokenizer = Tokenizer.from_file(str(trusting.model / "tokenizer.json"))
    assert tokenizer.decode(reply.json()["prompt_token_ids"]) == "[user|hi|mint]"
    broken = httpx.post(
        trusting.base_url + "/v1/chat/completions",
        json=body | {"chat_template": "{% for %}"},
        timeout=60,
    )
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages"


def test_a_batch_of_chats_is_one_response_with_a_choice_each(stack, client):
    chats = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(3)]
    url = stack.base_url + "/v1/chat/completions/batch"
    body = {"messages": chats, "temperature": 0, "max_tokens": 5, "return_token_ids": True}
    reply = httpx.post(url, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    batch = reply.json()
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    for chat, choice in zip(chats, batch["choices"], strict=True):
        alone = client.chat.completions.create(
            model=None,
            messages=chat,
            extra_body={"return_token_ids": True},
            **GREEDY | {"max_tokens": 5},
        ).model_dump()
        assert choice["prompt_token_ids"] == alone["prompt_token_ids"]
        assert choice["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert batch["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in batch["choices"])
    for extra, param in (({"n": 2}, "n"), ({"stream": True}, "stream"),
                         ({"use_beam_search": True}, "use_beam_search")):  # fmt: skip
        refused = httpx.post(url, json=body | extra, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_sagemakers_ping_and_invocations_route_as_vllm_does(stack, client):
    ping = httpx.get(stack.base_url + "/ping", timeout=30)
    assert ping.status_code == 200 and ping.content == b""
    assert httpx.post(stack.base_url + "/ping", timeout=30).status_code == 200
    url = stack.base_url + "/invocations"
    chat = {"messages": [{"role": "user", "content": PROMPT}], **GREEDY}
    as_chat = httpx.post(url, json=chat, timeout=60).json()
    assert as_chat["object"] == "chat.completion"
    assert as_chat["choices"][0]["message"]["content"] == (
        client.chat.completions.create(model=None, messages=chat["messages"], **GREEDY)
        .choices[0]
        .message.content
    )
    as_completion = httpx.post(url, json={"prompt": PROMPT, **GREEDY}, timeout=60).json()
    assert as_completion["object"] == "text_completion"
    streamed = httpx.post(url, json=chat | {"stream": True}, timeout=60)
    assert streamed.headers["content-type"] == "text/event-stream"
    assert streamed.text.rstrip().endswith("data: [DONE]")
    neither = httpx.post(url, json={"input": "embed me"}, timeout=30)
    assert neither.status_code == 400 and "handler" in neither.json()["error"]["message"]
    assert httpx.post(url, content=b"{oops", timeout=30).status_code == 400


def test_errors_a_client_can_act_on(stack):
    url = stack.base_url + "/v1/completions"
    cases = [
        ({"logit_bias": {"abc": 1, "7": 2}}, "logit_bias", "cannot be converted to integer"),
        ({"logit_bias": {"7": 500}}, "logit_bias", "within [-100, 100]"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"seed": 2**64}, "seed", "9223372036854775807"),
    ]
    for extra, param, words in cases:
        reply = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2} | extra, timeout=30)
        error = reply.json()["error"]
        assert (reply.status_code, error["param"]) == (400, param), (extra, error)
        assert words in error["message"], (extra, error)
    assert "abc" in httpx.post(url, json={"prompt": PROMPT} | cases[0][0], timeout=30).text


def reference_beams(tiny_model, prompt: list[int], width: int, steps: int) -> list[float]:
    """The cumulative logprobs of the ``width`` best beams, by ``transformers`` on the same
    weights (vLLM's algorithm, no EOS: ``ignore_eos``)."""
    import torch
    import transformers

    from lamina.services.gateway.beam_search import Beam, extend

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    live = [Beam(tuple(prompt))]
    with torch.no_grad():
        for _ in range(steps):
            options = []
            for beam in live:
                logits = model(torch.tensor([beam.tokens])).logits[0, -1].float()
                top = torch.log_softmax(logits, -1).topk(2 * width)
                options.append(list(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
            live = extend(live, options, width, None, 1.0, [])
    return sorted((b.logprob for b in live), reverse=True)


def test_beam_search_finds_the_beams_transformers_finds(client, tiny_model, tokenizer):
    prompt = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    extra = {"use_beam_search": True, "ignore_eos": True, "return_token_ids": True}
    reply = client.completions.create(
        model=None, prompt=PROMPT, n=3, max_tokens=4, temperature=0, extra_body=extra
    ).model_dump()
    beams = [c["token_ids"] for c in reply["choices"]]
    assert len(beams) == 3 and len({tuple(b) for b in beams}) == 3
    assert all(len(b) == 4 for b in beams)
    assert reply["usage"]["completion_tokens"] == 12

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        scored = []
        for beam in beams:  # each beam's logprob under transformers
            ids = torch.tensor([prompt + beam])
            logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
            positions = range(len(prompt) - 1, len(prompt) + len(beam) - 1)
            scored.append(sum(float(logprobs[p, t]) for p, t in zip(positions, beam, strict=True)))
    assert scored == sorted(scored, reverse=True)  # best first
    want = reference_beams(tiny_model, prompt, 3, 4)
    assert scored == pytest.approx(want, abs=2e-3)
    # One beam wide is greedy decoding.
    one = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=extra | {"n": 1}
    )
    greedy = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert one.choices[0].text == greedy.choices[0].text


def test_what_beam_search_cannot_do_is_a_400(client):
    for extra, param in (
        ({"stream": True}, "stream"),
        ({"logprobs": 2}, "logprobs"),
        ({"n": 11}, "n"),
        ({"max_tokens": 5000}, "max_tokens"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(
                model=None,
                prompt=PROMPT,
                **({"max_tokens": 4} | {k: v for k, v in extra.items() if k != "stream"}),
                extra_body={"use_beam_search": True}
                | ({"stream": True} if "stream" in extra else {}),
            )
        assert refused.value.body["param"] == param


def test_a_beam_search_chat_takes_no_untrusted_template(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=None,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=2,
            extra_body={"use_beam_search": True, "chat_template": "{{ messages }}"},
        )
    assert refused.value.body["param"] == "chat_template"
