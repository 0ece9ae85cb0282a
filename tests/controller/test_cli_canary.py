"""How the CLI shows a canary: its step, weight and last analysis (``cli.render``)."""

from __future__ import annotations

import io
from typing import Any

from controller.cli.render import progress_text, service_table

ROLLOUT: dict[str, Any] = {
    "id": 4,
    "kind": "rollout",
    "status": "progressing",
    "from_revision": 2,
    "to_revision": 3,
    "failures": 0,
    "retries": 2,
    "reason": "",
    "progress": [
        {"revision": 3, "ready": 1, "desired": 4, "live": 1},
        {"revision": 2, "ready": 4, "desired": 0, "live": 4},
    ],
    "strategy": "canary",
    "step": 2,
    "steps": 3,
    "weight": 25,
    "weights": [5, 25, 100],
    "promoted": False,
    "analysis": "analysis: error rate 0.2% <= 1% over 412 requests at weight 25",
    "verdict": "pass",
}


def test_rollout_status_shows_the_step_weight_and_analysis() -> None:
    text = progress_text(ROLLOUT)
    assert "canary step 2 of 3 at 25%" in text
    assert "analysis: error rate 0.2% <= 1% over 412 requests at weight 25" in text


def test_status_shows_the_weight_in_the_table_and_the_analysis_under_it() -> None:
    out = io.StringIO()
    view = {
        "name": "web",
        "serving_revision": 2,
        "target_revision": 3,
        "ready": 5,
        "desired": 4,
        "status": "progressing",
        "rollout": ROLLOUT,
    }
    service_table([view], out)
    printed = out.getvalue()
    assert "4 progressing canary 2/3 r3 25%" in printed
    assert "web: analysis: error rate 0.2%" in printed
