"""``controller.serving``'s pure start-up decision: for one service of the gateway config, whether
its entry is applied or the store's state stands (issue 22). The restarts themselves are in
tests/e2e/test_restart.py."""

from __future__ import annotations

import pytest

from controller.config import ConfigService, document_digest
from controller.serving import StoredAs, config_differences, startup_choice
from controller.spec import ServiceSpec
from controller.store import ConfigAppliedRow

from .conftest import spec

SOURCE = "services/web.json"


def entry() -> ConfigService:
    document = spec()
    return ConfigService(
        source=SOURCE, digest=document_digest(document), spec=ServiceSpec.model_validate(document)
    )


@pytest.mark.parametrize(
    ("last_digest", "stored", "applied", "says"),
    [
        (None, "absent", True, "web: created from services/web.json"),
        (None, "deleted", True, "web: created from services/web.json"),
        (None, "live", True, "never applied from the config before: applied"),
        ("old", "live", True, "services/web.json changed since last applied: applied"),
        ("old", "deleted", True, "services/web.json changed since last applied: applied"),
        ("same", "live", False, "web: spec from the store"),
        ("same", "deleted", False, "deleted through the API since services/web.json"),
    ],
)
def test_startup_choice(
    last_digest: str | None, stored: StoredAs, applied: bool, says: str
) -> None:
    config = entry()
    last = None
    if last_digest is not None:
        digest = config.digest if last_digest == "same" else document_digest({"other": 1})
        last = ConfigAppliedRow("web", SOURCE, digest, 0.0)
    choice = startup_choice(config, last, stored)
    assert choice.apply is applied
    assert says in choice.reason


def named(name: str, document: dict[str, object], source: str) -> ConfigService:
    return ConfigService(
        source=source,
        digest=document_digest(document),
        spec=ServiceSpec.model_validate({**document, "name": name}),
    )


def test_config_differences_with_the_cluster() -> None:
    same, changed, new = (named(n, spec(), f"services/{n}.json") for n in ("web", "api", "new"))
    applied = [
        ConfigAppliedRow("web", "services/web.json", same.digest, 0.0),
        ConfigAppliedRow("api", "gw-1.yaml services[0]", document_digest({"old": 1}), 0.0),
        ConfigAppliedRow("db", "services/db.json", "d", 0.0),
        ConfigAppliedRow("gone", "services/gone.json", "d", 0.0),  # deleted since
    ]
    live = {"web", "api", "db", "made-by-api"}
    assert config_differences([same, changed, new], applied, live) == [
        "api: services/api.json differs from the document the cluster applied"
        " (from gw-1.yaml services[0])",
        "new: in this config (services/new.json), never applied in the cluster",
        "db: applied in the cluster (from services/db.json), not in this config",
    ]
    assert config_differences([same], applied[:1], live) == []
    assert config_differences([same, new], [], live) == []  # a new cluster: the leader applies
