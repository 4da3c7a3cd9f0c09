"""The web page (web/dist/, built by `python3 web/build.py`) in a real headless Chromium with
WebGPU on its bundled SwiftShader, driven over WebDriver (Debian's chromium-driver): it runs
each bundled model's example batch and matches the native CPU backend's results; its heatmaps
are drawn; bad files show a message naming the file and leave the page working.

Without Chromium, chromedriver or the built page the tests skip, except under CI=true, where
they fail."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import mmlora

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "assets"
sys.path.insert(0, str(ROOT / "web"))
from browser import CHROMEDRIVER, CHROMIUM, SITE, chromium, serve  # noqa: E402
# The wgpu tolerances: WebGPU on SwiftShader against the CPU backend.
REL_TOL = 1e-4
ABS_TOL = 1e-4
# Generous: SwiftShader compiles every pipeline on first use, on the CPU.
TIMEOUT_S = 300


def missing(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} (CI=true requires the browser test to run)")
    pytest.skip(what)


@pytest.fixture(scope="module")
def site_url():
    """The built page served on 127.0.0.1 (a static file server, as the README's)."""
    if not (SITE / "pkg" / "mmlora_web_bg.wasm").is_file():
        missing(f"{SITE} is not built: python3 web/build.py")
    with serve(SITE) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium with WebGPU on SwiftShader."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.is_file():
            missing(f"{path} is not installed (apt install chromium chromium-driver)")
    with chromium(TIMEOUT_S) as driver:
        yield driver


def state(driver) -> str:
    return driver.execute_script("return document.body.dataset.state")


def wait_until(driver, condition: str, what: str) -> None:
    """Waits for the JavaScript expression `condition`; a failure shows the page's errors and
    console."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, TIMEOUT_S, poll_frequency=0.2).until(
            lambda d: d.execute_script(f"return {condition}")
        )
    except TimeoutException:
        errors = driver.execute_script("return window.mmlora && window.mmlora.errors")
        console = [entry["message"] for entry in driver.get_log("browser")]
        pytest.fail(f"{what}: page state {state(driver)!r}, errors {errors}, console {console}")


def open_page(driver, url: str, model: str) -> None:
    driver.get(f"{url}?model={model}")
    wait_until(driver, "document.body.dataset.state === 'ready'", f"the page opening {model}")
    errors = driver.execute_script("return window.mmlora.errors")
    assert errors == [], errors


def run(driver) -> int:
    """Clicks Run and waits for the run to finish; returns the run count."""
    runs = driver.execute_script("return window.mmlora.runs")
    driver.find_element("id", "run").click()
    wait_until(
        driver,
        f"window.mmlora.runs > {runs} || window.mmlora.errors.length > 0",
        "the run",
    )
    errors = driver.execute_script("return window.mmlora.errors")
    assert errors == [], errors
    wait_until(driver, "document.body.dataset.state === 'ready'", "the page after the run")
    # Nothing failed behind the page's back either (a WebGPU validation error, a panic); the
    # page's own reports of bad files (from app.js) are checked where they are expected.
    severe = [
        e["message"]
        for e in driver.get_log("browser")
        if e["level"] == "SEVERE" and "/app.js " not in e["message"]
    ]
    assert severe == [], severe
    return runs + 1


def page_output(driver, index: int, what: str) -> np.ndarray:
    out = driver.execute_script(f"return window.mmlora.output({index}, '{what}')")
    return np.asarray(out["values"], dtype=np.float32).reshape(out["rows"], out["columns"])


def page_decoded(driver, path: str) -> np.ndarray:
    """The page's image at `path` as the browser's build of the engine decoded it."""
    out = driver.execute_script(f"return window.mmlora.decoded({json.dumps(path)})")
    return np.asarray(out["rgb"], dtype=np.uint8).reshape(out["height"], out["width"], 3)


def native_engine(folder: Path, adapters: dict) -> mmlora.Engine:
    engine = mmlora.Engine(folder, device="cpu")
    for name, path in adapters.items():
        engine.load_adapter(name, folder / path)
    return engine


def errors(actual: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """Relative Frobenius error and largest absolute error, in float64."""
    assert actual.shape == want.shape, (actual.shape, want.shape)
    diff = actual.astype(np.float64) - want.astype(np.float64)
    return float(np.linalg.norm(diff) / np.linalg.norm(want)), float(np.abs(diff).max())


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_the_example_batch_matches_the_native_cpu_backend(browser, site_url, family):
    from PIL import Image

    open_page(browser, site_url, f"tiny-{family}")
    gpu = browser.execute_script("return window.mmlora.gpu.name")
    assert "swiftshader" in gpu.lower(), gpu
    run(browser)
    folder = ASSETS / f"tiny-{family}"
    spec = json.loads((folder / "batch.json").read_text())
    mounted = browser.execute_script("return window.mmlora.session.folder")
    engine = native_engine(folder, spec["adapters"])

    # The browser decodes PNG and WebP as the native build does, bit for bit: the native
    # engine gives the same result from its pixels as from the file. JPEG goes through a
    # pure-Rust decoder there (libjpeg-turbo's C code is not built for wasm32): within the 3
    # levels of Pillow's pixels the native test holds that decoder to.
    decoded = {r["image"]: page_decoded(browser, f"{mounted}/{r['image']}") for r in spec["requests"]}
    from_files = engine.encode(
        [{"id": r["id"], "image": folder / r["image"], "adapter": r["adapter"]} for r in spec["requests"]]
    )
    from_pixels = engine.encode(
        [{"id": r["id"], "image": decoded[r["image"]], "adapter": r["adapter"]} for r in spec["requests"]],
        with_tower=True,
    )
    for request, file_result, pixel_result in zip(spec["requests"], from_files, from_pixels):
        image = request["image"]
        if image.endswith(".jpg"):
            pillow = np.asarray(Image.open(folder / image).convert("RGB"))
            levels = np.abs(decoded[image].astype(int) - pillow.astype(int)).max()
            assert decoded[image].shape == pillow.shape and levels <= 3, (image, levels)
        else:
            np.testing.assert_array_equal(pixel_result.embeds, file_result.embeds, err_msg=image)

    # WebGPU on SwiftShader against the native CPU backend on the same pixels.
    summary = browser.execute_script("return window.mmlora.summary")
    assert len(summary["rows"]) == len(from_pixels)
    for index, result in enumerate(from_pixels):
        outputs = [("embeds", result.embeds), ("tower", result.tower)]
        if result.deepstack is not None:
            outputs.append(("deepstack", result.deepstack))
        for what, values in outputs:
            rel, largest = errors(page_output(browser, index, what), values)
            assert rel <= REL_TOL and largest <= ABS_TOL, (family, result.id, what, rel, largest)
        row = summary["rows"][index]
        assert row["adapter"] == result.adapter, (row, result)
        assert row["embeds"] == result.embeds.shape[0]


def test_the_page_after_a_run_shows_heatmaps_and_the_cosine_matrix(browser, site_url, tmp_path):
    from PIL import Image

    open_page(browser, site_url, "tiny-qwen2-vl")
    run(browser)
    canvases = browser.find_elements("css selector", "#heatmaps canvas")
    rows = browser.execute_script("return window.mmlora.batch.length")
    assert len(canvases) == rows == 7
    cells = browser.find_elements("css selector", "#cosine td")
    assert len(cells) == (rows + 1) ** 2
    # The heatmaps as drawn on the page: many distinct colours, not a blank area.
    heatmaps = browser.find_element("id", "heatmaps")
    browser.execute_script("arguments[0].scrollIntoView()", heatmaps)
    shot = Image.open(io.BytesIO(heatmaps.screenshot_as_png)).convert("RGB")
    colours = len(np.unique(np.asarray(shot).reshape(-1, 3), axis=0))
    assert shot.width >= 600 and colours >= 200, (shot.size, colours)
    # The whole page, for the README when MMLORA_WEB_SCREENSHOT names a file.
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1400, height + 140)
    shot = Path(os.environ.get("MMLORA_WEB_SCREENSHOT", tmp_path / "page.png"))
    assert browser.save_screenshot(str(shot))
    browser.set_window_size(1400, 1800)


def pick(browser, input_id: str, paths: list[Path]) -> None:
    """Picks `paths` in the page's file input `input_id` (a folder for a folder input)."""
    browser.find_element("id", input_id).send_keys("\n".join(str(p) for p in paths))


def expect_error(browser, count: int, *names: str) -> None:
    """Waits for the page's error `count` and checks it names each of `names`."""
    wait_until(browser, f"window.mmlora.errors.length >= {count}", f"error {count}")
    wait_until(browser, "document.body.dataset.state === 'ready'", "the page after an error")
    message = browser.execute_script(f"return window.mmlora.errors[{count - 1}]")
    for name in names:
        assert name in message, (name, message)


def test_bad_files_show_a_message_naming_the_file_and_leave_the_page_working(
    browser, site_url, tmp_path
):
    open_page(browser, site_url, "tiny-qwen2-vl")
    run(browser)
    first = page_output(browser, 0, "embeds")
    adapters = browser.execute_script("return window.mmlora.session.adapterNames()")

    # Not an image, whatever its name says.
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    pick(browser, "image-files", [text])
    expect_error(browser, 1, "notes.png")

    # A PEFT folder whose safetensors is corrupt.
    bundled = ASSETS / "tiny-qwen2-vl"
    broken = tmp_path / "broken-lora"
    shutil.copytree(bundled / "adapters" / "all-r4", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    pick(browser, "adapter-folder", [broken])
    expect_error(browser, 2, "adapters/broken-lora/adapter_model.safetensors")

    # An adapter for another model: Qwen3-VL's deepstack adapter targets layers Qwen2-VL lacks.
    deepstack = tmp_path / "deepstack-r4"
    shutil.copytree(ASSETS / "tiny-qwen3-vl" / "adapters" / "deepstack-r4", deepstack)
    pick(browser, "adapter-folder", [deepstack])
    expect_error(browser, 3, "deepstack-r4", "deepstack")

    # A model folder without config.json.
    model = tmp_path / "no-config"
    shutil.copytree(bundled, model, ignore=shutil.ignore_patterns("config.json", "adapters"))
    pick(browser, "model-folder", [model])
    expect_error(browser, 4, "models/no-config/config.json")

    # Nothing changed: the same model, adapters and batch, and the same results.
    assert browser.execute_script("return window.mmlora.session.adapterNames()") == adapters
    assert browser.execute_script("return window.mmlora.session.folder") == "models/tiny-qwen2-vl"
    browser.execute_script("window.mmlora.errors = []")
    run(browser)
    again = page_output(browser, 0, "embeds")
    np.testing.assert_array_equal(again, first)


def test_images_from_a_url_and_a_drop_run_as_the_same_file_does(browser, site_url):
    open_page(browser, site_url, "tiny-qwen2-vl")
    url = f"{site_url}models/tiny-qwen2-vl/images/square.png"
    count = browser.execute_script("return window.mmlora.images.length")
    browser.find_element("id", "image-url-text").send_keys(url)
    browser.find_element("css selector", "#image-url button").click()
    wait_until(browser, f"window.mmlora.images.length === {count + 1}", "the fetched image")
    # A drop as the browser delivers one: a `drop` event whose DataTransfer holds a File.
    browser.execute_async_script(
        """const [url, done] = arguments;
        fetch(url).then((r) => r.blob()).then((blob) => {
          const transfer = new DataTransfer();
          transfer.items.add(new File([blob], 'dropped.png', { type: 'image/png' }));
          document.dispatchEvent(new DragEvent('drop', { dataTransfer: transfer, bubbles: true }));
          done();
        });""",
        url,
    )
    wait_until(browser, f"window.mmlora.images.length === {count + 2}", "the dropped image")
    paths = browser.execute_script("return window.mmlora.images.map((image) => image.path)")
    assert paths[-2:] == ["images/square.png", "images/dropped.png"], paths
    # The bundled square.png, the fetched copy and the dropped one, each with all-r4.
    rows = [
        {"image": path, "adapter": "all-r4"}
        for path in ("models/tiny-qwen2-vl/images/square.png", *paths[-2:])
    ]
    browser.execute_script(f"window.mmlora.batch = {json.dumps(rows)}")
    run(browser)
    # Rows of one step may be summed in another order (the products' edge tiles): f32 rounding.
    first = page_output(browser, 0, "embeds")
    for index in (1, 2):
        rel, largest = errors(page_output(browser, index, "embeds"), first)
        assert rel <= 1e-6 and largest <= 1e-5, (index, rel, largest)
