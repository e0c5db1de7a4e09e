"""The documentation site: built strictly by mkdocs (a broken link, a missing anchor, a page
left out of the navigation fail the build), then looked at in a real browser (Debian's
headless Chromium, as the dashboard test does): its home page, two guides and the
benchmarks page load, every picture on them loads, and nothing they ask for is missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.browser import chromium

ROOT = Path(__file__).resolve().parents[2]
# Where the screenshots go (ignored by git): the home page and the benchmarks page, as a
# reader sees them.
SCREENSHOTS = ROOT / ".cache" / "site-screenshots"
# Injected into each HTML page the test server sends (the site itself is untouched): once the
# page has loaded, it writes down how many pictures it has and which did not load.
IMAGE_CHECK = b"""<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  const broken = images.filter((i) => !(i.complete && i.naturalWidth > 0)).map((i) => i.src);
  const out = document.createElement("pre");
  out.id = "kvpool-image-check";
  out.textContent = JSON.stringify({images: images.length, broken});
  document.body.appendChild(out);
});
</script>"""


MKDOCS_BUILD = (sys.executable, "-m", "mkdocs", "build", "--strict")


def mkdocs_build(config: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [*MKDOCS_BUILD, "-f", str(config), "--site-dir", str(site_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    built = mkdocs_build(ROOT / "mkdocs.yml", site_dir)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return site_dir


def test_the_site_builds_strictly_and_fetches_nothing_from_elsewhere(site: Path) -> None:
    pages = list(site.rglob("*.html"))
    assert (site / "index.html").exists() and (site / "guides" / "vllm" / "index.html").exists()
    assert len(pages) >= 25
    for page in pages:
        text = page.read_text()
        assert "fonts.googleapis.com" not in text and "fonts.gstatic.com" not in text, page
    # The README is the home page, included (not a copy that could drift).
    home = (site / "index.html").read_text()
    first_line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line)
    assert first_line.lstrip("# ") in home


def copy_of_the_docs(into: Path) -> Path:
    """The site's sources in a directory of their own, to break them there."""
    for name in ("mkdocs.yml", "README.md", "CHANGELOG.md"):
        shutil.copy(ROOT / name, into / name)
    shutil.copytree(ROOT / "docs", into / "docs")
    (into / "src").symlink_to(ROOT / "src")
    return into / "mkdocs.yml"


def test_a_broken_link_or_a_page_outside_the_navigation_fails_the_build(tmp_path: Path) -> None:
    config = copy_of_the_docs(tmp_path)
    guide = tmp_path / "docs" / "get-started.md"
    original = guide.read_text()
    guide.write_text(original + "\nSee [the old page](guides/no-such-page.md).\n")
    built = mkdocs_build(config, tmp_path / "site")
    assert built.returncode != 0
    assert "no-such-page.md" in built.stdout + built.stderr

    guide.write_text(original + "\nSee [tiers](guides/tiers.md#no-such-section).\n")
    built = mkdocs_build(config, tmp_path / "site")
    assert built.returncode != 0
    assert "no-such-section" in built.stdout + built.stderr

    guide.write_text(original)
    (tmp_path / "docs" / "orphan.md").write_text("# Nobody links here\n")
    built = mkdocs_build(config, tmp_path / "site")
    assert built.returncode != 0
    assert "orphan.md" in built.stdout + built.stderr


class _Server:
    """The built site over HTTP on loopback, with each request's path and status kept."""

    def __init__(self, root: Path) -> None:
        self.requests: list[tuple[str, int]] = []
        server = self

        class Handler(SimpleHTTPRequestHandler):
            def send_head(self):  # type: ignore[no-untyped-def]
                path = Path(self.translate_path(self.path))
                if path.is_dir():
                    path = path / "index.html"
                if path.suffix == ".html" and path.is_file():
                    body = path.read_bytes().replace(b"</body>", IMAGE_CHECK + b"</body>", 1)
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html; charset=utf-8")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    return _Body(body)
                return super().send_head()

            def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
                server.requests.append((self.path, int(code)))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Body:
    """What ``send_head`` returns for ``copyfile``: the page with the check in it."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, size: int = -1) -> bytes:
        data, self.data = self.data, b""
        return data

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[_Server]:
    with _Server(site) as server:
        yield server


# The pages a reader opens first, and the pictures each has at least.
PAGES = {"": 1, "guides/vllm/": 0, "guides/kubernetes/": 0, "benchmarks/": 5}


@pytest.mark.parametrize("page", PAGES)
def test_a_page_loads_in_a_browser_with_every_picture(served: _Server, page: str) -> None:
    served.requests.clear()
    dom = chromium("--dump-dom", f"{served.url}/{page}")
    assert '<h1 id="' in dom or "<h1>" in dom
    check = dom.split('<pre id="kvpool-image-check">', 1)
    assert len(check) == 2, "the page's load event never came"
    images = json.loads(check[1].split("</pre>", 1)[0])
    assert images["broken"] == [], images
    assert images["images"] >= PAGES[page], images
    missing = [(path, code) for path, code in served.requests if code >= 400]
    assert not missing, missing  # every stylesheet, script and picture it asked for was there
    assert any(path.endswith(".css") for path, _ in served.requests)  # the theme is loaded


@pytest.mark.parametrize("page", ["", "benchmarks/"])
def test_a_screenshot_of_the_page(served: _Server, page: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / f"{page.strip('/') or 'home'}.png"
    shot.unlink(missing_ok=True)
    chromium("--window-size=1280,1600", f"--screenshot={shot}", f"{served.url}/{page}")
    assert shot.exists() and shot.stat().st_size > 20_000  # a rendered page, not a blank one


def _nav_depths(items: list, depth: int = 1) -> dict[str, int]:
    """Each page of the navigation and the clicks it takes: a top tab is one, a page under
    it two (a section inside a tab is drawn open, so it adds none)."""
    out: dict[str, int] = {}
    for item in items:
        for value in item.values() if isinstance(item, dict) else [item]:
            if isinstance(value, list):
                out.update(_nav_depths(value, depth + 1 if depth == 1 else depth))
            else:
                out[value] = depth
    return out


def test_what_each_reader_looks_for_is_two_clicks_away() -> None:
    import yaml

    depths = _nav_depths(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    wanted = {
        "get-started.md": "install",
        "guides/vllm.md": "a GPU vLLM quickstart",
        "guides/kubernetes.md": "Helm",
        "guides/sglang.md": "SGLang",
        "configuration.md": "the configuration reference",
        "operations/troubleshooting.md": "troubleshooting",
        "security.md": "security",
        "benchmarks.md": "the benchmarks with plots",
    }
    for page, what in wanted.items():
        assert depths.get(page, 99) <= 2, f"{what} ({page}) is not within two clicks"
    assert "Quickstart" in (ROOT / "docs" / "guides" / "vllm.md").read_text()
    assert "helm install" in (ROOT / "docs" / "guides" / "kubernetes.md").read_text()
