"""The rollout strategy, preview and sticky fields of a spec: defaults, and each bad one
refused with its field and reason."""

from __future__ import annotations

from typing import Any

import pytest

from controller.errors import SpecError
from controller.operations import validate_spec
from controller.spec import RolloutStrategy, ServiceSpec


def spec(**fields: Any) -> dict[str, Any]:
    return {
        "name": "hello",
        "route": {"hosts": ["hello.example.com"]},
        "replica": {"commands": ["serve"]},
        **fields,
    }


def test_rolling_is_the_default() -> None:
    s = validate_spec(spec())
    assert s.rollout.strategy == "rolling"
    assert s.rollout.analysis is None
    assert s.preview.allow == "off"
    assert s.sticky is None


def test_canary_steps_and_analysis() -> None:
    s = validate_spec(
        spec(
            rollout={
                "strategy": "canary",
                "steps": [{"weight": 5, "pause": "2m"}, {"weight": 25, "pause": "5m"}],
                "analysis": {"max_error_rate": "1%", "min_requests": 100, "interval": "5s"},
            }
        )
    )
    steps = s.rollout.canary_steps
    assert [(st.weight, st.pause) for st in steps] == [(5, 120.0), (25, 300.0), (100, None)]
    assert s.rollout.analysis is not None
    assert s.rollout.analysis.max_error_rate == pytest.approx(0.01)
    assert s.rollout.analysis.interval == 5.0


def test_canary_without_steps_takes_the_default_ones() -> None:
    weights = [st.weight for st in RolloutStrategy(strategy="canary").canary_steps]
    assert weights == [10, 50, 100]


def test_the_strategy_is_not_part_of_the_revision() -> None:
    a = ServiceSpec.model_validate(spec())
    b = ServiceSpec.model_validate(
        spec(rollout={"strategy": "blue_green"}, preview={"allow": "anyone"})
    )
    assert a.template_key() == b.template_key()
    assert b.routing().preview.allow == "anyone"


@pytest.mark.parametrize(
    ("fields", "where", "reason"),
    [
        ({"rollout": {"strategy": "canary", "steps": [{"weight": 0}]}}, "weight", "greater"),
        ({"rollout": {"strategy": "canary", "steps": [{"weight": 101}]}}, "weight", "less"),
        (
            {"rollout": {"strategy": "canary", "steps": [{"weight": 50}, {"weight": 20}]}},
            "rollout",
            "weights must rise, 20 follows 50",
        ),
        (
            {"rollout": {"strategy": "canary", "steps": [{"weight": 100}, {"weight": 100}]}},
            "rollout",
            "weights must rise",
        ),
        ({"rollout": {"steps": [{"weight": 5}]}}, "rollout", "only for strategy canary"),
        (
            {"rollout": {"analysis": {"max_error_rate": 0.1}}},
            "rollout",
            "analysis: only for strategy canary or blue_green",
        ),
        (
            {"rollout": {"strategy": "canary", "analysis": {"max_error_rate": 2}}},
            "max_error_rate",
            "less than or equal to 1",
        ),
        (
            {"rollout": {"strategy": "canary", "analysis": {"max_error_rate": "x%"}}},
            "max_error_rate",
            "a fraction (0.01) or a percentage",
        ),
        ({"rollout": {"strategy": "gradual"}}, "strategy", "rolling"),
        ({"preview": {"allow": "everyone"}}, "preview.allow", "off"),
        ({"preview": {"header": "bad header"}}, "preview.header", "not a header name"),
        ({"preview": {"tokens": ["secret"]}}, "preview.tokens", "SHA-256 digest"),
        ({"sticky": {}}, "sticky", "a header or a cookie"),
        ({"sticky": {"header": "a", "cookie": "b"}}, "sticky", "a header or a cookie"),
    ],
)
def test_a_bad_field_is_refused_with_its_field_and_reason(
    fields: dict[str, Any], where: str, reason: str
) -> None:
    with pytest.raises(SpecError) as caught:
        validate_spec(spec(**fields))
    message = str(caught.value.message)
    assert where in message
    assert reason in message
