"""Every notebook as a user sees it: JupyterLab + headless Chromium, each notebook copied alone.

Each ``notebooks/*.ipynb`` is copied alone into an empty folder of one JupyterLab server, opened
in Chromium and run with "Run All Cells". Then, as a user would look at it: no cell has an error
output (read from the notebook JupyterLab saves), no "Error displaying widget", every widget view
rendered, every image loaded. ``02_live_dashboard`` additionally clicks Pause while it trains and
watches the dashboard's frames change. Screenshots go to ``test-artifacts/``.

Needs Debian's ``chromium`` and the ``playwright`` and ``jupyterlab`` packages (``.ci/run``
installs them and sets ``KIT_REQUIRE_BROWSER=1``, which turns their absence into a failure).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
DASHBOARD = "02_live_dashboard.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
# no kernel chooser dialog, no news popup: nothing between "Run All" and the cells; every cell in
# the DOM (no virtual scrolling), so that each output can be checked
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autoStartDefaultKernel": True},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


def _chromium() -> str | None:
    return os.environ.get("KIT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def _missing() -> list[str]:
    missing = [] if _chromium() else ["chromium (apt-get install chromium)"]
    for module in ("playwright", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"{module} (pip install {module})")
    return missing


@pytest.fixture(scope="module")
def browser_tools() -> str:
    missing = _missing()
    if missing:
        reason = "browser test needs " + ", ".join(missing)
        if os.environ.get("KIT_REQUIRE_BROWSER") == "1":
            pytest.fail(reason + " (KIT_REQUIRE_BROWSER=1)")
        pytest.skip(reason + "; set KIT_REQUIRE_BROWSER=1 to make this a failure")
    return _chromium()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Lab:
    """One JupyterLab server; each notebook gets an empty folder of its own under ``root``."""

    base: str
    token: str
    root: Path

    def api(self, path: str, method: str = "GET") -> Any:
        request = urllib.request.Request(f"{self.base}/api/{path}", method=method)
        request.add_header("Authorization", f"token {self.token}")
        for attempt in range(3):  # a file read while JupyterLab writes it can answer 400 once
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    body = response.read()
                return json.loads(body) if body else None
            except urllib.error.HTTPError:
                if attempt == 2:
                    raise
                time.sleep(0.5)

    def copy_alone(self, name: str) -> str:
        """Copy the notebook alone into an empty folder; its path relative to the server's root."""
        folder = self.root / Path(name).stem
        folder.mkdir()
        shutil.copy(ROOT / "notebooks" / name, folder / name)
        return f"{folder.name}/{name}"

    def kernel_state(self, rel: str) -> str | None:
        for session in self.api("sessions"):
            if session.get("path") == rel:
                return session.get("kernel", {}).get("execution_state")
        return None

    def saved(self, rel: str) -> dict:
        return self.api(f"contents/{urllib.parse.quote(rel)}?content=1")

    def shutdown(self, rel: str) -> None:
        """Stop the notebook's kernel: the next notebook gets the CPU to itself."""
        for session in self.api("sessions"):
            if session.get("path") == rel:
                self.api(f"sessions/{session['id']}", method="DELETE")


