"""The built page served on 127.0.0.1 and a headless Chromium with WebGPU on its bundled
SwiftShader, driven over WebDriver: what the page's test (web/tests/) and its benchmark
(web/bench.py) share."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
from pathlib import Path

SITE = Path(__file__).resolve().parent / "dist"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# WebGPU on SwiftShader, which Chromium bundles: `--enable-unsafe-webgpu` because Linux keeps
# WebGPU behind it.
CHROMIUM_ARGUMENTS = (
    "--headless=new",
    "--no-sandbox",
    "--enable-unsafe-webgpu",
    "--use-webgpu-adapter=swiftshader",
    "--window-size=1400,1800",
)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(site: Path = SITE):
    """The folder `site` served on 127.0.0.1 (a free port); yields its URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


@contextlib.contextmanager
def chromium(script_timeout_s: float):
    """Debian's headless Chromium through its chromium-driver (nothing downloaded)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in CHROMIUM_ARGUMENTS:
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_script_timeout(script_timeout_s)
    try:
        yield driver
    finally:
        driver.quit()
