"""The autoscaling part of a service spec: ``replicas`` as a range, ``scaling``, and what the
autoscaler (``controller.planning.autoscaler``) works with for one service (``Autoscaling``).

A plain count keeps its meaning (fixed); ``{min, max}`` or ``"min..max"`` makes the service
autoscaled within that range, on ``scaling``'s metric and target.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from gateway import Duration

from .schema import Model

MAX_REPLICAS = 100

ScalingMetric = Literal["concurrency", "rps", "queue"]
"""``concurrency``: requests in flight (and held) per replica; ``rps``: requests completed
per second per replica; ``queue``: requests the replicas themselves report waiting, per
replica (``load_metrics``)."""

GATEWAY_METRICS: tuple[ScalingMetric, ...] = ("concurrency", "rps")
"""The metrics read from the gateway's own tallies; the others need ``load_metrics``."""

COLD_START_QUEUE_TIMEOUT = 30.0
"""A ``min: 0`` service holds a request this long by default: long enough for a replica to
start and pass its probe (Knative's activator waits as long)."""


class ReplicaRange(Model):
    """``replicas: {min, max}`` (or ``"min..max"``): the autoscaler keeps the count within."""

    min: int = Field(ge=0, le=MAX_REPLICAS)
    max: int = Field(ge=1, le=MAX_REPLICAS)

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class ScalingConfig(Model):
    """How the autoscaler reads a service's traffic (``controller.planning.autoscaler``)."""

    metric: ScalingMetric = "concurrency"
    """``concurrency`` reads long streams as the load they are; ``rps`` counts completions;
    ``queue`` reads the replicas' own waiting requests (the service needs ``load_metrics``)."""
    target: float = Field(default=10.0, gt=0, le=1_000_000)
    """The metric's value per replica the autoscaler aims at."""
    window: Duration = 60.0
    """The mean over this long sizes a scale-down (Knative's stable window; 0: the latest
    sample). Durations here have no upper bound: JSON Schema cannot hold a duration written
    as a string ("2h") to one, and the API document must refuse what the API refuses."""
    scale_up_delay: Duration = 6.0
    """A scale-up follows the mean over this long (0: the latest sample): a spike held this
    long scales up (Knative's panic window, 10% of its stable window)."""
    scale_down_delay: Duration = 60.0
    """No scale-down within this long of the last change or of load above target; with
    ``min: 0``, idle this long goes to zero."""


class Autoscaling(Model):
    """What the autoscaler of one service works with: its range and its scaling."""

    min: int
    max: int
    metric: ScalingMetric
    target: float
    window: float
    scale_up_delay: float
    scale_down_delay: float

    def clamp(self, count: int) -> int:
        return max(self.min, min(self.max, count))


def replica_range(value: object) -> object:
    """A count, or a ``ReplicaRange`` from ``{min, max}`` or ``"min..max"``; one clear reason
    when it is neither (rather than one per member of the union)."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]{1,3})\s*\.\.\s*([0-9]{1,3})\s*", value)
        if match is None:
            raise ValueError("a count, {min, max} or 'min..max' (e.g. '0..4')")
        value = {"min": int(match[1]), "max": int(match[2])}
    if isinstance(value, dict):
        try:
            return ReplicaRange.model_validate(value)
        except ValidationError as e:
            reasons = []
            for error in e.errors():
                where = ".".join(str(part) for part in error["loc"])
                message = error["msg"].removeprefix("Value error, ")
                reasons.append(f"{where}: {message}" if where else message)
            raise ValueError("; ".join(reasons)) from None
    if isinstance(value, float) and value.is_integer():
        return int(value)  # JSON has one number type
    if isinstance(value, bool) or (value is not None and not isinstance(value, int)):
        raise ValueError("a count, {min, max} or 'min..max' (e.g. '0..4')")
    return value
