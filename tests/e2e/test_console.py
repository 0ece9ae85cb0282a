"""The web console in a real browser (Debian's chromium and chromium-driver, driven by
Selenium) against a real gateway and real replicas: what it lists, how it follows events
without a reload, its actions, its escaping, and its refusal without the token.

The gateway runs on this test's event loop, so every browser call runs in a thread
(``Page``): a blocking WebDriver call on the loop would stop the gateway answering the page.

Screenshots of the main views go to the test's tmp_path, or, with
``GATEWAY_CONSOLE_SCREENSHOTS=docs``, into docs/ (how the README's pictures are refreshed;
CI leaves the tree as it is).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.journal import Entry
from tests.needs import missing
from tests.support.eventually import eventually

from .conftest import PROBE, ROLLOUT, ROOT, Gateways, Handle, Load, serving, spec

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
REPLICA = Path(__file__).with_name("canary_replica.py")
HOSTILE = "<img src=x onerror=alert(1)>"
"""In a replica's failure reason (its working directory's name): shown as text, run never."""
HTML_LIKE_NAME = "img-src-x-onerror-alert-1"
"""A service name is a DNS label (``spec.NAME_PATTERN``): no ``<``, ``>``, quote or space
can be in one; this is as HTML-like as one gets."""


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing("selenium not installed (the project's [test] extra)", module=True)
    for binary, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if shutil.which(binary) is None:
            missing(f"{binary} not installed (Debian package {package!r}; .ci/run installs it)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,1100",
                     "--disable-background-networking", "--no-first-run"):  # fmt: skip
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver's path given: Selenium Manager never looks for (or downloads) one.
    browser = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield browser
    finally:
        browser.quit()


def _screenshots(tmp_path: Path) -> Path:
    target = os.environ.get("GATEWAY_CONSOLE_SCREENSHOTS")
    if not target:
        return tmp_path
    directory = ROOT / target if not Path(target).is_absolute() else Path(target)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class Page:
    """The console of one gateway in the browser; every WebDriver call off the loop."""

    def __init__(self, driver: Any, handle: Handle, shots: Path) -> None:
        self.driver = driver
        self.base = f"http://127.0.0.1:{handle.gateway.admin.port}"
        self.shots = shots

    async def call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def js(self, script: str, *args: Any) -> Any:
        return await self.call(self.driver.execute_script, script, *args)

    async def open(self, token: str | None = None) -> None:
        await self.call(self.driver.get, self.base + "/")
        if token is not None:
            await self.js("sessionStorage.setItem('gateway-admin-token', arguments[0])", token)
            await self.call(self.driver.get, self.base + "/")
        await self.js("window.sameDocument = true")  # gone if the page reloads

    async def eventually(self, script: str, *args: Any, timeout: float = 15, what: str = "") -> Any:
        """The first truthy value ``script`` returns in the page (``eventually`` on it)."""
        return await eventually(
            lambda: self.js(script, *args), timeout=timeout, every=0.05, what=what or script
        )

    async def click(self, selector: str) -> None:
        """A real click on the element; again if a refresh replaced it meanwhile."""
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.common.by import By

        async def clicked() -> bool:
            try:
                element = await self.call(self.driver.find_element, By.CSS_SELECTOR, selector)
                await self.call(element.click)
            except StaleElementReferenceException:
                return False
            return True

        await eventually(clicked, timeout=1, every=0.05, what=f"{selector} not replaced")

    async def act(self, service: str, action: str, replicas: int | None = None) -> str:
        """Click an action's button, confirm, and answer the toast that says how it went."""
        before = await self.js("return document.querySelectorAll('.toast').length")
        await self.click(
            f'section.service[data-service="{service}"] button[data-action="{action}"]'
        )
        await self.eventually("return document.getElementById('confirm').open", what="the dialog")
        text = await self.js("return document.getElementById('confirm-text').textContent")
        assert service in text
        if replicas is not None:
            from selenium.webdriver.common.by import By

            field = await self.call(self.driver.find_element, By.ID, "confirm-number")
            await self.call(field.clear)
            await self.call(field.send_keys, str(replicas))
        await self.click("#confirm-ok")
        toasts = "return [...document.querySelectorAll('.toast')].map(t => t.textContent)"
        await self.eventually(
            f"return {toasts[7:]}.length > arguments[0]", before, what="the outcome"
        )
        return str((await self.js(toasts))[-1])

    async def services(self) -> list[str]:
        script = (
            "return [...document.querySelectorAll('section.service')].map(s => s.dataset.service)"
        )
        return list(await self.js(script))

    async def row(self, replica: str) -> dict[str, Any] | None:
        return await self.js(  # type: ignore[no-any-return]
            """const row = [...document.querySelectorAll('tr.replica')]
                 .find(r => r.dataset.replica === arguments[0]);
               return row && {state: row.dataset.state, health: row.dataset.health,
                              bad: row.classList.contains('bad'), text: row.textContent};""",
            replica,
        )

    async def reloaded(self) -> bool:
        return not await self.js("return window.sameDocument === true")

    async def errors(self) -> list[str]:
        """What the page's scripts logged as errors (failed requests aside: a 401 is a test)."""
        logs = await self.call(self.driver.get_log, "browser")
        return [e["message"] for e in logs if e["level"] == "SEVERE" and e["source"] != "network"]

    async def screenshot(self, name: str) -> Path:
        path = self.shots / name
        await self.call(self.driver.save_screenshot, str(path))
        return path


