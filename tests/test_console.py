"""The web console (/ui) of the session node: its login and session, the checks on the
API calls a session makes, and a click-through in a real browser (Debian's chromium,
driven by Playwright): log in, create, a terminal, fork, the lineage, kill."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import websockets
import websockets.sync.client as ws_client
from fastapi import FastAPI

from agentenv.testing import Node
from agentenv.web import console
from agentenv.web.keys import ApiKeys, rotate_api_key
from proxy_attacks import ECHO_PORT, routings, start_header_echo

CHROMIUM = Path("/usr/bin/chromium")
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync"]


def _built() -> None:
    assert (console.ui_dir() / "index.html").is_file(), \
        f"the console is not built in {console.ui_dir()}: run `make ui`"


def _login(node: Node, key: str) -> httpx.Response:
    with httpx.Client(base_url=node.url, timeout=30) as c:
        return c.post("/ui/login", data={"key": key})


def _session(node: Node) -> httpx.Client:
    r = _login(node, node.api_key)
    assert r.status_code == 303, r.text
    return httpx.Client(base_url=node.url, timeout=60,
                        cookies={console.COOKIE: r.cookies[console.COOKIE]})


def test_console_login_session_and_csrf(node: Node) -> None:
    _built()
    with httpx.Client(base_url=node.url, timeout=30) as anon:
        r = anon.get("/ui/")
        assert r.status_code == 303 and r.headers["location"] == "/ui/login"
        assert "<form" in anon.get("/ui/login").text
        assert anon.get("/ui/assets/x.js").status_code == 401
    with httpx.Client(base_url=node.url, timeout=30) as other:  # a login posted cross-site
        r = other.post("/ui/login", data={"key": node.api_key},
                       headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and console.COOKIE not in r.cookies
        r = other.post("/ui/login", content="&".join(f"k{i}=v" for i in range(50)),
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 400
        r = other.post("/ui/login", content="key=" + "x" * 10_000,
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 413
    wrong = _login(node, "aenv_" + "0" * 48)
    assert wrong.status_code == 401 and console.COOKIE not in wrong.cookies
    assert "not this server" in wrong.text

    ok = _login(node, node.api_key)
    cookie = ok.headers["set-cookie"]
    assert ok.status_code == 303 and ok.headers["location"] == "/ui/"
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert node.api_key not in cookie  # a signed session token, never the key
    with _session(node) as s:
        page = s.get("/ui/")
        assert page.status_code == 200 and "agentenv console" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        asset = re.search(r'src="(/ui/assets/[^"]+\.js)"', page.text)
        assert asset and s.get(asset[1]).status_code == 200
        assert s.get("/ui/../secrets/api-key").status_code in (401, 404)
        assert s.get("/v2/sandboxes").status_code == 200
        load = s.get("/load").json()
        assert load["samples"] and {"cpuPct", "memUsedBytes", "running"} <= set(load["samples"][0])
        # A change without the console's header (what a cross-site form sends): refused.
        assert s.post("/sandboxes", json={"templateID": "base"}).status_code == 401
        assert s.delete("/sandboxes/nosuchsandbox").status_code == 401
        # With it, the call reaches the route (which knows no such sandbox).
        r = s.delete("/sandboxes/nosuchsandbox", headers={"X-Aenv-UI": "1"})
        assert r.status_code == 404, r.text
        token = s.cookies[console.COOKIE]
    forged = f"{int(time.time()) + 3600}.{'0' * 64}"
    with httpx.Client(base_url=node.url, cookies={console.COOKIE: forged}) as bad:
        assert bad.get("/ui/").headers["location"] == "/ui/login"
        assert bad.get("/v2/sandboxes").status_code == 401
    # The terminal's socket: a session from another origin, or none, opens nothing.
    ws_url = node.url.replace("http", "ws") + "/ui/sandboxes/nosuchsandbox/terminal"
    for headers in ({"Cookie": f"{console.COOKIE}={token}", "Origin": "http://evil.example"},
                    {"Origin": node.url}):
        with pytest.raises(websockets.exceptions.InvalidStatus):
            ws_client.connect(ws_url, additional_headers=headers, open_timeout=10)
    node_ok = httpx.get(node.url + "/health", timeout=10)
    assert node_ok.status_code == 200


def test_session_tokens_expire_and_end_with_the_key(tmp_path: Path) -> None:
    keys = ApiKeys(tmp_path / "secrets")
    first = keys.current
    token = console.issue(first)
    assert first not in token and console.valid(token, keys.accepted())
    assert not console.valid(token, ["aenv_other"])
    assert not console.valid(token, keys.accepted(), now=time.time() + console.SESSION_S + 1)
    for bad in ("", "1.2", f"{10**13}.{'0' * 64}", token[:-1] + "x", "x" * 200):
        assert not console.valid(bad, keys.accepted())
    rotate_api_key(tmp_path / "secrets", grace_s=60)  # in its grace the old key's sessions hold
    assert console.valid(token, keys.accepted())
    rotate_api_key(tmp_path / "secrets")  # without one they end with it
    assert not console.valid(token, keys.accepted())


async def test_console_not_built_says_how(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_UI_DIR", str(tmp_path / "missing"))
    app = FastAPI()
    app.state.api_key = "aenv_test"
    app.include_router(console.console_router())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://console.test") as c:
        login = await c.post("/ui/login", data={"key": "aenv_test"})
        assert login.status_code == 303
        assert console.COOKIE in c.cookies  # kept by the client, as a browser keeps it
        r = await c.get("/ui/")
        assert r.status_code == 503 and "make ui" in r.json()["message"]


def _shot(page, out: Path, name: str) -> None:
    path = out / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def test_console_in_a_browser(node: Node, api: httpx.Client, tmp_path: Path) -> None:
    """log in -> create from base -> terminal (echo hello-$((6*7)) reads hello-42) ->
    fork -> the fork in the lineage -> snapshot, pause, resume -> kill both -> gone."""
    _built()
    assert CHROMIUM.exists(), "Debian's chromium is needed (make system)"
    from playwright.sync_api import expect, sync_playwright

    out = tmp_path / "screenshots"
    out.mkdir()
    made: list[str] = []
    snapshots: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(30_000)
            page.goto(node.url + "/ui/")
            expect(page).to_have_url(re.compile(r"/ui/login$"))
            page.fill("#key", "not-the-key")
            page.click("#submit")
            expect(page.locator("#error")).to_contain_text("not this server")
            _shot(page, out, "0-login-refused")
            page.fill("#key", node.api_key)
            page.click("#submit")
            expect(page).to_have_url(re.compile(r"/ui/$"))
            expect(page.locator("h1")).to_have_text("agentenv console")
            # The page's own fetch without the console's header is refused (CSRF).
            status = page.evaluate("""async () => (await fetch('/sandboxes/nosuchsandbox',
                {method: 'DELETE', credentials: 'same-origin'})).status""")
            assert status == 401

            before = {s["sandboxID"] for s in api.get("/sandboxes").json()}
            page.fill("#template", "base")
            page.click("#create")
            expect(page.locator("#status")).to_contain_text("created ", timeout=60_000)
            sid = page.locator("#status").inner_text().split("created ", 1)[1].strip()
            made.append(sid)
            assert sid not in before
            row = page.locator(f'#sandboxes tr[data-id="{sid}"]')
            # (the list also asks every running sandbox for metrics: slow on a busy node)
            expect(row).to_have_attribute("data-state", "running", timeout=30_000)
            _shot(page, out, "1-created")

            row.locator('button[data-action="terminal"]').click()
            expect(page.locator("#terminal-panel")).to_have_attribute("data-state", "open")
            expect(page.locator("#terminal .xterm-rows")).to_contain_text("$")  # a prompt
            page.locator("#terminal .xterm-helper-textarea").focus()
            page.keyboard.type("echo hello-$((6*7))")
            page.keyboard.press("Enter")
            expect(page.locator("#terminal .xterm-rows")).to_contain_text("hello-42")
            _shot(page, out, "2-terminal")
            page.click("#terminal-close")  # the socket closes: its shell is killed
            assert _shell_gone(sid), "the terminal's shell outlived its socket"
            session = next(c["value"] for c in page.context.cookies()
                           if c["name"] == console.COOKIE)
            _session_stays_with_the_node(node, sid, session)

            row.locator('button[data-action="fork"]').click()
            expect(page.locator("#status")).to_contain_text("forked into ", timeout=60_000)
            child = page.locator("#status").inner_text().split("forked into ", 1)[1].strip()
            made.append(child)
            expect(page.locator(f'#sandboxes tr[data-id="{child}"]')).to_be_visible()
            node_in_tree = page.locator(f'#lineage g[data-key="sandbox:{child}"]')
            expect(node_in_tree).to_have_attribute("data-parent", f"sandbox:{sid}")
            expect(page.locator(f'#lineage path[data-to="sandbox:{child}"]')).to_have_count(1)
            node_in_tree.scroll_into_view_if_needed()
            _shot(page, out, "3-fork-lineage")

            row.locator('button[data-action="snapshot"]').click()
            expect(page.locator("#status")).to_contain_text("snapshot ", timeout=60_000)
            snap = page.locator("#status").inner_text().split("snapshot ", 1)[1].strip()
            snapshots.append(snap)
            expect(page.locator(f'#lineage g[data-key="snapshot:{snap}"]')
                   ).to_have_attribute("data-parent", f"sandbox:{sid}")
            child_row = page.locator(f'#sandboxes tr[data-id="{child}"]')
            child_row.locator('button[data-action="pause"]').click()
            expect(child_row).to_have_attribute("data-state", "paused")
            child_row.locator('button[data-action="resume"]').click()
            expect(child_row).to_have_attribute("data-state", "running")
            expect(page.locator("#load .plot")).to_have_count(3)
            for victim in (child, sid):
                page.locator(f'#sandboxes tr[data-id="{victim}"] button[data-action="kill"]'
                             ).click()
                expect(page.locator(f'#sandboxes tr[data-id="{victim}"]')).to_have_count(0)
            _shot(page, out, "4-killed")
            page.click("#logout")
            expect(page).to_have_url(re.compile(r"/ui/login$"))
        finally:
            browser.close()
            for s in made:
                api.delete(f"/sandboxes/{s}")
            for snap in snapshots:
                api.delete(f"/snapshots/{snap}")
    listed = {s["sandboxID"] for s in api.get("/sandboxes").json()}
    assert not set(made) & listed


def _session_stays_with_the_node(node: Node, sid: str, session: str) -> None:
    """A sandbox's port sees the client's other cookies, never the console's session."""
    from e2b import Sandbox

    start_header_echo(Sandbox.connect(sid))
    for routing in routings(sid, ECHO_PORT):
        r = httpx.get(node.url + "/", headers={
            **{k: str(v) for k, v in routing.items() if k != "Host"},
            "Host": str(routing["Host"]), "Cookie": f"{console.COOKIE}={session}; app=1"})
        assert r.status_code == 200, r.text
        assert r.json().get("cookie") == "app=1", r.json()


def _shell_gone(sid: str, within_s: float = 15.0) -> bool:
    """No interactive login shell (the terminal's) left in the sandbox (e2b SDK)."""
    from e2b import Sandbox

    sandbox = Sandbox.connect(sid)
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        shells = [p for p in sandbox.commands.list() if p.args[:2] == ["-i", "-l"]]
        if not shells:
            return True
        time.sleep(0.3)
    return False
