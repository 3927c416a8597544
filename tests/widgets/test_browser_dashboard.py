"""The dashboard in a real browser: JupyterLab + headless Chromium run notebooks/02_live_dashboard.ipynb.

Needs Debian's ``chromium`` and the ``playwright`` and ``jupyterlab`` packages (``.ci/run``
installs them and sets ``KIT_REQUIRE_BROWSER=1``, which turns their absence into a failure).
A screenshot goes to ``test-artifacts/``.
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
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "notebooks/02_live_dashboard.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
# no kernel chooser dialog, no news popup: nothing between "Run All" and the cells
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autoStartDefaultKernel": True},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
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


@pytest.fixture
def jupyter_lab(tmp_path: Path, browser_tools: str):
    """JupyterLab on loopback over a copy of the notebook (and the example config it loads)."""
    root = tmp_path / "root"
    (root / "notebooks").mkdir(parents=True)
    (root / "examples").mkdir()
    shutil.copy(ROOT / NOTEBOOK, root / NOTEBOOK)
    shutil.copy(ROOT / "examples" / "12ax.py", root / "examples" / "12ax.py")
    port, token = _free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != "KIT_TEST"}
    env["KIT_WIDGETS_TEXT"] = "0"  # the real widget, not the test-mode text summary
    for name in (
        "JUPYTER_CONFIG_DIR",
        "JUPYTER_RUNTIME_DIR",
        "JUPYTERLAB_SETTINGS_DIR",
        "JUPYTERLAB_WORKSPACES_DIR",
    ):
        env[name] = str(tmp_path / name.lower())
    settings = tmp_path / "jupyterlab_settings_dir"
    for plugin, values in SETTINGS.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    log = open(tmp_path / "jupyter.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
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
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log_tail = (tmp_path / "jupyter.log").read_text()[-3000:]
                    raise RuntimeError("JupyterLab did not start:\n" + log_tail) from exc
                time.sleep(0.3)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


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


def test_dashboard_live_in_jupyterlab(jupyter_lab: tuple[str, str], browser_tools: str) -> None:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_tools, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            _run_notebook_and_check(page, *jupyter_lab)
        finally:
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            browser.close()


def _kernel_idle(base: str, token: str) -> bool:
    with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=5) as response:
        sessions = json.load(response)
    return any(s.get("kernel", {}).get("execution_state") == "idle" for s in sessions)


def _open_notebook(page, base: str, token: str, notebook: str = NOTEBOOK) -> None:
    """Open the notebook and wait until its kernel is idle (accepting a kernel chooser if one shows)."""
    page.goto(f"{base}/lab/tree/{notebook}?token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    accept = page.locator(".jp-Dialog .jp-mod-accept")

    def ready() -> bool:
        if accept.count() and accept.first.is_visible():
            accept.first.click()
        return _kernel_idle(base, token)

    _wait_for(page, ready, "the notebook's kernel", timeout=60, every=0.5)


def _run_notebook_and_check(page, base: str, token: str) -> None:
    _open_notebook(page, base, token)
    page.evaluate(RECORD_TEXTS)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

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
    dashboard.scroll_into_view_if_needed()
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
    _wait_for(page, lambda: status.inner_text().startswith("status: paused at epoch"), "the last cell's pause",
              timeout=60)
    _wait_for(page, resume.is_enabled, "Resume enabled after the pause", timeout=15)
    dashboard.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "dashboard-paused.png"), full_page=True)
    resume.click(timeout=5000)
    _wait_for(page, lambda: "running" in status.inner_text(), "training again after Resume", timeout=30)
    # when training has ended, the last frame stays: all steps drawn, status "finished"
    _wait_for(page, lambda: "status: finished" in status.inner_text(), "the resumed run to finish", timeout=120)
    page.locator(".kit-dashboard.kit-dashboard-final").first.wait_for(timeout=30_000)
    final = page.evaluate(IMAGE_DIGEST)
    dashboard.scroll_into_view_if_needed()  # for the screenshot taken at the end
    assert final["size"] > 1000 and final["sha"] != first["sha"]
    assert resume.is_disabled()


ZERO_DIFF = re.compile(r"L2 difference to the current model 0(?![.\d])")
CHECKPOINT_CELLS = [
    "import tempfile\n\nimport kit\n\nworkdir = tempfile.mkdtemp(prefix='kit-checkpoints-')\n"
    "session = kit.Session.from_config('../examples/12ax.py', model=f'{workdir}/model', num_epochs=2, live=False,\n"
    "    train={'class': 'Task12AXDataset', 'num_seqs': 100, 'seed': 1}, log_every_n_steps=1000)\n"
    "session.train()",
    "widget = session.checkpoints.widget()\nwidget",
]


def test_checkpoint_widget_in_jupyterlab(jupyter_lab: tuple[str, str], browser_tools: str, tmp_path: Path) -> None:
    """Export, then Restore (asks first), each action with its own message and fresh details."""
    import nbformat
    from playwright.sync_api import sync_playwright

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CHECKPOINT_CELLS])
    nbformat.write(notebook, tmp_path / "root" / "notebooks" / "checkpoints_widget.ipynb")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_tools, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            _open_notebook(page, *jupyter_lab, notebook="notebooks/checkpoints_widget.ipynb")
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
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
            browser.close()