@pytest.fixture
def page_for(driver: Any, tmp_path: Path) -> Any:
    def make(handle: Handle) -> Page:
        driver.get("about:blank")
        driver.get_log("browser")  # what an earlier test's page logged
        return Page(driver, handle, _screenshots(tmp_path))

    return make


def canary_spec(version: str, replicas: int = 2, **rollout: Any) -> dict[str, Any]:
    return {
        "name": "web",
        "route": {"path_prefix": "/"},
        "replicas": replicas,
        "replica": {
            "commands": [f"{sys.executable} {REPLICA}"],
            "env": {"VERSION": version},
        },
        "probes": [{"type": "http", "path": "/healthz", "interval": 0.1, "timeout": 0.5}],
        "rollout": ROLLOUT | rollout,
    }


def choose(page: Page, select: str, value: str) -> None:
    """Pick ``value`` in the ``select`` element as a user does (blocking: call off the loop)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(page.driver.find_element(By.ID, select)).select_by_value(value)


def heard(handle: Handle, kind: str) -> list[tuple[float, Entry]]:
    """Each journal entry of ``kind`` from now on, with when it was recorded (monotonic)."""
    out: list[tuple[float, Entry]] = []
    handle.controller.journal.listen(
        lambda e: out.append((time.monotonic(), e)) if e.kind == kind else None
    )
    return out


async def test_the_page_lists_the_services_and_follows_a_failing_replica_without_a_reload(
    gateways: Gateways, page_for: Any, site: Any
) -> None:
    gw = await gateways.start()
    await serving(gw, spec(site("v1"), 3))
    # Nothing listens on port 9 of loopback (discard): its only upstream stays unhealthy.
    down = {"name": "api", "backend": "static", "route": {"path_prefix": "/api"},
            "replica": {"addresses": ["127.0.0.1:9"]}, "probes": [PROBE]}  # fmt: skip
    await gw.controller.apply(down)
    page = page_for(gw)
    await page.open()
    await page.eventually(
        "return document.querySelectorAll('section.service[data-service=\"web\"] tr.replica')"
        ".length === 3"
    )
    assert await page.services() == ["api", "web"]
    notice = await page.js("return document.getElementById('no-token').textContent")
    assert "No admin token is configured" in notice
    assert await page.js("return document.getElementById('stream').dataset.state") == "live"

    # SIGSTOP: the replica still runs and its probes time out: the data plane's verdict.
    unhealthy = heard(gw, "upstream_unhealthy")
    stopped, killed, _ = sorted(gw.pids().items())
    os.kill(stopped[1], signal.SIGSTOP)
    try:
        await page.eventually(
            "return [...document.querySelectorAll('tr.replica')].some(r =>"
            " r.dataset.replica === arguments[0] && r.dataset.health === 'unhealthy')",
            stopped[0], what="the stopped replica's row to turn unhealthy",
        )  # fmt: skip
        seen = time.monotonic()
        event = next(at for at, e in unhealthy if e.replica == stopped[0])
        print(f"row turned {seen - event:.3f}s after the event")
        assert seen - event < 1.0
        row = await page.row(stopped[0])
        assert row is not None
        assert row["bad"]
    finally:
        os.kill(stopped[1], signal.SIGCONT)

    # SIGKILL: the replica exits, and its row says it failed.
    os.kill(killed[1], signal.SIGKILL)
    await page.eventually(
        "return [...document.querySelectorAll('tr.replica')].some(r =>"
        " r.dataset.replica === arguments[0] && r.dataset.state === 'failed'"
        " && r.classList.contains('bad'))",
        killed[0], what="the killed replica's row to say failed",
    )  # fmt: skip
    row = await page.row(killed[0])
    assert row is not None
    assert "exited" in row["text"] or "signal" in row["text"], row
    events = await page.js(
        "return [...document.querySelectorAll('#events li')].map(li => li.dataset.kind)"
    )
    assert "upstream_unhealthy" in events
    assert "replica_failed" in events
    # The event log, filtered by service.
    for name in ("api", "web"):
        await page.call(choose, page, "events-service", name)
        shown = await page.js(
            "return [...document.querySelectorAll('#events li')].map(li => li.dataset.service)"
        )
        assert shown, name
        assert set(shown) == {name}
    assert not await page.reloaded()
    assert not await page.errors()


@pytest.mark.slow
async def test_a_canary_moves_on_the_page_and_promote_and_scale_do_what_the_cli_does(
    gateways: Gateways, page_for: Any
) -> None:
    gw = await gateways.start()
    steps = [{"weight": 20, "pause": 3}, {"weight": 50}]  # held at 50% until promoted
    analysis = {"max_error_rate": 0.01, "min_requests": 20, "interval": 1}
    canary = {"strategy": "canary", "steps": steps, "analysis": analysis}
    await serving(gw, canary_spec("1", **canary))
    page = page_for(gw)
    await page.open()
    await page.eventually("return document.querySelector('section.service[data-service=\"web\"]')")
    weight = (
        "const w = document.querySelector('section.service[data-service=\"web\"] .weight');"
        " return w && Number(w.dataset.weight);"
    )
    async with Load(gw.url, clients=2, limit=120) as load:
        await gw.controller.apply(canary_spec("2", **canary))
        seen = [await page.eventually(weight, what="a weight on the page")]

        async def at_50() -> bool:
            value = await page.js(weight)
            if value and value != seen[-1]:
                seen.append(value)
            assert seen[-1] == 50, seen  # the weights seen so far are in the failure
            return True

        await eventually(at_50, timeout=30, every=0.05, what="a weight of 50")
        assert seen == [20, 50], seen
        step = await page.js(
            "return document.querySelector('section.service[data-service=\"web\"] .step')"
            ".textContent"
        )
        assert step == "step 2 of 3"
        analysed = await page.eventually(
            "const a = document.querySelector('section.service[data-service=\"web\"] .analysis');"
            " return a && a.textContent.includes('error rate') && a.textContent;",
            what="the last analysis with its figures",
        )
        assert "pass" in analysed, analysed
        # The charts have a point once two scrapes (5 s apart) have been taken.
        await page.eventually(
            "const c = document.querySelector('section.service[data-service=\"web\"]"
            " svg.chart'); return c && Number(c.dataset.points) >= 3;",
            timeout=30, what="three points of the request rate charted",
        )  # fmt: skip
        shot = await page.screenshot("console.png")

        promoted = heard(gw, "rollout_promoted")
        outcome = await page.act("web", "promote")
        assert "Promote web: rollout" in outcome, outcome
        await eventually(
            lambda: gw.state().observed.rollout is None,
            timeout=30,
            what="the promoted canary's end",
        )
        assert promoted
        record = gw.rollouts()[0]
        assert (record.status, record.to_revision) == ("complete", 2)
        assert gw.state().observed.serving_revision == 2
        await page.eventually(
            "return !document.querySelector('section.service[data-service=\"web\"] .rollout')",
            what="the rollout to leave the page",
        )
        assert load.bodies(load.mark()) <= {"v2"}
        await load.more(20)

    outcome = await page.act("web", "scale", replicas=3)
    assert "Scale web: scaled" in outcome, outcome
    await eventually(lambda: gw.ready(2) == 3, timeout=20, what="3 ready replicas")
    assert gw.state().desired.replicas == 3  # as `gateway scale web 3` leaves it
    await page.eventually(
        "return document.querySelector('section.service[data-service=\"web\"] .ready')"
        ".textContent === '3/3 ready'",
        what="3/3 ready on the page",
    )
    assert not load.failures, load.summary()
    assert not await page.reloaded()
    assert not await page.errors()
    print(f"screenshot: {shot}")


async def test_names_and_reasons_are_shown_as_text_and_a_failed_rollout_says_why_on_top(
    gateways: Gateways, page_for: Any, site: Any
) -> None:
    gw = await gateways.start()
    name = HTML_LIKE_NAME
    good = spec(site("v1"), 1, name=name, retries=1)
    await gw.controller.apply(good)
    await eventually(lambda: gw.ready(1, name=name) == 1, timeout=20, what="the service serving")
    page = page_for(gw)
    await page.open()
    await page.eventually("return document.querySelectorAll('tr.replica').length === 1")
    assert await page.services() == [name]

    missing_dir = Path("/nonexistent") / HOSTILE  # each start fails, naming it
    await gw.controller.apply(spec(str(missing_dir), 1, name=name, retries=1))
    await eventually(
        lambda: any(r.to_revision == 2 and r.status == "failed" for r in gw.rollouts(name)),
        timeout=30,
        what="the rollout to fail",
    )
    section = f'section.service[data-service="{name}"]'
    alert = await page.eventually(
        f"const a = document.querySelector('{section} .alert-failed'); return a && a.textContent",
        what="the failed rollout's alert",
    )
    assert "rollout 2 to r2 failed" in alert
    assert HOSTILE in alert, alert
    first = await page.js(f"return document.querySelector('{section}').children[1].className")
    assert "alert-failed" in first  # the first thing under the service's name
    rows = await page.eventually(
        "return [...document.querySelectorAll('td.reason')].map(td => td.textContent)"
        ".filter(t => t.includes(arguments[0]))",
        HOSTILE, what="the failure reason in a replica's row",
    )  # fmt: skip
    assert rows
    events = await page.js(
        "return [...document.querySelectorAll('#events .event-message')]"
        ".map(m => m.textContent).filter(t => t.includes(arguments[0]))",
        HOSTILE,
    )
    assert events
    # Shown, never parsed: no image element, no handler ran, no alert open.
    assert await page.js("return document.querySelectorAll('img').length") == 0
    with pytest.raises(Exception, match="no such alert"):
        await page.call(lambda: page.driver.switch_to.alert.text)
    await page.screenshot("console-failure.png")
    # The old revision serves on.
    assert gw.state(name).observed.serving_revision == 1
    assert not await page.errors()


async def test_without_the_token_the_page_shows_nothing_and_its_actions_are_refused(
    gateways: Gateways, page_for: Any, site: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = "console-e2e-admin-token"
    monkeypatch.setenv("CONSOLE_TEST_ADMIN_TOKEN", token)
    gw = await gateways.start(
        admin={"listen": "127.0.0.1:0", "token_env": "CONSOLE_TEST_ADMIN_TOKEN"}
    )
    await serving(gw, spec(site("v1"), 1))
    page = page_for(gw)
    await page.open()
    await page.eventually("return document.getElementById('token-needed')", what="the token prompt")
    assert await page.services() == []
    assert await page.js("return document.getElementById('stream').dataset.state") == (
        "unauthorized"
    )

    # Entered once, kept for the tab: never in the URL, never a cookie.
    from selenium.webdriver.common.by import By

    field = await page.call(page.driver.find_element, By.ID, "token-input")
    await page.call(field.send_keys, token)
    await page.click("#token-use")
    await page.eventually("return document.querySelectorAll('section.service').length === 1")
    assert await page.js("return sessionStorage.getItem('gateway-admin-token')") == token
    assert token not in await page.js("return location.href")
    assert await page.js("return document.cookie") == ""

    # The token gone from the tab (as in another tab, or forgotten): the API refuses.
    await page.js("sessionStorage.removeItem('gateway-admin-token')")
    outcome = await page.act("web", "scale", replicas=4)
    assert "refused (401)" in outcome, outcome
    assert gw.state().desired.replicas == 1
    await page.js("sessionStorage.setItem('gateway-admin-token', 'wrong-token')")
    outcome = await page.act("web", "undo")
    assert "refused (401)" in outcome, outcome
    await page.click("#token-forget")
    await page.eventually("return document.querySelectorAll('section.service').length === 0")
    assert await page.js("return sessionStorage.getItem('gateway-admin-token')") is None


METRICS_BEFORE = """\
# TYPE gateway_requests counter
gateway_requests_total{code="2xx",revision="1",service="web"} 0
gateway_requests_total{code="5xx",revision="2",service="web"} 0
gateway_request_duration_seconds_bucket{le="0.01",revision="1",service="web"} 0
gateway_request_duration_seconds_bucket{le="0.1",revision="1",service="web"} 0
gateway_request_duration_seconds_bucket{le="+Inf",revision="1",service="web"} 0
gateway_requests_total{code="2xx",revision="1",service="a\\\\b\\"c"} 7
"""
METRICS_AFTER = """\
gateway_requests_total{code="2xx",revision="1",service="web"} 90
gateway_requests_total{code="5xx",revision="2",service="web"} 10
gateway_request_duration_seconds_bucket{le="0.01",revision="1",service="web"} 30
gateway_request_duration_seconds_bucket{le="0.01",revision="2",service="web"} 20
gateway_request_duration_seconds_bucket{le="0.1",revision="1",service="web"} 60
gateway_request_duration_seconds_bucket{le="0.1",revision="2",service="web"} 30
gateway_request_duration_seconds_bucket{le="+Inf",revision="1",service="web"} 65
gateway_request_duration_seconds_bucket{le="+Inf",revision="2",service="web"} 35
gateway_service_held_requests{service="web"} 3
gateway_requests_total{code="2xx",revision="1",service="a\\\\b\\"c"} 2
"""


async def test_the_charts_arithmetic_is_prometheus_own(gateways: Gateways, page_for: Any) -> None:
    """The page's rates and quantiles (ui/metrics.js, run in the browser) on a known pair of
    scrapes: summed over revisions, the 5xx share, p50 inside a bucket, p99 in the +Inf one
    (its lower bound, as histogram_quantile), a counter gone back (a restart) not a rate, and
    a label value with escapes read whole."""
    gw = await gateways.start()
    page = page_for(gw)
    await page.open()
    result = await page.call(
        page.driver.execute_async_script,
        """const [before, after, done] = arguments;
           import('/ui/metrics.js').then((m) => {
             const a = m.snapshot(m.parse(before));
             const b = m.snapshot(m.parse(after));
             done(Object.fromEntries(m.rates(a, b, 10)));
           }, (e) => done(String(e)));""",
        METRICS_BEFORE,
        METRICS_AFTER,
    )
    assert result["web"] == {
        "rps": 10, "errorRate": 0.1, "p50": 0.01, "p99": 0.1, "held": 3, "queued": 0
    }  # fmt: skip
    assert result['a\\b"c']["rps"] is None  # 7 -> 2: a restart, no rate


async def test_the_overview_reads_the_fields_the_api_documents(
    gateways: Gateways, page_for: Any
) -> None:
    """Certificates, the cluster and the hosts as the page draws them (ui/views.js, in
    chromium) from bodies made with the API's own response models, so a field the page
    reads under another name fails here."""
    from controller.admin.bodies import (
        CertificateList,
        CertificateView,
        ClusterNodeView,
        ClusterView,
        HostList,
        HostView,
        TlsCertificateView,
        TlsRefusalView,
        TlsView,
    )

    now = time.time()
    tls = TlsView(
        enabled=True,
        certificates=[
            TlsCertificateView(name="files.example", names=["files.example", "*.files.example"],
                               not_after=now + 40 * 86400, cert_file="/c", key_file="/k",
                               acme=False),
        ],
        refused=[TlsRefusalView(cert_file="/bad", key_file="/bad.key", file="/bad",
                                reason="not PEM <b>")],
        reload_failures=1,
        handshakes={},
    )  # fmt: skip
    acme = CertificateList(
        enabled=True,
        directory="https://acme.test/dir",
        certificates=[
            CertificateView(name="app.example", services=["web"], state="failing",
                            names=["app.example"], issuer=None, not_before=None,
                            not_after=now + 3 * 86400, next_order=now + 60, ordering=False,
                            failures=2, last_error="the CA said no"),
        ],
    )  # fmt: skip
    cluster = ClusterView(
        store="etcd", node="n1", leader="n2", store_reachable=True,
        nodes=[
            ClusterNodeView(name="n1", address="http://127.0.0.2:8081", leader=False,
                            started_at=now, replicas=2, capacity=8),
            ClusterNodeView(name="n2", address="http://127.0.0.3:8081", leader=True,
                            started_at=now, replicas=1, capacity=8),
        ],
    )  # fmt: skip
    hosts = HostList(
        hosts=[
            HostView(backend="docker", name="gpu1", engine="tcp://10.0.0.7:2376",
                     reachable=False, error="connect refused", replicas=0, capacity=8),
        ]
    )  # fmt: skip
    gw = await gateways.start()
    page = page_for(gw)
    await page.open()
    result = await page.call(
        page.driver.execute_async_script,
        """const [tls, acme, cluster, hosts, done] = arguments;
           import('/ui/views.js').then((v) => {
             const text = (el) => el.textContent;
             const bad = (el) => [...el.querySelectorAll('tr.bad')].map((r) => r.textContent);
             const c = v.certificatesView(tls, acme), n = v.clusterView(cluster);
             const hs = v.hostsView(hosts.hosts);
             done({certificates: text(c), badCertificates: bad(c), cluster: text(n),
                   leader: n.querySelector('tr.leader').dataset.node, hosts: text(hs),
                   badHosts: bad(hs),
                   node: v.nodeOf('127.0.0.3:21000', cluster)});
           }, (e) => done(String(e)));""",
        tls.model_dump(mode="json"),
        acme.model_dump(mode="json"),
        cluster.model_dump(mode="json"),
        hosts.model_dump(mode="json"),
    )
    assert isinstance(result, dict), result
    certificates = result["certificates"]
    assert "files.example" in certificates
    assert "expires in 40d" in certificates or "expires in 39d" in certificates
    assert "not PEM <b>" in certificates
    failing = " ".join(result["badCertificates"])
    assert "app.example" in failing  # failing, and expiring within a week
    assert "the CA said no" in failing
    assert result["leader"] == "n2"
    assert "2/8 replicas" in result["cluster"]
    assert result["node"] == "n2"
    assert "gpu1" in " ".join(result["badHosts"])
    assert "connect refused" in result["hosts"]
