"""What a person sees: the quickstart notebook in JupyterLab, in headless Chromium.

One notebook page is shared by the tests of this module, in order: the workbench renders; three
runs back to back (the first a cold start beside one busy loop per core, exported as an HTML report;
the third stopped within two steps);
a run with checkpoints stopped and resumed, its curve continued; the step time and tokens/s
predicted for the running layout beside the measured ones, with the prediction's source, live and
after the run; random edit sequences whose memory chart must equal `workbench memory --json` for
the final form; the dispatch form; a Hugging Face model folder as the model; the planner's source
line and no MFU for CPU rows; screenshots at 1000, 1400 and 1920 px (docs/screenshots/) with every
plot and table inside its column; and last, the kernel still alive (same kernel, idle, answering) 90 s after the last run.
"""
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.ray_relay import STOP_WITHIN_STEPS

# generous: the module page starts JupyterLab, a kernel and Ray on a shared 2-core machine
pytestmark = [pytest.mark.browser, pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1200)]
START_S = 600  # a run's start-up (Ray, then torch in each rank) took 80 + 25 s here under load 20

KERNEL = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return k ? [k.id, k.status] : null; }"""
KERNEL_IDLE = f"() => {{ const k = ({KERNEL})(); return !!k && k[1] === 'idle'; }}"
# The plot whose title starts with `prefix`: its traces' names, x lengths and y, its title and shapes.
PLOT = """(prefix) => { const g = Array.from(document.querySelectorAll('.wb-root .js-plotly-plot')).find(
  p => p.layout && p.layout.title && String(p.layout.title.text || '').startsWith(prefix));
  if (!g) return null;
  return {title: String(g.layout.title.text), shapes: (g.layout.shapes || []).length,
          traces: (g.data || []).map(d => ({name: d.name, n: (d.x || []).length, y: Array.from(d.y || [])}))}; }"""
# The loss curve (first trace) of the plot titled "Training..." in a document: x and y.
LOSS = """(root) => { const g = Array.from(document.querySelectorAll(root + ' .js-plotly-plot')).find(
  p => p.layout && p.layout.title && String(p.layout.title.text || '').startsWith('Training'));
  return g ? {x: Array.from(g.data[0].x || []), y: Array.from(g.data[0].y || [])} : null; }"""
PLOTS = """() => Array.from(document.querySelectorAll('.wb-root .js-plotly-plot')).map(
  g => String(g.layout && g.layout.title && g.layout.title.text))"""
# What does not fit its column: plots (and their legend, titles, axes), the planner table and its
# cells, the run's log, each outside the right-hand column's box or wider inside than its box; a
# plot's title, panel titles and legend over one another;
# buttons whose label is cut ("Run" read "..."); the workbench wider than the page.
OVERFLOW = """() => { const out = [];
  const root = document.querySelector('.wb-root');
  const col = document.querySelector('.wb-root .wb-right').getBoundingClientRect();
  const r0 = (el) => el.getBoundingClientRect();
  const outside = (el, what) => { const r = r0(el);
    if (r.width && (r.right > col.right + 2 || r.left < col.left - 2))
      out.push([what, Math.round(r.left), Math.round(r.right), 'column', Math.round(col.left), Math.round(col.right)]); };
  for (const g of root.querySelectorAll('.wb-right .js-plotly-plot')) {
    const box = g.closest('[class*="wb-"]:not(.wb-right)');  // which chart: wb-run-chart, wb-host-chart, ...
    const name = 'plot ' + String(g.layout && g.layout.title && g.layout.title.text || '').slice(0, 24) + ' in ' +
      (box ? Array.from(box.classList).filter(c => c.startsWith('wb-')).join('.') : '?');
    outside(g, name);
    g.querySelectorAll('.main-svg, .legend, .gtitle, .g-xtitle, .g-ytitle, .xtick, .annotation').forEach(
      s => outside(s, name + ': ' + (s.getAttribute('class') || '')));
    const texts = [...g.querySelectorAll('.gtitle, .annotation, .legend')].filter(s => r0(s).width);
    texts.forEach((a, i) => texts.slice(i + 1).forEach(b => { const A = r0(a), B = r0(b);
      if (A.right > B.left + 1 && B.right > A.left + 1 && A.bottom > B.top + 1 && B.bottom > A.top + 1)
        out.push(['overlap in ' + name, a.textContent.slice(0, 24), b.textContent.slice(0, 24)]); }));
  }
  for (const t of root.querySelectorAll('.wb-right .wb-plan-table, .wb-right .wb-run-log')) {
    outside(t, t.className.slice(0, 40));
    if (t.scrollWidth > t.clientWidth + 1) out.push(['wider inside: ' + t.className.slice(0, 40), t.scrollWidth, t.clientWidth]);
    for (const c of t.querySelectorAll(':scope > *')) {
      outside(c, 'cell ' + c.innerText.slice(0, 30));
      if (c.scrollWidth > c.clientWidth + 1) out.push(['cell cut: ' + c.innerText.slice(0, 30), c.scrollWidth, c.clientWidth]);
    }
  }
  for (const b of root.querySelectorAll('button.jupyter-widgets')) {
    if (b.offsetParent && b.scrollWidth > b.clientWidth + 1) out.push(['cut: ' + b.innerText, b.scrollWidth, b.clientWidth]);
  }
  if (root.scrollWidth > root.clientWidth + 1) out.push(['workbench wider than its cell', root.scrollWidth, root.clientWidth]);
  return out; }"""
SPEC = {"name": "quickstart", "model": {"preset": "gpt-tiny"}, "data": {"source": "text", "seed": 0},
        "train": {"steps": 150, "global_batch": 16, "micro_batch": 4, "lr": 3.0e-3}, "layout": {"dp": 2},
        "resources": {"gpu": "cpu"}}  # the notebook's spec, with the form's "GPUs = dp x tp x pp" ticked
ROOT = Path(__file__).resolve().parents[2]
RUN_STEPS = 30
ALIVE_AFTER_S = 90


def wait_until(page, cond, what, limit_s=60.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > limit_s:
            texts = page.locator(".wb-run-progress, .wb-note").all_inner_texts()
            print(f"no {what}: what plotly.js holds for each chart:", json.dumps(page.evaluate(PLOT_STATE)))
            raise AssertionError(f"no {what} after {limit_s}s; plots: {page.evaluate(PLOTS)}; texts: {texts}; "
                                 f"problems: {page.problems}; what does not fit: {page.evaluate(OVERFLOW)}")
        time.sleep(0.3)


def settle(page):
    time.sleep(0.3)
    page.wait_for_function(KERNEL_IDLE, timeout=60_000)


def button(root, text):
    return root.locator("button.jupyter-widgets", has_text=re.compile(rf"^\s*{re.escape(text)}\s*$"))


def progress(root) -> str:
    return root.locator(".wb-run-progress").inner_text().strip()


def set_field(page, root, key: str, value) -> None:
    """Edit the form as a person does: type a number and Enter, pick an option, or press a toggle."""
    css = ".wb-" + key.replace(".", "-")
    if key in ("layout.zero", "precision.dtype"):
        root.locator(f"{css} button", has_text=re.compile(rf"^\s*{value}\s*$")).click()
    elif root.locator(f"{css} select").count():
        root.locator(f"{css} select").select_option(str(value))
    else:
        box = root.locator(f"{css} input")
        box.fill(str(value))
        box.press("Enter")
    settle(page)


@pytest.fixture(scope="module")
def lab(lab_server, browser):
    """The quickstart notebook, all cells run, in one page for the whole module."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    page.problems = []
    page.on("pageerror", lambda e: page.problems.append(f"pageerror: {e}"))
    page.on("console", lambda m: page.problems.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("requestfailed", lambda r: page.problems.append(f"requestfailed: {r.url} {r.failure}"))
    page.goto(f"{lab_server}/lab/tree/quickstart.ipynb?reset")
    page.wait_for_selector(".jp-Notebook")
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_selector(".wb-root", timeout=240_000)
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    page.info = {"kernel": page.evaluate(KERNEL)[0]}
    yield page
    ctx.close()


def shot(page, shots, name):
    """The whole workbench: the window is made tall enough for all of it (JupyterLab scrolls the
    notebook inside the window, so a shorter window cuts the picture), then put back."""
    size = page.viewport_size
    tall = page.evaluate("() => document.querySelector('.wb-root').getBoundingClientRect().height")
    page.set_viewport_size({"width": size["width"], "height": int(tall) + 400})
    time.sleep(1.0)  # plotly's resize
    # The page's clip of the workbench's box, not the locator's screenshot: that waits for the box to
    # be still for two frames, which a live run's redraws (every 0.5 s, slower under load) may never allow.
    box = page.evaluate("""() => { const r = document.querySelector('.wb-root');
      r.scrollIntoView({block: 'start'}); const b = r.getBoundingClientRect();
      return {x: b.left, y: b.top, width: b.width, height: b.height}; }""")
    page.screenshot(path=str(shots / f"{name}.png"), clip=box, timeout=180_000)  # a starved browser is slow
    page.set_viewport_size(size)


def test_the_workbench_renders(lab, shots):
    root = lab.locator(".wb-root").first
    for label in ("preset", "data (dp)", "tensor (tp)", "pipeline (pp)", "ZeRO stage", "micro-batch"):
        assert root.get_by_text(label, exact=True).count() >= 1, label
    assert [t.strip() for t in root.locator(".wb-section-title").all_inner_texts()] == ["Memory", "Run", "Dispatch"]
    root.get_by_text("micro-batch(es) of 4 per dp rank per step").wait_for()
    wait_until(lab, lambda: (lab.evaluate(PLOT, "Memory per rank (fits") or {}).get("traces", [{}])[0].get("n") == 2,
               "a memory chart of 2 ranks", limit_s=240)
    wait_until(lab, lambda: lab.evaluate(PLOT, "Training") is not None, "an empty training plot", limit_s=240)
    shot(lab, shots, "01-layout-and-memory")


def test_three_runs_back_to_back_and_stop_within_a_step(lab, shots):
    root = lab.locator(".wb-root").first
    set_field(lab, root, "train.steps", RUN_STEPS)
    for run in (1, 2):
        t0 = time.monotonic()
        # Run 1 is the kernel's cold start (Ray, then the ranks), made beside one busy loop per core (#34)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)] \
            if run == 1 else []
        try:
            button(root, "Run").click()
            # start-up by phase: 1/3 Ray, 2/3 the ranks, 3/3 the first step
            wait_until(lab, lambda: progress(root).startswith(("1/3 ", "2/3 ", "3/3 ", "step")), f"run {run} starting")
            wait_until(lab, lambda: progress(root).startswith(f"completed at step {RUN_STEPS}"),
                       f"run {run} completing", limit_s=START_S)
        finally:
            for p in busy:
                p.kill()
                p.wait()
        def curves():  # [points of this run's loss, number of traces]: earlier runs' loss beneath
            plot = lab.evaluate(PLOT, "Training")
            return plot and [plot["traces"][0]["n"], len(plot["traces"])]

        # 3 curves, earlier runs' beneath (3 each), the 2 dashed "predicted" lines (tokens/s, step time)
        wait_until(lab, lambda: curves() == [RUN_STEPS, 3 + 3 * (run - 1) + 2], f"run {run}'s curves", limit_s=30)  # noqa: B023 (waited on here)
        print(f"\nrun {run}: {time.monotonic() - t0:.0f}s")
        # the live chart drawn while the run started fits its column with no window resize (it kept
        # plotly's default 700 px in a 638 px column, every run, until the window next resized: #34)
        wait_until(lab, lambda: not lab.evaluate(OVERFLOW), f"run {run}'s charts fitting their column, titles and legend apart",
                   limit_s=30)
        if run == 1:
            check_predicted_beside_measured(lab, root, f"median of steps 2-{RUN_STEPS}")
            shot(lab, shots, "03-run-done")
            check_the_report(lab, root)
    wait_until(lab, lambda: root.locator(".wb-run-log").count() == 1, "the run's log lines", limit_s=30)
    assert button(root, "Resume").count() == 0 or not button(root, "Resume").is_visible()

    # Run 3 trains longer and is stopped: it ends within a step of the step shown when Stop was pressed.
    set_field(lab, root, "train.steps", 2000)
    button(root, "Run").click()
    wait_until(lab, lambda: progress(root).startswith("step ") and int(progress(root).split()[1]) >= 10,
               "run 3 at step 10", limit_s=START_S)
    check_predicted_beside_measured(lab, root, "median of steps 2-")  # live: the run goes on
    shot(lab, shots, "02-run-live")
    check_a_zoom_survives_new_steps(lab, root)
    shown, ended, pressed = stop_and_wait(lab, root)
    lab.info["last_run_end"] = time.monotonic()
    print(f"Stop clicked with step {shown} shown, the panel had step {pressed}, the run ended after step {ended}")
    # By state: the run ends at most STOP_WITHIN_STEPS (2) steps after the newest step the panel had
    # when the click reached it (rank 0 lets at most one step go without the driver's
    # acknowledgement, which carries the stop: backends/ray_relay.py). The page shows that step up
    # to the panel's refresh interval later, so the step shown can only be older.
    assert shown <= pressed <= ended <= pressed + STOP_WITHIN_STEPS, (shown, pressed, ended)
    assert "cannot be resumed: no checkpoint" in root.locator(".wb-note-info").last.inner_text()
    assert not button(root, "Resume").is_visible()
    set_field(lab, root, "train.steps", RUN_STEPS)


# The Training plot's first x axis (its range when zoomed) and its loss points.
TRAINING_X = """() => { const g = Array.from(document.querySelectorAll('.wb-root .js-plotly-plot')).find(
  p => p.layout && p.layout.title && String(p.layout.title.text || '').startsWith('Training'));
  return g ? {range: g.layout.xaxis.autorange === false ? Array.from(g.layout.xaxis.range) : null,
              n: (g.data[0].x || []).length} : null; }"""


def check_a_zoom_survives_new_steps(lab, root) -> None:
    """#34: a person drags a zoom box over the loss panel while the run goes; new steps keep coming
    into the same plot (updated in place) and the zoom stays."""
    drag = root.locator(".wb-run-chart .draglayer .xy .nsewdrag").first
    drag.scroll_into_view_if_needed()  # the mouse acts on what the window shows
    box = drag.bounding_box()
    y = box["y"] + box["height"] / 2
    lab.mouse.move(box["x"] + box["width"] * 0.3, y)
    lab.mouse.down()
    lab.mouse.move(box["x"] + box["width"] * 0.6, y, steps=8)
    lab.mouse.up()
    wait_until(lab, lambda: (lab.evaluate(TRAINING_X) or {}).get("range") is not None, "the zoom", limit_s=10)
    zoomed = lab.evaluate(TRAINING_X)
    wait_until(lab, lambda: lab.evaluate(TRAINING_X)["n"] >= zoomed["n"] + 5, "five more steps drawn", limit_s=120)
    after = lab.evaluate(TRAINING_X)
    assert after["range"] == pytest.approx(zoomed["range"]), (zoomed, after)


# The run panel's predicted-beside-measured table: {cell class: text}, and its source line.
PREDICTED = """() => { const t = document.querySelector('.wb-root .wb-run-predicted');
  if (!t) return null; const out = {text: t.innerText};
  for (const c of t.querySelectorAll('[class^="wb-predicted-"], [class^="wb-measured-"], .wb-prediction-source'))
    out[c.className] = c.innerText.trim();
  return out; }"""


def check_predicted_beside_measured(lab, root, which: str) -> None:
    """The step time and tokens/s predicted for the running layout, beside the measured medians
    (numbers, not "waiting"), and the prediction's source, as the page shows them."""
    def shown():
        got = lab.evaluate(PREDICTED)
        return got if got and which in got.get("wb-prediction-source", "") else None

    wait_until(lab, lambda: shown() is not None, f"predicted beside measured ({which})", limit_s=60)
    got = shown()
    assert "this run's layout (dp2 tp1 pp1 mb=4 on cpu)" in got["text"], got
    assert got["wb-prediction-source"].startswith("predicted from catalog defaults"), got
    for key in ("wb-predicted-step", "wb-measured-step"):
        assert re.fullmatch(r"[\d.]+ m?s", got[key]), got
    for key in ("wb-predicted-tokens", "wb-measured-tokens"):
        assert re.fullmatch(r"[\d,]+", got[key]), got
    training = lab.evaluate(PLOT, "Training")
    assert [t["name"] for t in training["traces"]].count("predicted") == 2, training


# Click Stop and return the step the progress line showed at that moment (the same JS task: no
# update can come between reading it and the click).
CLICK_STOP = """() => { const root = document.querySelector('.wb-root');
  const shown = root.querySelector('.wb-run-progress').innerText.trim();
  Array.from(root.querySelectorAll('button.jupyter-widgets')).find(b => b.innerText.trim() === 'Stop').click();
  return shown; }"""


def stop_and_wait(lab, root) -> tuple[int, int, int]:
    """Click Stop, wait for the run's end: (the step shown when Stop was clicked, the step it ended
    after, the step the panel had when the click reached it: "preempted at step N / M (Stop pressed
    at step K)")."""
    shown = lab.evaluate(CLICK_STOP)
    assert shown.startswith("step "), shown
    wait_until(lab, lambda: progress(root).startswith(("stopping", "preempted")), "Stop taking effect", limit_s=30)
    wait_until(lab, lambda: progress(root).startswith("preempted at step"), "the stopped run's end", limit_s=120)
    line = progress(root)
    pressed = re.search(r"Stop pressed at step (\d+)", line)
    assert pressed, line
    return int(shown.split()[1]), int(line.split()[3]), int(pressed.group(1))


def check_the_report(lab, root) -> None:
    """Export report writes one offline HTML file whose Training plot holds the run's loss curve."""
    button(root, "Export report").click()
    note = root.locator(".wb-note-ok", has_text="Report written: ")
    note.wait_for()
    path = Path(note.inner_text().split("Report written: ", 1)[1].strip())
    assert path.is_file() and path.stat().st_size > 100_000, path  # plotly.js inlined: opens offline
    shown = lab.evaluate(LOSS, ".wb-root")
    report = lab.context.new_page()
    try:
        report.goto(path.as_uri())
        report.wait_for_function(f"() => ({LOSS})('body') !== null")
        written = report.evaluate(LOSS, "body")
    finally:
        report.close()
    assert written == shown and written["x"] == list(range(1, RUN_STEPS + 1)), (written, shown)


def test_stop_and_resume_from_a_checkpoint(lab, tmp_path):
    """With a checkpoint URI, Stop writes a checkpoint of its step, Resume appears, and the
    resumed run starts after that step and continues the same loss curve to the end."""
    root = lab.locator(".wb-root").first
    steps = 400
    set_field(lab, root, "train.steps", steps)
    toggle = button(root, "Dispatch to a cluster or cloud")
    toggle.click()
    uri = root.locator(".wb-checkpoint-uri input")
    uri.fill(str(tmp_path / "ckpt"))
    uri.press("Enter")
    settle(lab)
    toggle.click()
    button(root, "Run").click()
    wait_until(lab, lambda: progress(root).startswith("step ") and int(progress(root).split()[1]) >= 10,
               "the run at step 10", limit_s=START_S)
    shown, ended, pressed = stop_and_wait(lab, root)
    assert shown <= pressed <= ended <= pressed + STOP_WITHIN_STEPS < steps, (shown, pressed, ended)
    wait_until(lab, lambda: button(root, "Resume").is_visible(), "the Resume button", limit_s=30)
    assert "Resume continues from its newest checkpoint" in root.locator(".wb-note-info").last.inner_text()
    stopped = lab.evaluate(LOSS, ".wb-root")
    assert stopped["x"] == list(range(1, ended + 1))
    button(root, "Resume").click()
    wait_until(lab, lambda: progress(root).startswith(f"completed at step {steps}"), "the resumed run's end",
               limit_s=START_S)
    lab.info["last_run_end"] = time.monotonic()
    wait_until(lab, lambda: len(lab.evaluate(LOSS, ".wb-root")["x"]) == steps, "the continued curve", limit_s=30)
    resumed = lab.evaluate(LOSS, ".wb-root")
    assert resumed["x"] == list(range(1, steps + 1))  # one curve: the stopped run's steps, then the resumed ones
    assert resumed["y"][:ended] == stopped["y"]
    assert f"from_step={ended}" in root.locator(".wb-run-log").text_content()  # (folded: not inner_text)
    assert not button(root, "Resume").is_visible()  # completed: nothing left to resume
    from workbench.runtime.checkpoint_store import Store, manifest_run_id

    store = Store(str(tmp_path / "ckpt"))  # #34: the stopped run and its resume wrote them as one run
    owners = {manifest_run_id(store.read_manifest(s)) for s in store.committed_steps()}
    assert len(owners) == 1 and owners.pop().startswith("notebook-"), owners
    print(f"Stop clicked with step {shown} shown, the panel had step {pressed}, the run ended after step {ended}; "
          f"Resume ran {ended + 1}..{steps}")
    lab.info["checkpoints"] = str(tmp_path / "ckpt")  # (its metrics: the dashboard test compares them)
    toggle.click()
    uri.fill("")
    uri.press("Enter")
    settle(lab)
    toggle.click()
    set_field(lab, root, "train.steps", RUN_STEPS)


def test_the_dashboard_x_axis_compare_and_rank_output(lab, shots):
    """#34, as a person sees the finished run: on tokens as its x axis; with the stopped-and-resumed run
    of the checkpoint folder added under Compare runs (its legend names its layout); each rank's
    stdout/stderr tail unfolded. Screenshots of each for docs/ui.md."""
    assert "checkpoints" in lab.info, "the stop-and-resume test did not finish"
    root = lab.locator(".wb-root").first
    for axis, title in (("tokens", "tokens"), ("wall time", "wall time (s)")):
        root.locator(".wb-run-x-axis button", has_text=re.compile(rf"^\s*{axis}\s*$")).click()
        wait_until(lab, lambda: lab.evaluate(X_TITLE) == title, f"the chart on {axis}", limit_s=30)  # noqa: B023
        shot(lab, shots, "07-x-axis-" + axis.replace(" ", "-"))
    root.locator(".wb-run-x-axis button", has_text=re.compile(r"^\s*step\s*$")).click()
    wait_until(lab, lambda: lab.evaluate(X_TITLE) == "step", "the chart on steps", limit_s=30)

    path = root.locator(".wb-compare-path input")
    path.fill(lab.info["checkpoints"])
    path.press("Enter")
    button(root, "Add runs").click()
    def compared():
        plot = lab.evaluate(PLOT, "Training")
        return [t["name"] for t in plot["traces"] if "(dp2 tp1 pp1" in str(t["name"])] if plot else []

    wait_until(lab, lambda: len(compared()) >= 1, "the compared run in the Training chart", limit_s=60)
    shot(lab, shots, "08-compare-runs")
    root.locator(".wb-compare-pick select").select_option([])  # unticked: the chart as before
    wait_until(lab, lambda: not compared(), "the compared run gone", limit_s=30)

    tails = root.locator(".wb-rank-output")
    wait_until(lab, tails.is_visible, "the ranks' output", limit_s=30)
    tails.get_by_text("rank 0: stdout/stderr, last lines").click()
    tails.locator("pre").first.wait_for()
    shot(lab, shots, "09-rank-output")
    tails.get_by_text("rank 0: stdout/stderr, last lines").click()


def test_random_edit_sequences_match_the_cli(lab, tmp_path):
    root = lab.locator(".wb-root").first
    rng = random.Random(19)
    edits = [("layout.dp", [1, 2, 4, 3]), ("layout.tp", [1, 2, 3]), ("layout.zero", [0, 1, 3]),
             ("precision.dtype", ["fp32", "bf16"]), ("train.micro_batch", [2, 4, 3]),
             ("resources.gpu", ["cpu", "a100-80gb"])]
    base = tmp_path / "base.yaml"
    base.write_text(json.dumps(SPEC))
    done: dict = {}
    for seq in range(3):
        for key, values in rng.sample(edits, k=4) + [("layout.tp", [3]), ("layout.tp", [1])]:
            done[key] = rng.choice(values)
            set_field(lab, root, key, done[key])
        cli = subprocess.run([sys.executable, "-m", "workbench.cli", "memory", str(base), "--json",
                              *[a for k, v in done.items() for a in ("--set", f"{k}={v}")]],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        if cli.returncode == 2:  # invalid: no chart, the error once, in the form
            wait_until(lab, lambda: lab.evaluate(PLOT, "Memory per rank (") is None, "the chart going", limit_s=30)
            assert root.locator(".wb-note-error").count() == 1, cli.stderr
            continue
        assert cli.returncode == 0, cli.stderr
        from workbench.report import figures

        fig = figures.memory_figure(json.loads(cli.stdout))
        want = {"title": fig.layout.title.text, "shapes": len(fig.layout.shapes or ()),
                "traces": [{"name": t.name, "n": len(t.x), "y": [round(v, 6) for v in t.y]} for t in fig.data]}

        def drawn():
            got = lab.evaluate(PLOT, "Memory per rank (")
            if got:
                for t in got["traces"]:
                    t["y"] = [round(v, 6) for v in t["y"]]
            return got

        wait_until(lab, lambda: drawn() == want, f"the chart of sequence {seq} ({done}); want {want}", limit_s=30)  # noqa: B023
    for key, value in (("layout.dp", 2), ("layout.tp", 1), ("layout.zero", 0), ("precision.dtype", "fp32"),
                       ("train.micro_batch", 4), ("resources.gpu", "cpu")):
        set_field(lab, root, key, value)
    assert not [p for p in lab.problems if "Error setting state" in p], lab.problems


def test_dispatch_settings_form(lab, shots):
    root = lab.locator(".wb-root").first
    button(root, "Dispatch to a cluster or cloud").click()
    backend = root.locator(".wb-dispatch-backend select")
    backend.select_option(label="SageMaker")
    settle(lab)
    role = root.locator(".wb-sagemaker-role input")
    role.click()
    role.type("arn:aws:iam::123456789012:role/Training", delay=5)  # key by key
    role.press("Tab")
    settle(lab)
    button(root, "Submit").click()  # no bucket, no credentials: the reason shows in the panel
    root.locator(".wb-dispatch-note .wb-note-error").wait_for()
    assert "backend.sagemaker.bucket is required" in root.locator(".wb-dispatch-note").inner_text()
    bucket = root.locator(".wb-sagemaker-bucket input")
    bucket.fill("my-training-bucket")
    bucket.press("Enter")
    settle(lab)
    backend.select_option(label="Vertex AI")
    settle(lab)
    assert lab.evaluate(PLOT, "Memory per rank (") is not None  # the job stays valid
    backend.select_option(label="SageMaker")
    settle(lab)
    assert role.input_value() == "arn:aws:iam::123456789012:role/Training"
    button(root, "Show request").click()
    root.locator(".wb-request").wait_for()
    summary = root.locator(".wb-request-summary").inner_text()
    for word in ("instance", "GPUs", "spot", "price / h", "checkpoint URI"):
        assert word in summary
    assert root.locator("button.wb-copy").count() == 1
    assert '"RoleArn": "arn:aws:iam::123456789012:role/Training"' in root.locator(".wb-request").inner_text()
    shot(lab, shots, "05-dispatch")
    check_stale_request_spot_and_address(lab, root, backend)
    backend.select_option(label="local (Ray on this machine)")
    settle(lab)


def check_stale_request_spot_and_address(lab, root, backend) -> None:
    """#34: the request goes when the layout changes; spot without an interval leaves the job valid
    with a note under the box; the Ray address is a placeholder, and two addresses run together are
    named and not taken."""
    set_field(lab, root, "layout.dp", 1)
    root.locator(".wb-dispatch-note", has_text="The spec changed since the request was shown").wait_for()
    assert root.locator(".wb-request").count() == 0
    set_field(lab, root, "layout.dp", 2)
    spot = root.locator(".wb-dispatch-spot input")
    spot.check()
    settle(lab)
    root.locator(".wb-spot-note .wb-note-error", has_text="every N steps").wait_for()
    assert lab.evaluate(PLOT, "Memory per rank (") is not None  # the job stays valid
    spot.uncheck()
    settle(lab)
    assert root.locator(".wb-spot-note .wb-note-error").count() == 0
    backend.select_option(label="Ray cluster")
    settle(lab)
    address = root.locator(".wb-ray-address input")
    assert address.input_value() == "" and address.get_attribute("placeholder") == "http://127.0.0.1:8265"
    address.click()
    address.type("http://ray-head.internal:8265", delay=2)
    address.press("Tab")
    settle(lab)
    assert address.input_value() == "http://ray-head.internal:8265"  # typed over the placeholder, not appended
    address.fill("http://127.0.0.1:8265http://ray-head.internal:8265")
    address.press("Enter")
    settle(lab)
    root.locator(".wb-dispatch-field-error", has_text="more than one address").wait_for()
    address.fill("")
    address.press("Enter")
    settle(lab)


def test_a_model_folder_sets_the_model(lab, shots, tmp_path):
    """A local Hugging Face folder typed into the form becomes the model: the memory chart is that
    model's; a folder without config.json shows one plain error under the field."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    folder = tmp_path / "released-model"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=128, bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    root = lab.locator(".wb-root").first
    path = root.locator(".wb-model-path input")
    for value in (str(tmp_path), str(folder)):
        path.fill(value)
        path.press("Enter")
        settle(lab)
        if value == str(tmp_path):
            root.locator(".wb-note-error", has_text="no config.json there").wait_for()
            assert root.locator(".wb-note-error").count() == 1
    spec = tmp_path / "folder.yaml"
    spec.write_text(json.dumps({**SPEC, "model": {"init": "hf", "path": str(folder)}}))
    cli = subprocess.run([sys.executable, "-m", "workbench.cli", "memory", str(spec), "--json"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr
    from workbench.report import figures

    want = figures.memory_figure(json.loads(cli.stdout)).layout.title.text
    wait_until(lab, lambda: (lab.evaluate(PLOT, "Memory per rank (") or {}).get("title") == want,
               f"the folder model's chart ({want})", limit_s=30)
    assert root.locator(".wb-model-layers input").input_value() == "3"
    assert root.locator(".wb-note-error").count() == 0
    shot(lab, shots, "06-model-folder")
    path.fill("")
    path.press("Enter")
    settle(lab)
    assert root.locator(".wb-model-preset select").input_value() == "gpt-tiny"


def test_import_config_asks_before_replacing(lab, shots):
    """#34: a DeepSpeed config picked in the browser lists what it would replace and changes nothing
    until Apply import; Keep my spec drops it and the form is as it was."""
    root = lab.locator(".wb-root").first
    zero = root.locator(".wb-layout-zero button.mod-active").inner_text().strip()
    fixture = ROOT / "tests" / "fixtures" / "interop" / "ds_zero3_offload_bf16.json"
    with lab.expect_file_chooser() as chooser:  # (the widget's <input type=file> is not in the page)
        root.locator(".wb-import-config").click()
    chooser.value.set_files(str(fixture))
    note = root.locator(".wb-note-warning", has_text="nothing is changed until Apply import")
    note.wait_for()
    assert "layout.zero: 0 -> 3" in note.inner_text() and button(root, "Apply import").is_visible()
    settle(lab)
    assert root.locator(".wb-layout-zero button.mod-active").inner_text().strip() == zero == "0"
    shot(lab, shots, "10-import-asks")
    button(root, "Keep my spec").click()
    root.locator(".wb-note-info", has_text="the spec being edited is unchanged").wait_for()
    settle(lab)
    assert not button(root, "Apply import").is_visible()
    assert root.locator(".wb-layout-zero button.mod-active").inner_text().strip() == "0"


# The live Training chart's drawn width (its svg) and its column's, in px.
RUN_CHART_WIDTH = """() => { const svg = document.querySelector('.wb-root .wb-run-chart .main-svg');
  const col = document.querySelector('.wb-root .wb-right');
  return svg && col ? [Math.round(svg.getBoundingClientRect().width), Math.round(col.getBoundingClientRect().width)]
                    : null; }"""


X_TITLE = """() => { const g = document.querySelector('.wb-root .wb-run-chart .js-plotly-plot');
  const t = g && g.layout && g.layout.xaxis && g.layout.xaxis.title;
  return t ? String(t.text || t) : null; }"""


def test_the_live_chart_follows_its_column_after_a_redraw(lab):
    """#34: the window resized, then the chart redrawn with another figure (here: the x axis changed),
    then the window narrowed: the chart follows the narrower column. With plotly's FigureWidget it
    stayed at the width it had when redrawn (the redraw cleared the "autosize" plotly.js had recorded,
    and plotly.js pins the width it has then); the live chart is drawn with Plotly.react now."""
    root = lab.locator(".wb-root").first
    wait_until(lab, lambda: lab.evaluate(RUN_CHART_WIDTH) is not None, "the Training chart", limit_s=60)
    lab.set_viewport_size({"width": 1600, "height": 1000})
    wait_until(lab, lambda: abs(lab.evaluate(RUN_CHART_WIDTH)[0] - lab.evaluate(RUN_CHART_WIDTH)[1]) < 80,
               "the chart following the wider window", limit_s=30)
    settle(lab)  # the kernel has the browser's relayout
    for axis in ("tokens", "step"):  # a redraw with another figure: the x axis is another quantity
        root.locator(".wb-run-x-axis button", has_text=re.compile(rf"^\s*{axis}\s*$")).click()
        wait_until(lab, lambda: lab.evaluate(X_TITLE) == axis, f"the chart redrawn on {axis}", limit_s=30)  # noqa: B023
    lab.set_viewport_size({"width": 1000, "height": 1000})
    t0 = time.monotonic()
    while (got := lab.evaluate(RUN_CHART_WIDTH)) and got[0] > got[1] + 2 and time.monotonic() - t0 < 30:
        time.sleep(0.5)
    lab.set_viewport_size({"width": 1400, "height": 1000})
    assert got and got[0] <= got[1] + 2, f"Training chart {got[0]} px wide in a column of {got[1]} px"


# What plotly.js holds for each chart in the right-hand column: for a chart that did not follow its column.
PLOT_STATE = """() => [...document.querySelectorAll('.wb-right .js-plotly-plot')].map(g => ({
  title: String(g.layout && g.layout.title && g.layout.title.text || '').slice(0, 24), traces: (g.data || []).length,
  box: g.closest('[class*="wb-"]:not(.wb-right)')?.className.slice(0, 60), client: g.clientWidth,
  drawn: g._fullLayout && g._fullLayout.width, autosize: g.layout && g.layout.autosize,
  pinned: g.layout && [g.layout.width, g.layout.height],
  zeroWidthAtFirstDraw: g._context && g._context._hasZeroWidth, hidden: g.offsetParent === null,
  parents: (() => { const o = []; for (let e = g.parentElement, i = 0; e && i < 4; e = e.parentElement, i++) o.push(e.clientWidth); return o; })()}))"""


def overflow(lab, width: int) -> list:
    stuck = lab.evaluate(OVERFLOW)
    if width == 800:  # a ~370 px column: the planner's 9 columns scroll inside their own box there
        stuck = [s for s in stuck if not str(s[0]).startswith(("wider inside", "cell "))]
    return stuck


def test_layout_fits_1000_to_1920_px(lab, shots):
    root = lab.locator(".wb-root").first
    button(root, "Find layouts that fit").click()
    root.locator(".wb-plan-table").wait_for()
    # where the planner's numbers come from, above them; no MFU for the CPU rows (a tooltip says why)
    assert root.locator(".wb-plan-source").inner_text().startswith(
        "Predicted step time, tokens/s, MFU and cost: catalog defaults")
    cells = root.locator(".wb-plan-table .wb-no-mfu")
    assert cells.count() >= 1 and set(cells.all_inner_texts()) == {"-"}
    assert "tensor-core peak" in cells.first.get_attribute("title")
    set_field(lab, root, "train.micro_batch", 3)  # invalid: the error beside the batch fields
    root.locator(".wb-note-error", has_text="must be divisible by dp(2) x micro_batch(3) = 6").wait_for()
    shot(lab, shots, "04-invalid-layout")
    set_field(lab, root, "train.micro_batch", 4)
    for width in (1920, 1400, 1000, 800):
        lab.set_viewport_size({"width": width, "height": 1000})
        time.sleep(1.5)  # reflow, and plotly's resize: under load 40 it took longer (plots still 1920 px wide)
        t0 = time.monotonic()
        while (stuck := overflow(lab, width)) and time.monotonic() < t0 + 30:
            print(f"{width} px, {time.monotonic() - t0:.1f} s after the reflow's 1.5 s: {stuck}")
            time.sleep(1.0)
        shot(lab, shots, f"width-{width}")
        if stuck:  # printed whole (an assertion's message is cut): what plotly.js holds for each chart
            print(f"{width} px, stuck:", json.dumps(lab.evaluate(PLOT_STATE)))
        assert not stuck, (width, stuck)
    lab.set_viewport_size({"width": 1400, "height": 1000})
    check_the_dark_theme(lab, root, shots)


# The text color of each note and of the run log against the page's background, as a contrast ratio.
CONTRAST = """() => { const lum = (c) => { const v = c.match(/[\\d.]+/g).slice(0, 3).map(Number).map(x => x / 255)
    .map(x => x <= 0.03928 ? x / 12.92 : Math.pow((x + 0.055) / 1.055, 2.4)); return 0.2126*v[0] + 0.7152*v[1] + 0.0722*v[2]; };
  const bg = lum(getComputedStyle(document.querySelector('.jp-Notebook')).backgroundColor);
  return Array.from(document.querySelectorAll('.wb-root .wb-note, .wb-root .wb-model-size')).map(n => {
    const f = lum(getComputedStyle(n).color); return (Math.max(f, bg) + 0.05) / (Math.min(f, bg) + 0.05); }); }"""


def check_the_dark_theme(lab, root, shots) -> None:
    """#34: under JupyterLab Dark the notes are readable (they read at 1.1:1) and the charts' text is light."""
    lab.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    lab.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=60_000)
    time.sleep(2.0)
    ratios = lab.evaluate(CONTRAST)
    shot(lab, shots, "dark-1400")
    fill = lab.evaluate("""() => getComputedStyle(document.querySelector('.wb-root .main-svg .gtitle')).fill""")
    lab.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
    lab.wait_for_function("() => document.body.dataset.jpThemeLight === 'true'", timeout=60_000)
    assert ratios and min(ratios) >= 4.5, ratios
    assert fill != "rgb(68, 68, 68)", fill  # plotly's dark grey on a dark page


def test_the_kernel_is_alive_90s_after_the_last_run(lab, lab_server):
    assert "last_run_end" in lab.info, "the runs test did not finish"
    time.sleep(max(0.0, lab.info["last_run_end"] + ALIVE_AFTER_S - time.monotonic()))
    # the same kernel, never restarted, and idle once the messages in flight (a chart's resize) are answered
    assert lab.evaluate(KERNEL)[0] == lab.info["kernel"]
    lab.wait_for_function(KERNEL_IDLE, timeout=30_000)
    root = lab.locator(".wb-root").first
    set_field(lab, root, "layout.dp", 4)  # and it still answers the widgets
    wait_until(lab, lambda: (lab.evaluate(PLOT, "Memory per rank (") or {"traces": [{}]})["traces"][0].get("n") == 4,
               "a chart of 4 ranks after the wait", limit_s=30)
    tracebacks = lab.locator(".jp-OutputArea-output", has_text="Traceback")
    assert tracebacks.count() == 0, tracebacks.first.inner_text()[:2000]
    offsite = [p for p in lab.problems if "requestfailed" in p and "127.0.0.1" not in p]
    assert not offsite, offsite  # nothing from a CDN
    assert not [p for p in lab.problems if p.startswith("pageerror")], lab.problems


# Run Python in the notebook's kernel, as a cell would, and wait for it: "ok" or the error's name.
KERNEL_RUN = """async (code) => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  const reply = await k.requestExecute({code}).done; return reply.content.status === 'ok' ? 'ok' : reply.content.ename; }"""
HOST_PLOTS = """() => [...document.querySelectorAll('.wb-root .wb-host-chart .js-plotly-plot')].map(
  g => [g.offsetParent !== null, String(g.layout && g.layout.title && g.layout.title.text || '')])"""


def test_the_hosts_chart_survives_being_dropped_and_drawn_again_quickly(lab):
    """#34: at each run's start the hosts' chart has no figure until the first memory event. Its
    FigureWidget was dropped and a new one made (each sends the page plotly's 5 MB bundle): done in
    quick succession the page was left without the chart for seconds or for good (2 of 4 such storms,
    with "Cannot read properties of undefined (reading '_guiEditing')" in the console). Now the same
    widget is hidden and shown again, and it is a LiveFigure: a FigureWidget kept across runs still
    went blank for good in one CI run (its 5 MB module missed anywidget's 2 s deadline)."""
    problems = len(lab.problems)
    storm = """
import time
from workbench.report import figures
events = [{"event": "step", "step": i, "loss": 3.0, "tokens_per_s": 1.0, "step_time_s": 0.1} for i in range(1, 11)]
events += [{"event": "memory", "rank": r, "step": s, "step_time_s": 0.1, "cpu_s": 0.05, "host": {"rss_bytes": 3 << 28}}
           for r in (0, 1) for s in (1, 5, 10)]
for i in range(20):
    wb.run_panel.host_box.show(None)
    time.sleep(GAP)
    wb.run_panel.host_box.show(figures.host_figure(events[:10 + i % 6]))
    time.sleep(GAP)
"""
    for gap in (0.05, 0.3):
        assert lab.evaluate(KERNEL_RUN, f"GAP = {gap}\n" + storm) == "ok"
        settle(lab)
        wait_until(lab, lambda: lab.evaluate(HOST_PLOTS) == [[True, "Hosts and GPUs per rank"]],
                   f"the hosts' chart after a storm of redraws {gap} s apart", limit_s=10)
        assert not lab.evaluate(OVERFLOW), json.dumps(lab.evaluate(PLOT_STATE))
    assert lab.problems[problems:] == []


# anywidget gives each model 2 s to load its module (AbortSignal.timeout(2000) in its runtime) and,
# past that, drops whatever the kernel sends the model. Here every such deadline in the page has passed
# before the module can load: it aborts in a microtask, right after the runtime listens to it (a 1 ms
# deadline raced the import of a 2.5 KB module, and lost in one CI run).
DEADLINE_PASSED = """(() => { const timeout = AbortSignal.timeout.bind(AbortSignal);
  AbortSignal.timeout = (ms) => {
    if (ms !== 2000) return timeout(ms);
    const deadline = new AbortController();
    queueMicrotask(() => deadline.abort());
    return deadline.signal;
  }; })()"""
LIVE_CELL = """import plotly.graph_objects as go
from workbench.ui.live import LiveFigure
box = LiveFigure()
def fig(title, n):
    return go.Figure(go.Scatter(y=list(range(n)), name="a"), layout=dict(title=dict(text=title), height=300))
box"""
LIVE_PLOTS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(g => [
  String(g.layout && g.layout.title && g.layout.title.text), (g.data && g.data[0] && g.data[0].y || []).length,
  Math.round(g.querySelector('.main-svg').getBoundingClientRect().width), g.parentElement.clientWidth])"""


def test_a_live_chart_draws_every_figure_when_anywidget_gives_up_on_its_model(lab_server, browser, work_dir):
    """In one CI run on a loaded host the hosts' chart (then plotly's FigureWidget, whose module is all
    of plotly.js, 5 MB) missed anywidget's 2 s deadline: it came up with no title, never heard another
    figure and kept its first width at every window size, with nothing in the console. With the
    deadline passed in the page before any module loads, a LiveFigure still draws each figure and
    follows the window (its figures travel on a plain ipywidgets model; a FigureWidget made so stayed
    untitled here)."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(LIVE_CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(work_dir / "live.ipynb"))
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.add_init_script(DEADLINE_PASSED)

    def until(cond, what):
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < 30, f"no {what} after 30 s: {page.evaluate(LIVE_PLOTS)}; {errors}"
            time.sleep(0.3)

    try:
        page.goto(f"{lab_server}/lab/tree/live.ipynb?reset")
        page.wait_for_function(KERNEL_IDLE, timeout=120_000)
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        page.wait_for_function(KERNEL_IDLE, timeout=120_000)
        for title, n in (("first", 3), ("second", 5), ("third", 8)):
            assert page.evaluate(KERNEL_RUN, f"box.show(fig({title!r}, {n}))") == "ok"
            until(lambda: [p[:2] for p in page.evaluate(LIVE_PLOTS)] == [[title, n]], f"figure {title!r}")  # noqa: B023
        page.set_viewport_size({"width": 1000, "height": 1000})
        until(lambda: abs(page.evaluate(LIVE_PLOTS)[0][2] - page.evaluate(LIVE_PLOTS)[0][3]) <= 2,
              "chart as wide as its box at 1000 px")
    finally:
        ctx.close()
    assert "[anywidget] Failed to initialize model." in errors, errors  # the deadline did pass
