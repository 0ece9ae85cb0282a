"""The spec's ``upstream_tls``: its shape checked by validation (paths absolute, a client
certificate with its key), its files when the spec is applied (a refusal names the field
and changes nothing), carried to the data plane in the routing (and across to workers as
paths, never a context), and ``verify: false`` said in the service's view."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trustme
from pydantic import ValidationError

from controller.admin.views import spec_warnings
from controller.errors import SpecError
from controller.spec import ServiceSpec
from gateway.config import ServiceRouting, UpstreamTlsConfig, dump_settings, parse_settings

from .conftest import Harness, spec


def files(ca: trustme.CA, directory: Path) -> dict[str, str]:
    """A CA file and a client certificate and key it issued, as ``upstream_tls`` names them."""
    issued = ca.issue_cert("gateway.client")
    paths = {"ca": directory / "ca.pem", "cert": directory / "c.pem", "key": directory / "k.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    issued.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    issued.private_key_pem.write_to_path(str(paths["key"]))
    return {name: str(path) for name, path in paths.items()}


def test_absent_is_plain_and_given_reaches_the_routing_and_the_workers_channel(
    ca: trustme.CA, tmp_path: Path
) -> None:
    assert ServiceSpec.model_validate(spec()).routing().upstream_tls is None
    tls = {**files(ca, tmp_path), "server_name": "replica.test", "verify": True}
    routing = ServiceSpec.model_validate(spec(upstream_tls=tls)).routing()
    assert routing.upstream_tls == UpstreamTlsConfig(**tls)
    sent = parse_settings(ServiceRouting, dump_settings(routing))
    assert sent.upstream_tls == routing.upstream_tls
    assert dump_settings(routing)["upstream_tls"] == tls  # paths: each process reads them


@pytest.mark.parametrize(
    ("tls", "reason"),
    [
        ({"cert": "/c.pem"}, "cert and key go together"),
        ({"key": "/k.pem"}, "cert and key go together"),
        ({"ca": "ca.pem"}, "must be an absolute path"),
        ({"cert": "/c.pem", "key": "k.pem"}, "must be an absolute path"),
        ({"server_name": "bad name"}, "server_name"),
        ({"verify": "sometimes"}, "verify"),
        ({"sni": "x"}, "sni"),
    ],
)
def test_a_bad_shape_is_refused_naming_the_field(tls: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValidationError, match=reason) as caught:
        ServiceSpec.model_validate(spec(upstream_tls=tls))
    assert caught.value.errors()[0]["loc"][0] == "upstream_tls"


@pytest.mark.parametrize(
    ("broken", "field", "reason"),
    [
        ("missing ca", "upstream_tls.ca", "cannot read"),
        ("ca not PEM", "upstream_tls.ca", "holds no PEM certificate"),
        ("missing key", "upstream_tls.key", "cannot read"),
        ("key of another", "upstream_tls.cert", "are not a PEM certificate and its key"),
    ],
)
async def test_files_that_cannot_be_used_are_refused_at_apply_and_change_nothing(
    h: Harness, ca: trustme.CA, tmp_path: Path, broken: str, field: str, reason: str
) -> None:
    tls = files(ca, tmp_path)
    if broken == "missing ca":
        tls["ca"] = str(tmp_path / "nowhere.pem")
    elif broken == "ca not PEM":
        Path(tls["ca"]).write_text("not a certificate\n")
    elif broken == "missing key":
        tls["key"] = str(tmp_path / "nowhere.key")
    else:
        trustme.CA().issue_cert("other").private_key_pem.write_to_path(tls["key"])
    await h.controller.apply(spec())
    before = h.state("web").spec
    with pytest.raises(SpecError, match=reason) as caught:
        await h.controller.apply(spec(upstream_tls=tls))
    assert caught.value.errors[0]["field"] == field
    assert h.state("web").spec == before
    with pytest.raises(SpecError, match=reason):
        await h.controller.apply(spec("other", upstream_tls=tls))
    assert "other" not in h.controller.reconciler.services


async def test_usable_files_apply_to_the_pool_without_a_new_revision(
    h: Harness, ca: trustme.CA, tmp_path: Path
) -> None:
    await h.controller.apply(spec())
    result = await h.controller.apply(spec(upstream_tls=files(ca, tmp_path)))
    assert (result.action, result.revision, result.changes) == ("updated", 1, ("upstream_tls",))
    assert h.pool.services["web"].routing.upstream_tls is not None


def test_verify_false_is_a_warning_of_the_view() -> None:
    assert spec_warnings(ServiceSpec.model_validate(spec())) == []
    checked = ServiceSpec.model_validate(spec(upstream_tls={}))
    assert spec_warnings(checked) == []
    unchecked = ServiceSpec.model_validate(spec(upstream_tls={"verify": False}))
    [warning] = spec_warnings(unchecked)
    assert warning.startswith("upstream_tls.verify is false")
