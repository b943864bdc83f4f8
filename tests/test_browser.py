"""Real-browser checks: the study-01 report renders offline (its source pane highlights
without a server), and study 01 runs in JupyterLab.

Headless Chromium (Debian's /usr/bin/chromium) opens the HTML report with the
network off (its own network namespace through `unshare -n` where allowed, and
always a dead proxy plus a resolver that resolves nothing); the DOM after the
scripts ran must hold plotly's rendered `svg.main-svg` and the ISA diff's 16-bit
and 128-bit stores. A control copy that loads plotly.js from the CDN instead
must NOT render, which shows both that the network really is off and that the
check can fail. The JupyterLab smoke test drives a real Lab through selenium
and Debian's chromedriver (no Selenium Manager download).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

# The notebook stack (a GPU node running `pytest -m gpu tests/` may not have it): without it this
# module skips, and the rest of the suite still collects.
for _stack in ("nbformat", "papermill", "nbconvert"):
    pytest.importorskip(_stack, reason=f"needs the notebook stack ({_stack} is not importable: make setup)",
                        exc_type=ImportError)

from test_report import STUDY, study_report  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                       "(scripts/setup.sh --browser installs it)"),
]

BASE_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
              "--disable-default-apps", "--disable-extensions", "--mute-audio"]
OFFLINE_FLAGS = ["--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost",
                 "--proxy-bypass-list=<-loopback>"]


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def chromium(url: str, *extra: str, user_data: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run headless chromium on `url` with the network off; kill its whole process group on timeout."""
    cmd = [str(CHROMIUM), *BASE_FLAGS, *OFFLINE_FLAGS, f"--user-data-dir={user_data}", *extra, url]
    if _unshare_works():
        cmd = ["unshare", "-n", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this call started
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class Dom(HTMLParser):
    """Start tags (tag, attrs) and the text inside each <td>; script bodies are not markup."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.cells: list[tuple[list[str], str]] = []
        self._td: list | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "td":
            self._td = [(attrs.get("class") or "").split(), ""]

    def handle_endtag(self, tag):
        if tag == "td" and self._td is not None:
            self.cells.append((self._td[0], self._td[1]))
            self._td = None

    def handle_data(self, data):
        if self._td is not None:
            self._td[1] += data


def dom_of(text: str) -> Dom:
    d = Dom()
    d.feed(text)
    return d


def main_svgs(d: Dom) -> int:
    return sum(1 for t, a in d.tags if t == "svg" and "main-svg" in (a.get("class") or "").split())


def graph_divs(d: Dom) -> int:
    return sum(1 for t, a in d.tags if t == "div" and "plotly-graph-div" in (a.get("class") or "").split())


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = study_report(tmp_path_factory)
    html = out / "01_isa_hints.html"
    if not html.exists():
        pytest.fail(f"the study-01 report was not made: {(out / 'cli.log').read_text()[-2000:]}")
    return html


def test_report_renders_offline_in_chromium(report, tmp_path):
    res = chromium(report.as_uri(), "--virtual-time-budget=20000", "--run-all-compositor-stages-before-draw",
                   "--dump-dom", user_data=tmp_path / "profile")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = dom_of(res.stdout)
    static = dom_of(report.read_text())
    assert main_svgs(static) == 0  # nothing rendered before the scripts ran
    n_graphs = graph_divs(dom)
    assert n_graphs >= 2
    # plotly draws two svg.main-svg layers per figure
    assert main_svgs(dom) >= 2 * n_graphs, (main_svgs(dom), n_graphs)
    # the ISA diff (the widget's static snapshot): 16-bit stores on the left, 128-bit on the right
    w16 = [text for cls, text in dom.cells if "wb-w16" in cls]
    w128 = [text for cls, text in dom.cells if "wb-w128" in cls]
    assert any("st.global.b16" in t for t in w16), w16[:5]
    assert any("st.global.v4.b32" in t for t in w128), w128[:5]
    assert any("global_store_short" in t for t in w16)
    assert any("global_store_dwordx4" in t for t in w128)


def test_cdn_plotly_does_not_render_offline(report, tmp_path):
    """Control: the same page fetching plotly.js from its CDN draws nothing here (network off)."""
    from plotly.offline import get_plotlyjs

    page = report.read_text()
    bundle = get_plotlyjs()
    assert bundle in page
    cdn = page.replace(bundle, "").replace(
        "<head>", '<head><script src="https://cdn.plot.ly/plotly-3.1.0.min.js"></script>', 1)
    copy = tmp_path / "cdn_copy.html"
    copy.write_text(cdn)
    res = chromium(copy.as_uri(), "--virtual-time-budget=8000", "--dump-dom", user_data=tmp_path / "profile")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = dom_of(res.stdout)
    assert graph_divs(dom) >= 2 and main_svgs(dom) == 0


def test_report_screenshot(report, tmp_path_factory):
    shots = tmp_path_factory.getbasetemp() / "screenshots"
    shots.mkdir(exist_ok=True)
    png = shots / "study01_report.png"
    res = chromium(report.as_uri(), "--virtual-time-budget=20000", "--window-size=1300,3200",
                   "--hide-scrollbars", f"--screenshot={png}", user_data=tmp_path_factory.mktemp("profile"))
    assert res.returncode == 0, res.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000, len(data)


def _selenium_driver(tmp_path, *extra):
    pytest.importorskip("selenium", reason="needs selenium (pip install selenium)")
    if not CHROMEDRIVER.exists():
        pytest.skip("needs Debian's chromedriver at /usr/bin/chromedriver (apt-get install chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)  # with the driver path given too, Selenium Manager is not used
    for flag in ["--headless=new", *BASE_FLAGS[1:], f"--user-data-dir={tmp_path / 'profile'}", *extra]:
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)


_PINNED_JS = ("return [...arguments[0].closest('.wb-isa').querySelectorAll('table.wb-diff td.wb-pin')]"
              ".map(e => e.textContent)")


def test_report_source_pane_highlights_offline(report, tmp_path):
    """Static HTML, network off: hovering / clicking a source line outlines its instructions in A and B."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    driver = _selenium_driver(tmp_path, *OFFLINE_FLAGS, "--window-size=1300,1000")
    try:
        driver.get(report.as_uri())
        panes = driver.find_elements(By.CSS_SELECTOR, "table.wb-src")
        assert len(panes) >= 4  # the widget's snapshot and the per-target diffs
        store = panes[0].find_element(By.XPATH, ".//tr[td[contains(., 'tl.store(dst, x, mask=mask)')]]")
        assert "wb-srcchg" in store.get_attribute("class")  # its stores differ between A and B
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", store)
        ActionChains(driver).move_to_element(store).perform()
        hovered = driver.execute_script(_PINNED_JS.replace("wb-pin", "wb-hl"), store)
        assert any("st.global.b16" in t for t in hovered) and any("st.global.v4.b32" in t for t in hovered)
        store.click()
        pinned = driver.execute_script(_PINNED_JS, store)
        assert any("st.global.b16" in t for t in pinned) and any("st.global.v4.b32" in t for t in pinned)
        assert not any("ld.global.v4.b32" in t for t in pinned)  # the load is another line's
        store.click()
        assert driver.execute_script(_PINNED_JS, store) == []
        # a gfx942 pane: the same line's 16-bit and 128-bit stores
        amd = next(p for p in panes if "global_store" in p.find_element(
            By.XPATH, "ancestor::div[contains(@class,'wb-isa')]").get_attribute("textContent"))
        row = amd.find_element(By.XPATH, ".//tr[td[contains(., 'tl.store(dst, x, mask=mask)')]]")
        driver.execute_script("arguments[0].closest('details') && (arguments[0].closest('details').open = true);"
                              "arguments[0].scrollIntoView({block: 'center'})", row)
        row.click()
        pinned = driver.execute_script(_PINNED_JS, row)
        assert any("global_store_short" in t for t in pinned) and any("global_store_dwordx4" in t for t in pinned)
    finally:
        driver.quit()


_STALL_JS = """
const pane = [...document.querySelectorAll('table.wb-src')].find(t => t.textContent.includes('A stalls'));
if (!pane) return null;
const row = [...pane.querySelectorAll('tr')].find(r => r.textContent.includes('tl.store(dst, x, mask=mask)'));
return [...row.querySelectorAll('td.wb-stall')].map(td => ({
  text: td.textContent, title: td.title, share: parseFloat(td.dataset.share),
  background: getComputedStyle(td).backgroundColor}));
"""


def test_report_stall_columns_render_offline(report, tmp_path):
    """Static HTML, network off: the profiled hint pair's source pane colours the store line by its share of
    each kernel's stall samples, the reasons in its hover text."""
    driver = _selenium_driver(tmp_path, *OFFLINE_FLAGS, "--window-size=1300,1000")
    try:
        driver.get(report.as_uri())
        cells = driver.execute_script(_STALL_JS)
    finally:
        driver.quit()
    assert cells and len(cells) == 2, cells  # A (no hint) and B (hint)
    a, b = cells
    assert b["share"] > 0.5 > a["share"] > 0.1  # the store line: about a quarter of A's samples, most of B's
    assert b["text"].endswith("long scoreboard") and "long scoreboard" in b["title"] and "L2 sectors" in b["title"]
    white = "rgb(255, 255, 255)"
    assert a["background"] not in (white, "rgba(0, 0, 0, 0)") and b["background"] != a["background"]


# ---------------------------------------------------------------------------
# JupyterLab


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


_STATE_JS = """
const app = window.jupyterapp;
if (!app) return {phase: 'no app'};
const w = app.shell.currentWidget;
if (!w || !w.content || !w.sessionContext) return {phase: 'no notebook'};
const s = w.sessionContext.session;
const k = s && s.kernel;
if (!k) return {phase: 'no kernel'};
const cells = w.content.widgets.filter(c => c.model.type === 'code');
const errors = [];
for (const c of cells) {
  for (const o of c.model.outputs.toJSON()) {
    if (o.output_type === 'error') errors.push(o.ename + ': ' + o.evalue);
  }
}
return {phase: 'ready', status: k.status, code: cells.length,
        ran: cells.filter(c => c.model.executionCount !== null).length, errors: errors};
"""


def _wait(driver, predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    state = None
    while time.monotonic() < end:
        state = driver.execute_script(_STATE_JS)
        if predicate(state):
            return state
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last state {state}")


def test_study01_runs_in_jupyterlab(tmp_path):
    pytest.importorskip("selenium", reason="needs selenium (pip install selenium)")
    if not CHROMEDRIVER.exists():
        pytest.skip("needs Debian's chromedriver at /usr/bin/chromedriver (apt-get install chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    nbdir = tmp_path / "lab"
    nbdir.mkdir()
    shutil.copy(STUDY, nbdir / STUDY.name)
    settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # every cell in the DOM (no windowing), so outputs below the fold can be checked
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    apputils = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    apputils.mkdir(parents=True)
    (apputils / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
           "WORKBENCH_ISA_CACHE": str(tmp_path / "isa-cache")}
    port, token = _free_port(), secrets.token_hex(16)
    log = open(tmp_path / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--port-retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={nbdir}", "--ServerApp.terminals_enabled=False",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=", "--LabApp.extension_manager=readonly",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=nbdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    driver = None
    try:
        end = time.monotonic() + 90
        while True:
            if server.poll() is not None:
                pytest.fail(f"jupyter lab exited ({server.returncode}): {(tmp_path / 'lab.log').read_text()[-3000:]}")
            try:
                _get(f"{base}/api/status?token={token}")
                break
            except OSError:
                if time.monotonic() > end:
                    pytest.fail("jupyter lab did not answer within 90 s")
                time.sleep(0.5)

        opts = webdriver.ChromeOptions()
        opts.binary_location = str(CHROMIUM)  # with the driver path given too, Selenium Manager is not used
        for flag in ["--headless=new", *BASE_FLAGS[1:], f"--user-data-dir={tmp_path / 'profile'}",
                     "--window-size=1400,1000"]:
            opts.add_argument(flag)
        driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
        driver.set_script_timeout(30)
        driver.get(f"{base}/lab/tree/{STUDY.name}?token={token}")
        state = _wait(driver, lambda s: s.get("phase") == "ready" and s.get("status") == "idle", 120,
                      "the notebook's kernel")
        assert state["code"] >= 10 and state["ran"] == 0
        driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")
        state = _wait(driver, lambda s: s.get("errors") or (s.get("ran") == s.get("code")
                                                            and s.get("status") == "idle"),
                      240, "all cells to run")
        driver.execute_script("const e = document.querySelector('.jp-Notebook .widget-dropdown');"
                              "if (e) e.scrollIntoView();")
        time.sleep(0.5)
        driver.save_screenshot(str(tmp_path / "jupyterlab.png"))
        assert state["errors"] == [], state["errors"]
        counts = driver.execute_script("""
            const q = s => document.querySelectorAll('.jp-Notebook ' + s).length;
            return {dropdowns: q('.widget-dropdown'), w16: q('.wb-isa td.wb-w16'), w128: q('.wb-isa td.wb-w128'),
                    svgs: q('svg.main-svg'), errors: q('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]')};
        """)
        assert counts["dropdowns"] >= 4, counts  # the ISA diff widget's pickers, the explorer's filters
        assert counts["w16"] >= 1 and counts["w128"] >= 1, counts  # the live diff
        assert counts["svgs"] >= 2, counts  # plotly figures drawn by the Lab extension
        assert counts["errors"] == 0, counts
        # the live widget answers: its source pane outlines a line's instructions, and it switches to SASS
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import Select

        store = driver.find_element(By.XPATH, "//div[contains(@class,'widget-html')]//table[contains(@class,'wb-src')]"
                                              "//tr[td[contains(., 'tl.store(dst, x, mask=mask)')]]")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", store)
        store.click()
        pinned = driver.execute_script(_PINNED_JS, store)
        assert any("st.global.b16" in t for t in pinned) and any("st.global.v4.b32" in t for t in pinned), pinned

        stage = driver.find_element(
            By.XPATH, "//div[contains(@class,'widget-dropdown')][label[normalize-space()='stage:']]//select")
        Select(stage).select_by_visible_text("sass")
        end = time.monotonic() + 60
        sass_js = ("return [...document.querySelectorAll('.jp-Notebook .wb-isa td.wb-w16')]"
                   ".some(e => e.textContent.includes('STG.E.U16'));")
        while not driver.execute_script(sass_js):
            assert time.monotonic() < end, "the ISA diff widget did not switch to SASS within 60 s"
            time.sleep(0.5)
    finally:
        if driver is not None:
            driver.quit()
        try:
            req = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST", data=b"")
            urllib.request.urlopen(req, timeout=10).close()
        except OSError:
            pass
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        log.close()
