"""vLLM's ``/tokenize``, ``/detokenize`` and ``/version`` through the running gateway:
vLLM's request and response shapes, the same tokens the completion routes prompt with,
chats rendered as ``transformers`` renders them, and OpenAI-shaped errors."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]


def ids_of(rendered) -> list[int]:
    """``apply_chat_template(tokenize=True)``'s ids (a list, or a mapping in newer
    ``transformers``)."""
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


@pytest.fixture(scope="module")
def post(stack):
    def call(path: str, body: dict) -> httpx.Response:
        return httpx.post(stack.base_url + path, json=body, timeout=10)

    return call


@pytest.fixture(scope="module")
def reference(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def test_text_tokenizes_to_what_a_completion_is_prompted_with(post, stack, reference):
    prompt = "The quick brown fox"
    answer = post("/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert answer["tokens"] == reference(prompt)["input_ids"]
    assert answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == 1024  # the worker's (--max-model-len)
    assert answer["token_strs"] == reference.convert_ids_to_tokens(answer["tokens"])
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="-", max_retries=0)
    completion = client.completions.create(model="lamina-tiny", prompt=prompt, max_tokens=1)
    assert completion.usage.prompt_tokens == answer["count"]
    plain = post("/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["token_strs"] is None and plain["tokens"] == answer["tokens"]  # no BOS here


def test_a_chat_tokenizes_as_transformers_renders_it_and_as_a_chat_is_prompted(
    post, stack, reference
):
    answer = post("/tokenize", {"model": "lamina-tiny", "messages": MESSAGES}).json()
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert answer["tokens"] == ids_of(expected)
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="-", max_retries=0)
    chat = client.chat.completions.create(model="lamina-tiny", messages=MESSAGES, max_tokens=1)
    assert chat.usage.prompt_tokens == answer["count"]

    prefill = [*MESSAGES, {"role": "assistant", "content": "The colour is"}]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    continued = post("/tokenize", body).json()
    expected = reference.apply_chat_template(prefill, continue_final_message=True, tokenize=True)
    assert continued["tokens"] == ids_of(expected)


def test_detokenize_round_trips_and_keeps_special_tokens(post, reference):
    tokens = post("/tokenize", {"messages": MESSAGES}).json()["tokens"]
    text = post("/detokenize", {"tokens": tokens}).json()["prompt"]
    assert text == reference.decode(tokens) and "<|im_start|>" in text


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 7}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        (
            "/tokenize",
            {"messages": [{"role": "<|im_end|>wizard", "content": "x"}]},
            400,
            "messages[0].role",
        ),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": "hello"}, 400, "tokens"),
    ],
)
def test_bad_requests_get_openai_errors(post, path, body, status, param):
    response = post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_malformed_json_is_a_400(stack):
    response = httpx.post(stack.base_url + "/tokenize", content=b"{not json", timeout=10)
    assert response.status_code == 400 and response.json()["error"]["type"]


def test_version_and_the_openapi_document_describe_the_routes(stack):
    assert httpx.get(stack.base_url + "/version").json()["version"]
    paths = httpx.get(stack.base_url + "/openapi.json").json()["paths"]
    assert {"/tokenize", "/detokenize", "/version"} <= set(paths)
