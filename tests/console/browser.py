"""Debian's Chromium under Playwright, set up for a closed network: headless, no sandbox (the
tests run as root), and no background connections (updates, sync, QUIC), which the network here
refuses. One browser per test module (Playwright gives it a fresh temporary profile); each test's
tab lives in a context of its own, so no stored API key or cache leaks from one test to the next."""
from __future__ import annotations

from playwright.sync_api import BrowserContext, Page, sync_playwright

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1360, "height": 900}


class Tab:
    """A page in a fresh context, plus the uncaught errors it raised."""

    def __init__(self, context: BrowserContext):
        self.context = context
        self.page: Page = context.new_page()
        self.page_errors: list[str] = []
        self.page.on("pageerror", lambda error: self.page_errors.append(str(error)))

    def close(self) -> None:
        self.context.close()


class Browser:
    def __enter__(self) -> "Browser":
        self._playwright = sync_playwright().start()
        self.browser = self._playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        return self

    def __exit__(self, *exc) -> None:
        self.browser.close()
        self._playwright.stop()

    def new_page(self, url: str) -> Tab:
        context = self.browser.new_context(viewport=VIEWPORT)
        context.set_default_timeout(30_000)
        tab = Tab(context)
        tab.page.goto(url)
        return tab
