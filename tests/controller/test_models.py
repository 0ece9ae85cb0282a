"""Models on the control plane: a spec's ``model`` and the gateway config's ``models``, the
refusal of a model name two services declare, and what reaches the pool."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from controller.config import ConfigError, load_config
from controller.errors import SpecError
from controller.spec import ServiceSpec

from .conftest import Harness, spec


def test_a_model_reaches_the_routing_and_the_pools_model_table() -> None:
    s = ServiceSpec.model_validate(spec(model={"name": "llama", "aliases": ["l3"]}))
    routing = s.routing()
    assert routing.model is not None
    assert routing.model.names == ("llama", "l3")
    assert ServiceSpec.model_validate(spec()).routing().model is None


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ({"name": "a b"}, "not a model name"),
        ({"name": "m", "aliases": ["m"]}, "the model's name already"),
        ({"name": "m", "aliases": ["x", "x"]}, "listed twice"),
        ({"aliases": ["x"]}, "name"),
    ],
)
def test_bad_models_are_refused_naming_the_field(model: object, reason: str) -> None:
    with pytest.raises(ValidationError, match=reason) as caught:
        ServiceSpec.model_validate(spec(model=model))
    assert caught.value.errors()[0]["loc"][0] == "model"


async def test_a_model_two_services_declare_is_refused_naming_both(h: Harness) -> None:
    await h.controller.apply(spec("a", model={"name": "llama"}))
    with pytest.raises(SpecError, match="'llama' is declared by both service 'a' and service 'b'"):
        await h.controller.apply(spec("b", model={"name": "mistral", "aliases": ["llama"]}))
    await h.controller.apply(spec("b", model={"name": "mistral"}))
    assert h.pool.models.service("llama") == "a"
    assert h.pool.models.service("mistral") == "b"
    # The service itself may apply its model again, and change it.
    await h.controller.apply(spec("a", model={"name": "llama-2"}))
    assert h.pool.models.service("llama") is None
    assert h.pool.models.service("llama-2") == "a"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


SERVICE = """
  - name: {name}
    route: {{path_prefix: /{name}}}
    replica: {{commands: [serve]}}
    model: {{name: {model}}}"""


def test_the_config_turns_models_on_and_refuses_a_shared_model(tmp_path: Path) -> None:
    loaded = load_config(write(tmp_path, "models: {path_prefix: /openai/v1/}\n"))
    assert loaded.config.proxy_config().models is not None
    assert loaded.config.proxy_config().models.path_prefix == "/openai/v1"
    assert load_config(write(tmp_path, "{}\n")).config.proxy_config().models is None
    with pytest.raises(ConfigError, match=r"models\.path_prefix"):
        load_config(write(tmp_path, "models: {path_prefix: v1}\n"))
    with pytest.raises(ConfigError, match=r"models\.max_body_read"):
        load_config(write(tmp_path, "models: {max_body_read: 10000000}\n"))
    text = "services:" + SERVICE.format(name="a", model="m") + SERVICE.format(name="b", model="m")
    with pytest.raises(ConfigError, match="'m' is declared by both service 'a' and service 'b'"):
        load_config(write(tmp_path, text + "\n"))


def test_the_inference_policy_takes_its_settings_and_only_it() -> None:
    s = ServiceSpec.model_validate(spec(load_balancing="inference"))
    assert s.routing().load_balancing == "inference"
    assert s.routing().inference.prefix_chars == 4096
    s = ServiceSpec.model_validate(
        spec(load_balancing={"policy": "inference", "prefix_chars": 64, "max_load_factor": 2})
    )
    assert (s.routing().inference.prefix_chars, s.routing().inference.max_load_factor) == (64, 2)
    with pytest.raises(ValidationError, match="prefix_chars is for policy inference"):
        ServiceSpec.model_validate(spec(load_balancing={"policy": "p2c", "prefix_chars": 1}))
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ServiceSpec.model_validate(
            spec(load_balancing={"policy": "inference", "max_load_factor": 0.5})
        )


def test_load_metrics_reach_the_routing_and_bad_ones_are_refused() -> None:
    s = ServiceSpec.model_validate(spec(load_metrics={"format": "sglang", "interval": "500ms"}))
    config = s.routing().load_metrics
    assert config is not None
    assert (config.format, config.path, config.interval, config.max_age) == (
        "sglang",
        "/metrics",
        0.5,
        3.0,
    )
    assert ServiceSpec.model_validate(spec()).routing().load_metrics is None
    for bad, reason in (
        ({"format": "tgi"}, "'vllm' or 'sglang'"),
        ({"path": "metrics"}, "must start with '/'"),
        ({"interval": 0}, "greater than 0"),
    ):
        with pytest.raises(ValidationError, match=reason):
            ServiceSpec.model_validate(spec(load_metrics=bad))
