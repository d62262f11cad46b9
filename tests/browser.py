"""Headless Chromium for the pages' browser tests (the live diff, the HTML report) and the README's
screenshots: Debian's chromium and chromium-driver with selenium (``.ci/run`` installs them)."""

from __future__ import annotations

import contextlib
import shutil
import time


def chromedriver() -> str | None:
    return shutil.which("chromedriver") or shutil.which("chromium.chromedriver")


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def missing() -> str | None:
    """Why no headless browser can run here, or None."""
    import importlib.util

    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install 'onnxopt[test]')"
    if chromium() is None or chromedriver() is None:
        return "Chromium is absent (Debian: apt-get install chromium chromium-driver)"
    return None


@contextlib.contextmanager
def headless(width: int = 1600, height: int = 1000):
    """A headless Chromium driver, quit on the way out."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(chromedriver()))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for_diff(driver, timeout: float = 30) -> dict:
    """Wait until the live diff page has both Netron views rendered and marked; returns its state."""
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        state = driver.execute_script("return window.onnxoptDiff && window.onnxoptDiff.ready")
        if state and state["before"] and state["after"]:
            return driver.execute_script("return window.onnxoptDiff")
        time.sleep(0.2)
    raise AssertionError(f"Netron did not render both graphs in {timeout:.0f} s: {state}")
