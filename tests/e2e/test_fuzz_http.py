"""``schemathesis`` against the gateway's own OpenAPI document, on the shared stack: requests
generated from the schema (valid ones, and ones that break it on purpose) never get a 5xx
and never hang. Bounded and deterministic: a fixed number of examples per operation."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from lamina.services.gateway.openapi import openapi_document

EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 60}
#: Requests with a body (or a path parameter) are generated both ways; the other GETs take
#: no input to break.
CASES = [
    (path, mode)
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/v1/models/{model}",
    )
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
] + [(path, GenerationMode.POSITIVE) for path in ("/v1/models", "/version", "/health", "/ready")]


def test_the_served_document_is_the_one_the_code_builds(stack):
    served = httpx.get(stack.base_url + "/openapi.json").json()
    assert served == openapi_document()


@pytest.mark.parametrize(("path", "mode"), CASES, ids=[f"{p}-{m.value}" for p, m in CASES])
def test_generated_requests_get_no_server_error_and_no_hang(stack, path, mode):
    schema = schemathesis.openapi.from_dict(openapi_document())
    (operation,) = [op for r in schema.get_all_operations() if (op := r.ok()).path == path]
    statuses: list[int] = []

    @settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def call(case) -> None:
        response = case.call(base_url=stack.base_url, timeout=30)  # a hang fails here
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.body, response.status_code, response.text)

    call()
    assert statuses, "nothing was generated"
