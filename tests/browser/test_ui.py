"""What a person sees: the quickstart notebook in JupyterLab, in headless Chromium.

Runs every cell, checks that the form, the memory chart and the run section render, presses Run and
watches the live plot's data grow while gpt-tiny trains on local Ray, provokes an invalid
layout to see its explanation inline, and saves screenshots of each step.
"""
import re
import time

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.ray, pytest.mark.slow]

KERNEL_IDLE = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle'; }"""
# Points in the first trace of the plot whose title starts with `prefix` (-1: no such plot).
POINTS = """(prefix) => { const g = Array.from(document.querySelectorAll('.js-plotly-plot')).find(
  p => p.layout && p.layout.title && String(p.layout.title.text || '').startsWith(prefix));
  return g && g.data && g.data[0] ? (g.data[0].x || []).length : -1; }"""
PLOTS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(
  g => [String(g.layout && g.layout.title && g.layout.title.text), (g.data || []).map(d => (d.x || []).length)])"""
STEPS = 80  # set in the form before Run (the notebook's own spec says 150)


def shot(page, shots, name):
    root = page.locator(".wb-root").first
    root.scroll_into_view_if_needed()
    root.screenshot(path=str(shots / f"{name}.png"))


def wait_until(page, cond, what, limit_s=60):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > limit_s:
            plots = page.evaluate(PLOTS)
            raise AssertionError(f"no {what} after {limit_s}s; plots: {plots}; problems: {page.problems}")
        time.sleep(0.5)


def sample_points(page, until, every=0.5, limit_s=300):
    """Sample the training plot's point count until `until()` or the time limit."""
    out, t0 = [], time.monotonic()
    while not until() and time.monotonic() - t0 < limit_s:
        out.append(page.evaluate(POINTS, "Training"))
        time.sleep(every)
    return out


@pytest.mark.timeout(900)
def test_quickstart_in_jupyterlab(lab_server, page, shots):
    t0 = time.monotonic()
    page.goto(f"{lab_server}/lab/tree/quickstart.ipynb?reset")
    page.wait_for_selector(".jp-Notebook")
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")

    # The workbench renders: header, layout form, sections, and the memory chart of 2 ranks.
    page.wait_for_selector(".wb-root", timeout=240_000)
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    root = page.locator(".wb-root").first
    for label in ("preset", "data (dp)", "tensor (tp)", "pipeline (pp)", "ZeRO stage", "micro-batch"):
        assert root.get_by_text(label, exact=True).count() >= 1, label
    assert root.locator(".widget-dropdown select").count() >= 5
    assert [t.strip() for t in root.locator(".wb-section-title").all_inner_texts()] == ["Memory", "Run", "Dispatch"]
    root.get_by_text("micro-batch(es) of 4 per dp rank per step").wait_for()
    wait_until(page, lambda: page.evaluate(POINTS, "Memory per rank (fits") == 2, "a memory chart of 2 ranks",
               limit_s=240)
    shot(page, shots, "01-layout-and-memory")

    # Run: the plot exists empty, then grows while the job trains, and the run completes.
    steps = root.locator(".wb-train-steps input")
    steps.fill(str(STEPS))
    steps.press("Enter")
    # plotly.js draws a FigureWidget asynchronously (and slowly on a loaded 2-core box)
    wait_until(page, lambda: page.evaluate(POINTS, "Training") == 0, "an empty training plot", limit_s=240)
    print(f"\ntraining plot drawn at {time.monotonic() - t0:.0f}s")
    run = root.locator("button.jupyter-widgets", has_text=re.compile(r"^\s*Run\s*$"))
    run.click()
    root.get_by_text(re.compile(r"Starting 2 worker")).wait_for()
    done = root.get_by_text(f"completed at step {STEPS} / {STEPS}")
    samples = sample_points(page, until=lambda: done.count() > 0 or page.evaluate(POINTS, "Training") > STEPS // 2)
    shot(page, shots, "02-run-live")
    samples += sample_points(page, until=lambda: done.count() > 0)
    done.wait_for(timeout=60_000)
    assert page.evaluate(POINTS, "Training") == STEPS
    growing = sorted({s for s in samples if 0 < s < STEPS})
    assert len(growing) >= 3, f"the plot did not update while the job ran: {samples}"
    # measured memory per rank appeared next to the training plot
    assert page.evaluate(POINTS, "Memory per rank: measured") >= 1
    time.sleep(1.0)
    shot(page, shots, "03-run-done")

    # An invalid layout is explained inline (the ConfigError text), never as a traceback.
    micro = root.locator(".wb-train-micro_batch input")
    micro.fill("3")
    micro.press("Enter")
    err = root.locator(".wb-note-error", has_text="must be divisible by dp(2) x micro_batch(3) = 6")
    err.first.wait_for()
    shot(page, shots, "04-invalid-layout")
    micro.fill("4")
    micro.press("Enter")
    page.wait_for_function("() => !document.querySelector('.wb-root .wb-note-error')")

    # Dispatch: the dry run of the local backend shows the request, nothing is sent.
    root.locator("button.jupyter-widgets", has_text="Dispatch to a cluster or cloud").click()
    root.locator("button.jupyter-widgets", has_text="Show request").click()
    root.locator(".wb-request").wait_for()
    assert '"backend": "local"' in root.locator(".wb-request").inner_text()
    shot(page, shots, "05-dispatch")

    tracebacks = page.locator(".jp-OutputArea-output", has_text="Traceback")
    assert tracebacks.count() == 0, tracebacks.first.inner_text()[:2000]
    offsite = [p for p in page.problems if "requestfailed" in p and "127.0.0.1" not in p]
    assert not offsite, offsite  # nothing from a CDN
    assert not [p for p in page.problems if p.startswith("pageerror")], page.problems
    print(f"\nbrowser test {time.monotonic() - t0:.0f}s, samples {growing}, screenshots in {shots}")
