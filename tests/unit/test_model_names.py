"""Which ``model`` names a gateway takes: its model, the LoRA adapters its workers hold;
any other is OpenAI's 404, naming a few of those it serves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lamina.services.gateway.errors import GenerationError
from lamina.services.gateway.intake import SHOWN_MODELS, Intake


def names(adapters: list[str]) -> SimpleNamespace:
    """What ``Intake.check_model`` reads of a gateway: its model and the adapters."""
    return SimpleNamespace(model_name="m", adapters=adapters)


def test_the_model_and_its_adapters_are_served():
    gateway = names(["sql"])
    assert Intake.check_model(gateway, None) == "m"
    assert Intake.check_model(gateway, "m") == "m"
    assert Intake.check_model(gateway, "sql") == "sql"


def test_another_name_is_a_404_that_names_a_few_served_ones():
    with pytest.raises(GenerationError) as refused:
        Intake.check_model(names(["sql"]), "chat")
    assert (refused.value.status, refused.value.code) == (404, "model_not_found")
    assert "served: 'm', 'sql'" in refused.value.message
    many = [f"adapter-{n}" for n in range(1000)]
    with pytest.raises(GenerationError) as refused:
        Intake.check_model(names(many), "chat")
    message = refused.value.message
    assert f"and {1001 - SHOWN_MODELS} more" in message and len(message) < 300
