"""The run panel's charts as drawn by JupyterLab in headless Chromium, without a run (#34): no Ray, so
quick. A notebook draws a live chart (`LiveFigure`) and sends it forty updates in the same cell, before
plotly's browser script can have loaded; the run and host charts with a legend of many runs; and the
memory chart with measured peaks. The page must show the newest figure, each chart as wide as its
box from its first draw (no window resize), no legend over a title, and the measured peaks in the
theme's text color under JupyterLab Dark. Screenshots at 800, 1000, 1400 and 1920 px, light and dark,
go to $WORKBENCH_SCREENSHOTS (else a temporary folder).
"""
import os
import re
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(900)]

KERNEL_IDLE = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle'; }"""
UPDATES = 40
CELL = f'''
import ipywidgets as w
from workbench.report import figures
from workbench.ui.app import _CSS
from workbench.ui.live import FigureBox, LiveFigure

def steps(n, first=1):
    return [{{"event": "step", "step": k, "loss": 5.0 / k, "tokens_per_s": 1000.0 + k, "step_time_s": 0.5,
             "time": 100.0 + k / 2}} for k in range(first, first + n)]

memory = [{{"event": "memory", "rank": r, "step": s, "step_time_s": 0.5, "cpu_s": 0.2 + 0.1 * r,
           "host": {{"rss_bytes": (300 + s) * 2**20}}}} for r in (0, 1) for s in (1, 5, 10)]
runs = [{{"label": f"run {{i}} (dp2 tp1 pp1 mb=4)", "events": steps(20), "group": "compared runs"}} for i in range(4)]
runs += [{{"label": f"run {{i}}", "events": steps(20)}} for i in (5, 6)]
live, hosts, compared, mem = LiveFigure(), LiveFigure(), LiveFigure(), FigureBox()
narrow = w.VBox([live], layout=w.Layout(width="480px", max_width="100%"))
narrow.add_class("wb-narrow")
page = w.VBox([w.HTML(_CSS), narrow, hosts, compared, mem], layout=w.Layout(width="100%"))
page.add_class("wb-root")
display(page)
live.show(figures.run_figure([]))
for n in range(1, {UPDATES} + 1):  # all sent before plotly's 5 MB browser script has loaded
    live.show(figures.run_figure(steps(n)))
hosts.show(figures.host_figure(steps(10) + memory))
compared.show(figures.run_figure(steps(10), history=runs))
estimate = {{"device_memory": 2**30, "per_rank": [dict(rank=r, total=3 * 2**20, params=2**20, grads=2**20, master=0,
            optimizer=2**20, activations=0, buffers=0) for r in (0, 1)]}}
mem.show(figures.memory_figure(estimate, {{r: dict(peak=int(3.5 * 2**20), params=2**20, grads=2**20, master=0,
         optimizer=2**20, activations=2**19, buffers=0) for r in (0, 1)}}))
'''
# Each plot: its title, its first trace's point count, its svg's width and its box's (the live chart's
# LiveFigure box), and the pieces of text its legend covers (title, panel titles, axis titles).
PLOTS = """() => Array.from(document.querySelectorAll('.wb-root .js-plotly-plot')).map(g => {
  const r = (el) => el.getBoundingClientRect();
  const hit = (a, b) => a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1;
  const legend = g.querySelector('.legend');
  const texts = Array.from(g.querySelectorAll('.gtitle, .annotation-text, .g-xtitle, .g-ytitle, .xtick text'));
  const covered = legend ? texts.filter(t => hit(r(legend), r(t))).map(t => t.textContent) : [];
  const box = g.closest('.wb-live-figure') || g.parentElement;
  const title = g.layout && g.layout.title && g.layout.title.text;  // (a chart being drawn has none yet)
  return {title: String(title || ''), n: ((g.data && g.data[0] && g.data[0].x) || []).length,
          svg: Math.round(r(g.querySelector('.main-svg')).width), box: Math.round(r(box).width),
          covered: covered, cut: texts.concat(legend ? [legend] : []).filter(t => r(t).right > r(box).right + 2
            || r(t).left < r(box).left - 2).map(t => t.textContent.slice(0, 30))}; })"""
