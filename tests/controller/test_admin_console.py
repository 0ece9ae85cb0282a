"""The web console's routes (``controller/admin/console.py``): served without a token, from
the files it lists, with the headers that keep the page's code its own; and the page's code
held to the rules the browser tests rely on (tests/e2e/test_console.py drives it).
"""

from __future__ import annotations

import re
import tomllib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from controller.admin import console
from controller.admin.app import OPEN_PATHS, build_admin_app
from tests.support.admin_client import AdminClientFactory

from .conftest import Harness

TOKEN = "console-test-token"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def client(h: Harness, admin_client: AdminClientFactory):
    return await admin_client(build_admin_app(h.controller, lambda: True, TOKEN))


def test_the_files_served_are_the_files_shipped() -> None:
    assert sorted(p.name for p in console.UI.iterdir()) == sorted(console.FILES)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["controller.admin"]
    for name in console.FILES:
        assert any(Path("ui", name).match(g) for g in globs), name
    assert console.PATHS <= OPEN_PATHS


async def test_the_page_and_its_files_need_no_token_and_carry_the_policy(client) -> None:
    for path in sorted(console.PATHS):
        response = await client.get(path)
        assert response.status == 200, path
        body = await response.read()
        assert body
        headers = response.headers
        csp = headers["Content-Security-Policy"]
        for directive in (
            "default-src 'self'",
            "script-src 'self'",
            "style-src 'self'",
            "connect-src 'self'",
            "frame-ancestors 'none'",
        ):
            assert directive in csp
        assert "unsafe" not in csp
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Cache-Control"] == "no-cache"
        expected = {".js": "text/javascript", ".css": "text/css"}.get(
            Path(path).suffix, "text/html"
        )
        assert response.content_type == expected
        again = await client.get(path, headers={"If-None-Match": headers["ETag"]})
        assert again.status == 304
        assert not await again.read()


async def test_the_api_the_page_reads_still_needs_the_token(client) -> None:
    assert (await client.get("/api/services")).status == 401
    assert (await client.get("/api/events")).status == 401
    assert (await client.post("/api/services/web/scale", json={"replicas": 3})).status == 401
    assert (await client.get("/ui/nothing.js")).status == 401  # not the console's: the API's rule


async def test_the_document_lists_the_console_as_open_routes(client) -> None:
    doc = await (
        await client.get("/api/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    ).json()
    for path in console.PATHS:
        assert doc["paths"][path]["get"]["security"] == []
    assert (await client.get("/?x=1")).status == 400  # as any route: an unknown parameter


class _Markup(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []
        self.sources: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "style":
            self.problems.append("a <style> element")
        if tag == "script" and not named.get("src"):
            self.problems.append("an inline <script>")
        for name, value in attrs:
            if name == "style" or name.startswith("on"):
                self.problems.append(f"{name}= on <{tag}>")
            if name in ("src", "href") and value and not value.startswith(("/", "data:")):
                self.problems.append(f"{name}={value} leaves the gateway")
            if name in ("src", "href") and value and value.startswith("/"):
                self.sources.append(value)


def test_the_page_has_no_inline_code_and_fetches_nothing_from_elsewhere() -> None:
    markup = _Markup()
    markup.feed((console.UI / "index.html").read_text())
    assert not markup.problems
    assert set(markup.sources) <= console.PATHS
    for name in console.FILES:
        if not name.endswith(".js"):
            continue
        code = (console.UI / name).read_text()
        for imported in re.findall(r"""from\s+["']([^"']+)["']""", code):
            assert imported.startswith("./"), (name, imported)
            assert imported[2:] in console.FILES, (name, imported)
        assert "http://" not in code.replace("http://www.w3.org/2000/svg", ""), name
        assert "https://" not in code, name


@pytest.mark.parametrize(
    "pattern",
    [r"\.innerHTML", r"\.outerHTML", r"insertAdjacentHTML", r"document\.write", r"\beval\(",
     r"new Function", r"localStorage", r"document\.cookie", r"createContextualFragment"],
)  # fmt: skip
def test_no_module_turns_data_into_markup_or_keeps_the_token_past_the_tab(pattern: str) -> None:
    """Names and reasons the API returns are user input: the modules build text nodes
    (dom.js), and the token lives in sessionStorage only."""
    for name in console.FILES:
        if name.endswith(".js"):
            code = re.sub(r"^\s*//.*$", "", (console.UI / name).read_text(), flags=re.M)
            assert not re.search(pattern, code), (name, pattern)
