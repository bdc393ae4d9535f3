"""A real browser for the console's tests: Debian's chromium, headless, driven through its chromedriver by
Selenium (nothing is downloaded), with screenshots saved as test artifacts under ``out/console/`` (or the folder
``INF_ENGINE_TEST_ARTIFACTS`` names) for people to look at."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
ROOT = Path(__file__).resolve().parents[2]


def artifacts_dir() -> Path:
    folder = Path(os.environ.get("INF_ENGINE_TEST_ARTIFACTS", ROOT / "out")) / "console"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def browser_paths() -> tuple[str, str] | None:
    """(chromium, chromedriver) when both are installed."""
    driver = shutil.which("chromedriver")
    browser = next((found for name in CHROMIUM if (found := shutil.which(name))), None)
    return (browser, driver) if browser and driver else None


def require_browser() -> tuple[str, str]:
    paths = browser_paths()
    if paths is None:
        pytest.skip("chromium and chromedriver are not installed (scripts/install.sh installs them on Debian)")
    return paths


class Browser:
    """One headless chromium window at 1280x800 (``resize`` for a phone width)."""

    def __init__(self, driver: Any, base: str) -> None:
        self.driver = driver
        self.base = base

    def open(self, path: str) -> None:
        self.driver.get(self.base + path)

    def css(self, selector: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, selector)

    def all(self, selector: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return list(self.driver.find_elements(By.CSS_SELECTOR, selector))

    def wait_for(self, selector: str, timeout: float = 15.0) -> Any:
        """The first element matching ``selector`` once it is displayed."""
        return self.until(lambda: next((e for e in self.all(selector) if e.is_displayed()), None), timeout,
                          f"no visible {selector!r}")

    def until(self, probe: Callable[[], T | None], timeout: float = 15.0, what: str = "the condition") -> T:
        """Polls ``probe`` (every 100 ms) until it returns something truthy."""
        from selenium.common.exceptions import StaleElementReferenceException

        deadline = time.monotonic() + timeout
        while True:
            try:
                value = probe()
            except StaleElementReferenceException:  # the page re-rendered between the find and the read
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                self.shot("timeout")
                raise AssertionError(f"{what} within {timeout:.0f} s at {self.driver.current_url}")
            time.sleep(0.1)

    def text(self, selector: str) -> str:
        return str(self.wait_for(selector).text)

    def shot(self, name: str) -> Path:
        path = artifacts_dir() / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def resize(self, width: int, height: int) -> None:
        self.driver.set_window_size(width, height)

    def session_storage(self, key: str) -> Any:
        return self.driver.execute_script("return window.sessionStorage.getItem(arguments[0]);", key)

    def console_errors(self) -> list[str]:
        """Severe messages of the browser's console (script errors, refused loads) since the last call."""
        return [e["message"] for e in self.driver.get_log("browser") if e.get("level") == "SEVERE"]


@contextmanager
def chromium(base: str, *, width: int = 1280, height: int = 800) -> Iterator[Browser]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = require_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}", "--disable-extensions", "--no-first-run"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        driver.set_window_size(width, height)
        yield Browser(driver, base)
    finally:
        driver.quit()
