"""A real browser for the tests that look at pages: Debian's headless Chromium, with a
throwaway profile, nothing fetched in the background, and time for a page's scripts to run."""

from __future__ import annotations

import shutil
import subprocess
import tempfile


def chromium(*args: str, timeout: float = 120) -> str:
    """Run headless Chromium with ``args`` (a URL, and ``--dump-dom`` or ``--screenshot=``);
    its standard output (the DOM, with ``--dump-dom``)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "chromium is not installed (make test installs Debian's chromium)"
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                "--virtual-time-budget=5000",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