def _start_lab(tmp: Path) -> tuple[subprocess.Popen, str, str, Any]:
    root = tmp / "root"
    root.mkdir()
    port, token = _free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != "KIT_TEST"}
    env["KIT_WIDGETS_TEXT"] = "0"  # the real widgets, not the test-mode text summaries
    for name in (
        "JUPYTER_CONFIG_DIR",
        "JUPYTER_RUNTIME_DIR",
        "JUPYTERLAB_SETTINGS_DIR",
        "JUPYTERLAB_WORKSPACES_DIR",
    ):
        env[name] = str(tmp / name.lower())
    for plugin, values in SETTINGS.items():
        path = tmp / "jupyterlab_settings_dir" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    log = open(tmp / "jupyter.log", "wb")
    args = [
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.allow_root=True",
        "--LabApp.extension_manager=readonly",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", *args], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    return proc, f"http://127.0.0.1:{port}", token, log


@pytest.fixture(scope="module")
def jupyter_lab(tmp_path_factory: pytest.TempPathFactory, browser_tools: str):
    """JupyterLab on loopback, one server for every notebook of this module."""
    tmp = tmp_path_factory.mktemp("jupyterlab")
    proc, base, token, log = _start_lab(tmp)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log_tail = (tmp / "jupyter.log").read_text()[-3000:]
                    raise RuntimeError("JupyterLab did not start:\n" + log_tail) from exc
                time.sleep(0.3)
        yield Lab(base, token, tmp / "root")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def browser(browser_tools: str):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=browser_tools, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.mark.parametrize("name", [n for n in NOTEBOOKS if n != DASHBOARD])
def test_notebook_runs_in_jupyterlab(name: str, jupyter_lab: Lab, browser: Any) -> None:
    rel = jupyter_lab.copy_alone(name)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        _open_notebook(page, jupyter_lab, rel)
        _run_all(page)
        _wait_until_all_cells_ran(page, jupyter_lab, rel)
        _check_as_a_user_sees_it(page, jupyter_lab, rel)
        _screenshot_first(
            page, ".jp-OutputArea-output:not([data-mime-type])", f"{Path(name).stem}-widget.png"
        )
        _screenshot_first(page, ".jp-OutputArea-output img", f"{Path(name).stem}-figure.png")
    finally:
        page.screenshot(path=str(ARTIFACTS / f"{Path(name).stem}.png"), full_page=True)
        page.close()
        jupyter_lab.shutdown(rel)


def test_dashboard_live_in_jupyterlab(jupyter_lab: Lab, browser: Any) -> None:
    rel = jupyter_lab.copy_alone(DASHBOARD)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        _open_notebook(page, jupyter_lab, rel)
        _run_dashboard_notebook_and_check(page)
        _wait_until_all_cells_ran(page, jupyter_lab, rel)
        _check_as_a_user_sees_it(page, jupyter_lab, rel)
    finally:
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        page.close()
        jupyter_lab.shutdown(rel)


# ---- any notebook -------------------------------------------------------------------------------


def _open_notebook(page, lab: Lab, rel: str) -> None:
    """Open the notebook and wait until its kernel is idle (accepting a kernel chooser if one shows)."""
    # a workspace of its own: JupyterLab would otherwise reopen the notebooks tested before
    page.goto(f"{lab.base}/lab/workspaces/{Path(rel).stem}/tree/{rel}?token={lab.token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    accept = page.locator(".jp-Dialog .jp-mod-accept")

    def ready() -> bool:
        if accept.count() and accept.first.is_visible():
            accept.first.click()
        return lab.kernel_state(rel) == "idle"

    _wait_for(page, ready, "the notebook's kernel", timeout=60, every=0.5)


def _run_all(page) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()


# per code cell: its prompt ("[3]:", "[*]:", "[ ]:") and whether an output looks like a traceback
PROGRESS = r"""() => Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell')).map(cell => {
  const prompt = cell.querySelector('.jp-InputPrompt');
  const outputs = Array.from(cell.querySelectorAll('.jp-OutputArea-output'));
  return {prompt: prompt ? prompt.innerText.trim() : '',
          error: outputs.some(o => /Traceback|^\w+(Error|Exception)\b/m.test(o.innerText))};
})"""


def _wait_until_all_cells_ran(page, lab: Lab, rel: str, timeout: float = 300) -> None:
    """Until every code cell shows an execution count and the kernel is idle (or a cell failed)."""

    def done() -> bool:
        cells = page.evaluate(PROGRESS)
        failed = [i for i, c in enumerate(cells) if c["error"]]
        if failed and lab.kernel_state(rel) == "idle":
            text = page.locator(".jp-Notebook .jp-CodeCell").nth(failed[0]).inner_text()
            raise AssertionError(f"{rel}: code cell {failed[0]} failed:\n{text[-3000:]}")
        ran = all(re.fullmatch(r"\[\d+\]:", c["prompt"]) for c in cells)
        return ran and lab.kernel_state(rel) == "idle"

    _wait_for(page, done, f"every cell of {rel} to run", timeout=timeout, every=1.0)


# every <img> in an output: loaded and not empty
IMAGES = r"""() => Array.from(document.querySelectorAll('.jp-OutputArea-output img')).map(img => ({
  complete: img.complete, width: img.naturalWidth, src: img.src.slice(0, 40)}))"""

MIME_TYPES = r"""() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
  .map(o => [o.getAttribute('data-mime-type'), o.className, o.innerText.slice(0, 60)])"""

# every widget view output (JupyterLab's widget renderer is a panel without a data-mime-type):
# rendered means a jupyter-widgets element inside it
WIDGET_VIEWS = r"""() => Array.from(document.querySelectorAll('.jp-OutputArea-output:not([data-mime-type])'))
  .map(o => ({rendered: !!o.querySelector('.jupyter-widgets'), text: o.innerText.slice(0, 200)}))"""


def _save(page, lab: Lab, rel: str) -> dict:
    """Save from the browser (File > Save Notebook) and return what JupyterLab wrote.

    JupyterLab may answer a save with a dialog (the file changed on disk, e.g. after its own autosave
    raced ours): we accept it, as a user would. A save that left no trace after 20 s is asked for once
    more (a click on a menu that was still closing is lost); the error names the dialog if one stayed open.
    """
    before = lab.saved(rel)["last_modified"]
    dialog = page.locator(".jp-Dialog")

    def ask() -> None:
        page.keyboard.press("Escape")  # a menu left open by an earlier click
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^File$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Save Notebook$")).click()

    def written() -> bool:
        if dialog.count() and dialog.first.is_visible():
            # its accept button (Overwrite, OK); a dialog re-rendered meanwhile, or one without that
            # class, gets Enter (JupyterLab's default button): the polling goes on either way
            accept = page.locator(".jp-Dialog .jp-mod-accept")
            try:
                if accept.count():
                    accept.first.click(timeout=2000)
                else:
                    page.keyboard.press("Enter")
            except Exception:  # noqa: BLE001 - a playwright timeout: asked again on the next poll
                page.keyboard.press("Enter")
        try:  # JupyterLab writes a temporary file and renames it: the file can be missing for a moment
            return lab.saved(rel)["last_modified"] != before
        except urllib.error.HTTPError:
            return False

    ask()
    try:
        _wait_for(page, written, f"{rel} to be saved", timeout=20)
    except AssertionError:
        ask()
        shown = dialog.first.inner_text()[:300] if dialog.count() else "no dialog"
        _wait_for(page, written, f"{rel} to be saved (asked twice; {shown})", timeout=40)
    return lab.saved(rel)["content"]


def _check_as_a_user_sees_it(page, lab: Lab, rel: str) -> None:
    notebook = _save(page, lab, rel)
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code" and c["source"]]
    errors = [
        (i, o.get("ename"), o.get("evalue"))
        for i, c in enumerate(cells)
        for o in c["outputs"]
        if o["output_type"] == "error"
    ]
    assert not errors, f"{rel}: error outputs {errors}"
    assert all(c["execution_count"] for c in cells), f"{rel}: cells that did not run"
    body = page.locator(".jp-Notebook").inner_text()
    assert "Error displaying widget" not in body, body[-2000:]

    saved_views = sum(WIDGET_MIME in o.get("data", {}) for c in cells for o in c["outputs"])
    views = page.evaluate(WIDGET_VIEWS)
    if len(views) != saved_views:  # an output that arrived after the save (a busy machine): save once more
        cells = [c for c in _save(page, lab, rel)["cells"] if c["cell_type"] == "code" and c["source"]]
        saved_views = sum(WIDGET_MIME in o.get("data", {}) for c in cells for o in c["outputs"])
        views = page.evaluate(WIDGET_VIEWS)
    shown = page.evaluate(MIME_TYPES)
    assert len(views) == saved_views, (
        f"{rel}: {len(views)} widget outputs shown, {saved_views} saved; shown: {shown}"
    )
    assert all(v["rendered"] for v in views), f"{rel}: widget views not rendered: {views}"

    # a widget's static PNG (for saved notebooks) is not shown while the widget is: not counted
    saved_images = sum(
        "image/png" in o.get("data", {}) and WIDGET_MIME not in o["data"] for c in cells for o in c["outputs"]
    )

    def images_loaded() -> dict | None:
        images = page.evaluate(IMAGES)
        ok = len(images) >= saved_images and all(i["complete"] and i["width"] > 0 for i in images)
        return {"images": images} if ok else None

    _wait_for(page, images_loaded, f"{rel}: {saved_images} images to load", timeout=30)


def _screenshot_first(page, selector: str, filename: str) -> None:
    """A screenshot with the first element matching ``selector`` scrolled into view (if there is one)."""
    element = page.locator(selector).first
    if element.count():
        _scroll_for_screenshot(element)
        page.screenshot(path=str(ARTIFACTS / filename))


# ---- the dashboard notebook: Pause while it trains ----------------------------------------------

# Records every text the dashboards' status and note lines show (a paused state may last only
# until the next cell starts training again).
RECORD_TEXTS = """() => {
  window.__kitSeen = [];
  const scan = () => {
    for (const el of document.querySelectorAll('.kit-dashboard-status, .kit-dashboard-note')) {
      const t = el.innerText.trim();
      if (t && window.__kitSeen[window.__kitSeen.length - 1] !== t) window.__kitSeen.push(t);
    }
  };
  new MutationObserver(scan).observe(document.body, {subtree: true, childList: true, characterData: true});
  scan();
}"""

# sha256 and size of the bytes behind the first dashboard's loss-plot <img> (a blob: URL)
IMAGE_DIGEST = """async () => {
  const img = document.querySelector('.kit-dashboard .kit-dashboard-loss-plot');
  if (!img || !img.src || !img.complete || img.naturalWidth === 0) return null;
  const bytes = await (await fetch(img.src)).arrayBuffer();
  const hash = await crypto.subtle.digest('SHA-256', bytes);
  return {size: bytes.byteLength, width: img.naturalWidth,
          sha: Array.from(new Uint8Array(hash)).map(b => b.toString(16).padStart(2, '0')).join('')};
}"""


def _wait_for(page, fn, what: str, timeout: float = 60.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        page.wait_for_timeout(every * 1000)
    seen = page.evaluate("window.__kitSeen || []")
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; the dashboards said: {seen}")


def _scroll_for_screenshot(locator) -> None:
    """Scroll a dashboard into view for a screenshot (nothing is asserted on it): JupyterLab may
    re-render an output while Playwright waits for it to be stable, detaching the element it found."""
    for _ in range(3):
        try:
            locator.scroll_into_view_if_needed(timeout=5000)
            return
        except Exception:  # noqa: BLE001 - playwright's Error (detached element, timeout): try again
            time.sleep(0.5)


def _run_dashboard_notebook_and_check(page) -> None:
    page.evaluate(RECORD_TEXTS)
    _run_all(page)

    # the widget view rendered (not JupyterLab's "Error displaying widget")
    dashboard = page.locator(".kit-dashboard").first
    dashboard.wait_for(timeout=60_000)
    status = dashboard.locator(".kit-dashboard-status")
    _wait_for(page, lambda: "running" in status.inner_text(), "status 'running'")

    # the loss plot is a non-empty image; the memory panel shows a number
    first = _wait_for(page, lambda: page.evaluate(IMAGE_DIGEST), "a first frame of the loss plot")
    assert first["size"] > 1000 and first["width"] > 100, first
    memory = dashboard.locator(".kit-dashboard-memory").inner_text()
    assert re.search(r"\d+(\.\d+)? (MiB|GiB)", memory), memory

    # Pause while `await session.train_async()` runs: that cell returns Paused, the next continues
    assert "running" in status.inner_text(), "training ended before Pause could be clicked"
    _scroll_for_screenshot(dashboard)
    page.screenshot(path=str(ARTIFACTS / "dashboard-running.png"), full_page=True)
    pause = dashboard.locator(".kit-dashboard-pause")
    assert pause.is_enabled(), page.evaluate("window.__kitSeen")
    pause.click(timeout=5000)
    _wait_for(
        page,
        lambda: any(t.startswith("status: paused") for t in page.evaluate("window.__kitSeen")),
        "status 'paused'",
        timeout=30,
    )

    # training goes on in the next cells, and the picture with it
    def new_frame_while_running():
        digest = page.evaluate(IMAGE_DIGEST)
        running = "running" in status.inner_text()
        return digest and digest["sha"] != first["sha"] and running and digest

    second = _wait_for(page, new_frame_while_running, "a different frame while training runs", timeout=60)
    assert second["size"] > 1000
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    _wait_for(
        page,
        lambda: "paused at epoch" in cells.nth(2).locator(".jp-OutputArea").inner_text(),
        "the awaited train call to return Paused",
        timeout=30,
    )
    last = page.locator(".jp-Notebook .jp-CodeCell", has_text="NBVAL_CHECK_OUTPUT")
    _wait_for(
        page,
        lambda: "kit dashboard:" in last.locator(".jp-OutputArea").inner_text(),
        "all cells to run",
        timeout=120,
    )
    assert "continued;" in cells.nth(3).locator(".jp-OutputArea").inner_text()
    body = page.locator(".jp-Notebook").inner_text()
    assert "Error displaying widget" not in body and "Error" not in last.inner_text(), body[-2000:]
    seen = page.evaluate("window.__kitSeen")
    assert any("cannot reach" in t for t in seen), seen  # said during the blocking train_epoch(live=True)
    # the pause note once, as the cell's result: never (also) as a red stderr box
    assert cells.nth(2).locator(".jp-OutputArea").inner_text().count("paused at epoch") == 1
    stderr = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert stderr.filter(has_text="paused at").count() == 0

    # Resume: Pause the last cell's awaited run; with the kernel free, Resume continues it on its loop
    resume = dashboard.locator(".kit-dashboard-resume")
    _wait_for(page, lambda: "running" in status.inner_text(), "the last cell's run", timeout=60)
    assert resume.is_disabled()  # nothing to resume while it runs
    pause.click(timeout=5000)
    _wait_for(
        page,
        lambda: status.inner_text().startswith("status: paused at epoch"),
        "the last cell's pause",
        timeout=60,
    )
    _wait_for(page, resume.is_enabled, "Resume enabled after the pause", timeout=15)
    _scroll_for_screenshot(dashboard)
    page.screenshot(path=str(ARTIFACTS / "dashboard-paused.png"), full_page=True)
    resume.click(timeout=5000)
    # training again: "running", unless the paused epoch's last steps ran between two looks (then "finished")
    _wait_for(page, lambda: "running" in status.inner_text() or "status: finished" in status.inner_text(),
              "training again after Resume", timeout=30)
    # when training has ended, the last frame stays: all steps drawn, status "finished"
    _wait_for(
        page, lambda: "status: finished" in status.inner_text(), "the resumed run to finish", timeout=120
    )
    page.locator(".kit-dashboard.kit-dashboard-final").first.wait_for(timeout=30_000)
    final = page.evaluate(IMAGE_DIGEST)
    _scroll_for_screenshot(page.locator(".kit-dashboard.kit-dashboard-final").first)  # the screenshot at the end
    assert final["size"] > 1000 and final["sha"] != first["sha"]
    assert resume.is_disabled()


ZERO_DIFF = re.compile(r"L2 difference to the current model 0(?![.\d])")
CHECKPOINT_CELLS = [
    "import tempfile\n\nimport kit\n\nworkdir = tempfile.mkdtemp(prefix='kit-checkpoints-')\n"
    "session = kit.Session.from_config(kit.examples.path('12ax'), model=f'{workdir}/model', num_epochs=2,\n"
    "    live=False, train={'class': 'Task12AXDataset', 'num_seqs': 100, 'seed': 1}, log_every_n_steps=1000)\n"
    "session.train()",
    "widget = session.checkpoints.widget()\nwidget",
]


def test_checkpoint_widget_in_jupyterlab(jupyter_lab: Lab, browser: Any) -> None:
    """Export, then Restore (asks first), each action with its own message and fresh details."""
    import nbformat

    folder = jupyter_lab.root / "checkpoints_widget"
    folder.mkdir()
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CHECKPOINT_CELLS])
    nbformat.write(notebook, folder / "checkpoints_widget.ipynb")
    rel = "checkpoints_widget/checkpoints_widget.ipynb"
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        _open_notebook(page, jupyter_lab, rel)
        _run_all(page)
        widget = page.locator(".kit-checkpoints").first
        widget.wait_for(timeout=120_000)
        widget.locator(".kit-ckpt-select select").select_option(index=0)  # model.001
        _wait_for(page, lambda: "L2 difference to the current model" in widget.inner_text(), "details")
        before = widget.inner_text()
        assert "model.001" in before and not ZERO_DIFF.search(before)
        widget.get_by_role("button", name="Export safetensors").click()
        _wait_for(page, lambda: "wrote" in widget.inner_text(), "the export's message")
        widget.get_by_role("button", name="Restore training state").click()
        confirm = widget.get_by_role("button", name="Yes, restore")
        confirm.wait_for(timeout=10_000)
        assert "wrote" not in widget.inner_text()  # the previous action's message is gone
        assert "Restore the training state of model.001?" in widget.inner_text()
        page.screenshot(path=str(ARTIFACTS / "checkpoint-widget-confirm.png"), full_page=True)
        confirm.click()
        _wait_for(page, lambda: "restored the training state of model.001" in widget.inner_text(), "restored")
        # details read again after the action: the current model is now model.001's
        _wait_for(page, lambda: ZERO_DIFF.search(widget.inner_text()), "fresh details")
    finally:
        page.screenshot(path=str(ARTIFACTS / "checkpoint-widget.png"), full_page=True)
        page.close()
        jupyter_lab.shutdown(rel)
