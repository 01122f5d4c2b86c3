"""Browser-test fixtures: the real Composer on a loopback port and headless Debian chromium via Playwright.

Playwright must never download browsers here (`playwright install` fails offline): we launch the system's
`chromium` (`apt-get install chromium`, which .ci/run does) with --no-sandbox, since CI runs as root. The
tests skip, naming what is missing, when playwright or chromium is absent.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def shots() -> Path:
    """Where screenshots go; they are test artifacts: test-artifacts/browser/ by default, and
    TOKENMILL_SCREENSHOTS=docs/screenshots refreshes the ones the docs show."""
    out = Path(os.environ.get("TOKENMILL_SCREENSHOTS", REPO / "test-artifacts" / "browser"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="session")
def chromium_path() -> str:
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no chromium on PATH: apt-get install -y chromium")
    return path


@pytest.fixture(scope="module")
def composer(tmp_path_factory):
    """The real Composer app (create_app) under uvicorn in a thread, on a free loopback port; yields
    (base_url, token, runs_dir)."""
    import uvicorn

    from tokenmill.composer.app import create_app

    token = secrets.token_urlsafe(16)
    runs_dir = tmp_path_factory.mktemp("composer_runs")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # port 0: the kernel picks a free one, and we hold it: no race
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(token, runs_dir), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the Composer server did not start within 30 s")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", token, runs_dir
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(chromium_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium_path, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, composer):
    """A logged-in page: `/?token=` sets the HttpOnly cookie and redirects to the app. Console errors and
    uncaught page errors are collected in `page.problems`."""
    base, token, _ = composer
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    pg.problems = []
    pg.on("pageerror", lambda exc: pg.problems.append(f"page error: {exc}"))
    pg.on("console", lambda msg: msg.type == "error" and pg.problems.append(f"console: {msg.text}"))
    pg.set_default_timeout(30_000)
    pg.goto(f"{base}/?token={token}")
    yield pg
    context.close()