# The stroke of the memory chart's measured-peak ticks (its last trace) and of the page behind them.
PEAK = """() => { const g = Array.from(document.querySelectorAll('.wb-root .js-plotly-plot')).find(
  p => String((p.layout && p.layout.title && p.layout.title.text) || '').startsWith('Memory per rank'));
  const pt = g && g.querySelector('.scatterlayer .trace:last-child .point');
  return pt ? getComputedStyle(pt).stroke : null; }"""


@pytest.fixture(scope="module")
def charts(lab_server, browser, work_dir):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(Path(work_dir) / "live_chart.ipynb"))
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    page.problems = []
    page.on("pageerror", lambda e: page.problems.append(f"pageerror: {e}"))
    page.goto(f"{lab_server}/lab/tree/live_chart.ipynb?reset")
    page.wait_for_selector(".jp-Notebook")
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(f"() => ({PLOTS})().length === 4", timeout=240_000)
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    yield page
    ctx.close()


def wait_for(page, cond, what, limit_s=60.0):
    t0 = time.monotonic()
    while not (got := cond()):
        if time.monotonic() - t0 > limit_s:
            raise AssertionError(f"no {what} after {limit_s}s: {page.evaluate(PLOTS)}; {page.problems}")
        time.sleep(0.3)
    return got


def test_a_live_chart_shows_the_newest_figure_and_fills_its_box_from_its_first_draw(charts):
    """Forty updates came before plotly's browser model could apply them: the chart still shows all forty
    steps (it showed the first, empty figure); it is 480 px wide like its box, with no window resize
    since the page opened (it was 700 px, plotly.js's default, until one)."""
    def live():
        plots = [p for p in charts.evaluate(PLOTS) if p["title"].startswith("Training: step")]
        return plots[0] if plots and plots[0]["n"] == UPDATES and plots[0]["svg"] <= plots[0]["box"] + 2 else None

    got = wait_for(charts, live, f"the live chart with {UPDATES} steps, as wide as its box", limit_s=60)
    assert got["title"].startswith(f"Training: step {UPDATES},") and got["box"] == 480, got
    assert got["svg"] >= got["box"] - 2, got  # it fills the box, too


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_no_legend_covers_a_title_and_nothing_is_cut_at_any_width(charts, theme, tmp_path):
    shots = Path(os.environ.get("WORKBENCH_SCREENSHOTS") or tmp_path)
    if theme == "dark":
        charts.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
        charts.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=60_000)
    try:
        for width in (1920, 1400, 1000, 800):
            charts.set_viewport_size({"width": width, "height": 1000})
            def fitted():
                plots = charts.evaluate(PLOTS)
                return plots if all(p["svg"] <= p["box"] + 2 and not p["cut"] for p in plots) else None

            plots = wait_for(charts, fitted, f"every chart inside its box at {width} px", limit_s=30)
            tall = charts.evaluate("() => document.querySelector('.wb-root').getBoundingClientRect().height")
            charts.set_viewport_size({"width": width, "height": int(tall) + 300})
            time.sleep(1.0)
            charts.locator(".wb-root").screenshot(path=str(shots / f"live-charts-{width}-{theme}.png"))
            plots = charts.evaluate(PLOTS)
            assert [p["covered"] for p in plots] == [[]] * 4, (width, plots)
            assert not [p for p in plots if p["cut"]], (width, plots)
        peak = charts.evaluate(PEAK)
        if theme == "dark":  # the theme's (light) text color, not the figures' black
            assert peak and sum(map(float, re.findall(r"[\d.]+", peak)[:3])) / 3 > 150, peak
        else:
            assert peak == "rgb(34, 34, 34)", peak
    finally:
        charts.set_viewport_size({"width": 1400, "height": 1000})
        if theme == "dark":
            charts.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
            charts.wait_for_function("() => document.body.dataset.jpThemeLight === 'true'", timeout=60_000)
