"""The run dashboard (#34): x axis as step, wall time or tokens; smoothing of every curve; runs of
other sessions read from metrics JSONL files and checkpoint folders and overlaid with their layout;
host and GPU figures per rank; the tail of each rank's stdout/stderr; a zoom that survives updates."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("ipywidgets")
traitlets = pytest.importorskip("traitlets")
pytest.importorskip("plotly")

from workbench.report import figures  # noqa: E402
from workbench.ui.app import Workbench  # noqa: E402
from workbench.ui.live import LiveFigure  # noqa: E402
from workbench.ui.runs import load_run, load_runs, rank_tails, tail  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def steps(n, first=1, tps=1000.0, dt=0.5, t0=100.0, loss=None):
    return [{"event": "step", "step": k, "loss": (loss or (lambda k: 5.0 / k))(k), "tokens_per_s": tps,
             "step_time_s": dt, "time": t0 + (k - first + 1) * dt} for k in range(first, first + n)]


def test_x_axis_as_tokens_sums_each_steps_tokens_and_counts_the_steps_before_a_resume():
    assert figures.step_x(steps(3), "tokens") == [500, 1000, 1500]  # 1000 tokens/s x 0.5 s per step
    assert figures.step_x(steps(2, first=4), "tokens") == [2000, 2500]  # steps 1-3 at the first step's tokens
    assert figures.step_x(steps(3), "step") == [1, 2, 3]


def test_x_axis_as_wall_time_starts_at_the_first_steps_start():
    assert figures.step_x(steps(3, t0=100.0), "time") == [0.5, 1.0, 1.5]
    no_time = [{k: v for k, v in e.items() if k != "time"} for e in steps(3, dt=0.25)]
    assert figures.step_x(no_time, "time") == [0.25, 0.5, 0.75]  # summed step times
    with pytest.raises(ValueError, match="tokens"):
        figures.step_x(steps(1), "epoch")


def test_run_figure_puts_every_event_on_the_chosen_axis():
    events = steps(4) + [{"event": "eval", "step": 2, "loss": 3.0, "perplexity": 20.0},
                         {"event": "restart", "attempt": 0, "from_step": 2}]
    fig = figures.run_figure(events, x_axis="tokens", predicted={"step_time_s": 0.4, "tokens_per_s": 1200.0,
                                                                 "source": "catalog"})
    assert list(fig.data[0].x) == [500, 1000, 1500, 2000] and fig.layout.xaxis.title.text == "tokens"
    assert fig.layout.xaxis3.title.text == "tokens"
    val = next(t for t in fig.data if t.name == "val_loss")
    assert list(val.x) == [1000]  # step 2's tokens
    assert [s.x0 for s in fig.layout.shapes if s.type == "line"] == [1000] * 3  # the restart, on every panel
    assert list(next(t for t in fig.data if t.name == "predicted").x) == [0, 2000]
    timed = figures.run_figure(events, x_axis="time")
    assert list(timed.data[0].x) == [0.5, 1.0, 1.5, 2.0] and timed.layout.xaxis.title.text == "wall time (s)"


def test_smoothing_applies_to_every_curve_of_the_run_and_of_other_runs():
    noisy = [{**e, "tokens_per_s": 1000.0 + (300 if e["step"] % 2 else -300), "step_time_s": 0.5 + 0.1 * (e["step"] % 2)}
             for e in steps(6)]
    raw = figures.run_figure(noisy, history=[{"label": "run 1", "events": noisy}])
    smooth = figures.run_figure(noisy, history=[{"label": "run 1", "events": noisy}], smooth=0.6)
    for i in range(len(raw.data)):
        assert list(smooth.data[i].y) == figures.smoothed(list(raw.data[i].y), 0.6), raw.data[i].name
        assert list(smooth.data[i].y) != list(raw.data[i].y), raw.data[i].name
    assert [t.name for t in smooth.data][3:] == ["run 1"] * 3  # the other run on all three panels
    assert [t.showlegend for t in smooth.data][3:] == [True, False, False]  # one legend entry per run


def test_smoothed_keeps_gaps_without_resetting_the_average():
    assert figures.smoothed([1.0, None, 3.0], 0.5) == [1.0, None, 2.0]
    assert figures.smoothed([1.0, 3.0], 0.0) == [1.0, 3.0]


def memory_event(rank, step, cpu_s, wall, rss=None, gpu=None):
    e = {"event": "memory", "step": step, "rank": rank, "coords": {"dp": rank, "tp": 0, "pp": 0},
         "step_time_s": wall, "cpu_s": cpu_s, "measured": {"params": 1, "peak": 2}}
    if rss is not None:
        e["host"] = {"rss_bytes": rss}
    if gpu is not None:
        e["gpu"] = gpu
    return e


def test_host_figure_draws_cpu_and_memory_per_rank_and_gpu_only_when_reported():
    events = steps(5) + [memory_event(r, s, cpu_s=0.25 * (r + 1), wall=0.5, rss=(300 + r) << 20)
                         for s in (1, 5) for r in (0, 1)]
    fig = figures.host_figure(events)
    assert [a.text for a in fig.layout.annotations] == ["host CPU<br>(%)", "host memory<br>(MiB)"]
    cpu = [t for t in fig.data if t.xaxis == "x"]
    assert [t.name for t in cpu] == ["rank 0", "rank 1"] and list(cpu[1].y) == [100.0, 100.0]
    assert list(cpu[0].y) == [50.0, 50.0] and list(cpu[0].x) == [1, 5]
    mem = [t for t in fig.data if t.xaxis == "x2"]
    assert list(mem[1].y) == [301.0, 301.0]
    gpu = {"util_percent": 87.0, "memory_used_bytes": 40 << 30, "memory_total_bytes": 80 << 30}
    fig = figures.host_figure(steps(5) + [memory_event(0, 1, 0.1, 0.5, rss=1 << 30, gpu=gpu)], x_axis="tokens")
    assert [a.text for a in fig.layout.annotations] == ["host CPU<br>(%)", "host memory<br>(GiB)", "GPU busy<br>(%)",
                                                        "GPU memory<br>(GiB)"]
    assert [list(t.y) for t in fig.data[2:]] == [[87.0], [40.0]] and list(fig.data[0].x) == [500]


@pytest.fixture(scope="module")
def two_real_runs(tmp_path_factory):
    """Two runs of the runtime in this process (gpt-tiny, 3 steps, micro-batch 4 and 8): the first's
    metrics as `--metrics-out` writes them, the second's inside its checkpoint folder."""
    from workbench.runtime.loop import train

    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, micro, ckpt in (("alpha", 4, None), ("beta", 8, root / "beta-ckpt")):
        spec = {"name": name, "model": {"preset": "gpt-tiny"}, "train": {"steps": 3, "global_batch": 8, "micro_batch": micro}}
        if ckpt is not None:
            spec["checkpoint"] = {"uri": str(ckpt), "every_steps": 2}
        events: list[dict] = []
        train(spec, events.append)
        path = (ckpt / "metrics.jsonl") if ckpt else root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in events) + "100%|####| 3/3 [00:01<00:00]\n")
        out[name] = (path, events)
    return root, out


def test_the_runtimes_memory_events_carry_the_hosts_resident_memory(two_real_runs):
    _, runs = two_real_runs
    memory = [e for e in runs["alpha"][1] if e["event"] == "memory"]
    assert memory and all(e["host"]["rss_bytes"] > 50 << 20 for e in memory)  # a process with torch loaded
    assert all("gpu" not in e for e in memory)  # CPU: no GPU figures, quietly
    fig = figures.host_figure(runs["alpha"][1])
    unit = "GiB" if max(e["host"]["rss_bytes"] for e in memory) >= 2**29 else "MiB"  # the process's own size decides
    assert [a.text for a in fig.layout.annotations][:2] == ["host CPU<br>(%)", f"host memory<br>({unit})"]


def test_runs_load_from_a_metrics_file_and_a_checkpoint_folder_with_their_layout(two_real_runs):
    root, runs = two_real_runs
    alpha = load_run(runs["alpha"][0])
    assert alpha["events"] == runs["alpha"][1]  # the progress line is not an event
    assert alpha["label"] == "alpha (dp1 tp1 pp1)"  # the degrees its memory events imply
    beta = load_run(root / "beta-ckpt")
    assert beta["label"] == "beta (dp1 tp1 pp1 mb=8)" and beta["checkpoints"] == [2, 3]  # the manifest's spec
    assert [e["step"] for e in beta["events"] if e["event"] == "step"] == [1, 2, 3]
    found, problems = load_runs(str(root / "*"))
    assert sorted(r["label"] for r in found) == ["alpha (dp1 tp1 pp1)", "beta (dp1 tp1 pp1 mb=8)"] and not problems
    found, problems = load_runs(str(root / "nothing.jsonl"))
    assert not found and "does not exist" in problems[0]


def test_picked_runs_overlay_the_training_chart_with_a_legend_of_their_layouts(two_real_runs):
    root, runs = two_real_runs
    panel = Workbench().run_panel
    loaded = panel.compare.add(str(root / "*"))
    assert len(loaded) == 2 and set(panel.compare.pick.value) == {r["path"] for r in loaded}
    fig = panel.run_box.figure
    legend = [t.name for t in fig.data if t.showlegend]
    assert sorted(legend) == ["alpha (dp1 tp1 pp1)", "beta (dp1 tp1 pp1 mb=8)"]
    alpha = [t for t in fig.data if t.name == "alpha (dp1 tp1 pp1)"]
    assert [list(t.y) for t in alpha][0] == [e["loss"] for e in runs["alpha"][1] if e["event"] == "step"]
    assert "(compared runs)<br>" in fig.data[3].hovertemplate  # its group, in the hover
    panel.x_axis.value = "tokens"
    assert list(panel.run_box.figure.data[3].x) == figures.step_x(
        [e for e in runs["alpha"][1] if e["event"] == "step"], "tokens")
    panel.compare.pick.value = ()
    assert not [t for t in panel.run_box.figure.data if t.showlegend]
    panel.compare.add(str(root / "missing-*"))
    assert "does not exist" in panel.compare.note.value


def sent(box) -> list[dict]:
    """What the page is sent for each figure: the figures' JSON, as the page parses them."""
    out = []
    box._figures.observe(lambda ch: out.append(json.loads(ch["new"])), names="figure")
    return out


def test_a_live_chart_sends_each_new_figure_whole_with_a_uirevision_per_axis():
    """The page draws each figure again with Plotly.react into the same chart (live_figure.js); what a
    person did to it stays while the uirevisions stay. An axis's is its title: a zoom over steps goes
    when the x axis comes to measure tokens (browser: check_a_zoom_survives_new_steps)."""
    box = LiveFigure()
    figs = sent(box)
    box.show(figures.run_figure(steps(3)))
    box.show(figures.run_figure(steps(3)))  # the same figure again (the refresher): nothing sent
    box.show(figures.run_figure(steps(6)))
    box.show(figures.run_figure(steps(6), x_axis="tokens"))
    assert len(figs) == 3 and box.figure.layout.xaxis.title.text == figures.X_AXES["tokens"]
    assert [len(f["data"][0]["x"]) for f in figs] == [3, 6, 6]
    assert figs[2]["layout"]["title"]["text"].startswith("Training: step 6")
    assert {f["layout"]["uirevision"] for f in figs} == {"live"}
    revisions = [{k: v["uirevision"] for k, v in f["layout"].items() if k.startswith(("xaxis", "yaxis"))} for f in figs]
    assert revisions[0] == revisions[1] and revisions[0]["xaxis"] == figures.X_AXES["step"]
    assert revisions[2]["xaxis"] == figures.X_AXES["tokens"] and revisions[2]["yaxis"] == revisions[1]["yaxis"]


def test_no_figure_hides_the_chart_and_the_next_one_shows_it_again():
    """The hosts' chart has no figure at each run's start: it is hidden, not dropped, and the next
    figure shows it again (its page side follows the box's width, so shown again it fits)."""
    box = LiveFigure()
    figs = sent(box)
    box.show(None)  # nothing yet
    assert box.layout.display == "none" and figs == []
    box.show(figures.run_figure(steps(3)))
    assert box.layout.display is None and len(figs) == 1
    box.show(None)
    assert box.figure is None and box.layout.display == "none" and len(figs) == 1
    box.show(figures.run_figure(steps(3)))  # the figure it had: shown again, and nothing more to send
    assert box.layout.display is None and len(figs) == 1 and box.figure is not None


def test_nothing_the_chart_needs_comes_to_its_anywidget_model_after_it_is_made():
    """anywidget gives a model 2 s to load its module and, past that, drops what the kernel sends it;
    FigureWidget's module is all of plotly.js (5 MB), and under load its chart never heard from the
    kernel again (CI). plotly.js is in the model's first state, and the figures travel on a plain
    ipywidgets model (browser: test_a_live_chart_draws_every_figure_when_anywidget_gives_up_on_its_model)."""
    import plotly

    box = LiveFigure()
    own = []
    box.observe(lambda ch: own.append(ch["name"]), names=traitlets.All)
    box.show(figures.run_figure(steps(3)))
    box.show(figures.run_figure(steps(4)))
    assert own == [] and box._figures._model_name == "WidgetModel" and box._figures._view_name is None
    assert box.get_state()["_figures"] == f"anywidget:{box._figures.model_id}"  # what host.getModel reads
    assert len(box._esm) < 4000 and "Plotly.react" in box._esm
    assert box._plotly_version == plotly.__version__ and "* plotly.js v" in box._plotly_js[:100]
    assert "window.Plotly = Plotly;" in box._plotly_js[-200:]  # what live_figure.js reads once it loaded


def test_the_run_panel_draws_each_step_in_the_same_chart():
    wb = Workbench()
    st, panel = wb.state, wb.run_panel
    figs = sent(panel.run_box)
    st.start_events("run 1")
    for e in steps(3):
        st.add_event(e)
    panel.render()
    for e in steps(5)[3:]:
        st.add_event(e)
    panel.render()
    assert [len(f["data"][0]["x"]) for f in figs] == [3, 5]


def test_each_ranks_stdout_and_stderr_tail_is_shown(tmp_path):
    out, err = tmp_path / "worker-1.out", tmp_path / "worker-1.err"
    out.write_text("".join(f"line {i}\n" for i in range(1, 1001)))
    err.write_text("Traceback: boom\n")
    events = [{"event": "worker", "rank": 0, "pid": 1, "attempt": 0, "stdout": str(out), "stderr": str(err)},
              {"event": "worker", "rank": 1, "pid": 2, "attempt": 0}]  # no files named: nothing shown
    assert tail(str(out), 3) == "line 998\nline 999\nline 1000"
    assert rank_tails(events, lines=2) == {0: {"stdout": "line 999\nline 1000", "stderr": "Traceback: boom"}}
    big = tmp_path / "big.out"
    big.write_text("x" * 200_000 + "\nlast\n")
    assert tail(str(big), 5) == "last"  # the cut first line of the last 64 KiB is not shown
    wb = Workbench()
    wb.state.start_events("run 1")
    for e in events:
        wb.state.add_event(e)
    panel = wb.run_panel
    panel.render()
    assert panel.rank_output.titles == ("rank 0: stdout/stderr, last lines",)  # rank 1 named no files
    shown = panel.rank_output.children[0]
    assert "line 1000" in shown.value and "Traceback: boom" in shown.value and "line 980" not in shown.value
    panel.rank_output.selected_index = 0  # a person opens it
    with open(out, "a") as f:
        f.write("line 1001\n")
    panel.render()
    assert panel.rank_output.children[0] is shown and "line 1001" in shown.value
    assert panel.rank_output.selected_index == 0  # new output does not close it


def test_the_local_backend_names_the_files_a_ranks_output_goes_to(tmp_path):
    out, err = tmp_path / "w.out", tmp_path / "w.err"
    with open(out, "w") as o, open(err, "w") as e:
        subprocess.run([sys.executable, "-c", "import json; from backends.ray_relay import _output_files; "
                        "print(json.dumps(_output_files()))"], stdout=o, stderr=e, cwd=ROOT, check=True)
    assert json.loads(out.read_text()) == {"stdout": str(out), "stderr": str(err)}


class FakeNVML:
    """nvidia-ml-py's calls the runtime makes, answering for GPUs by physical index or UUID (no GPU here)."""

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.asked = []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        self.asked.append(i)
        return f"gpu{i}"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.asked.append(uuid)
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=71)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=3 << 30, total=80 << 30)


def test_gpu_figures_come_from_the_physical_gpu_cuda_visible_devices_names(monkeypatch):
    from workbench.runtime import host

    nvml = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    host._nvml_handle.cache_clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    got = host.host_figures(SimpleNamespace(type="cuda", index=1))
    assert got["gpu"] == {"util_percent": 71.0, "memory_used_bytes": 3 << 30, "memory_total_bytes": 80 << 30}
    assert got["host"]["rss_bytes"] > 0 and nvml.asked == [5]  # torch's cuda:1 is the fifth GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb")
    host.host_figures(SimpleNamespace(type="cuda", index=0))
    assert nvml.asked == [5, "GPU-aa"]
    assert "gpu" not in host.host_figures(SimpleNamespace(type="cpu", index=None))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: no GPU figures, no error
    host._nvml_handle.cache_clear()
    assert "gpu" not in host.host_figures(SimpleNamespace(type="cuda", index=0))
    host._nvml_handle.cache_clear()


def test_a_notebook_runs_metrics_kept_in_its_checkpoint_folder_are_the_ones_read_back(tmp_path, two_real_runs):
    from workbench.runtime.checkpoint_store import new_manifest, step_name
    from workbench.spec import load_spec
    from workbench.ui.runs import save_events

    _, runs = two_real_runs
    spec = load_spec({"name": "nb", "model": {"preset": "gpt-tiny"}, "layout": {"dp": 2},
                      "resources": {"gpu": "cpu", "gpus_per_node": 2}}).to_dict()
    (tmp_path / step_name(3)).mkdir()
    manifest = {**new_manifest(3, spec, 2, {}, 0.1), "run_id": "notebook-abc"}
    (tmp_path / step_name(3) / "manifest.json").write_text(json.dumps(manifest))
    save_events(runs["alpha"][1], tmp_path, "notebook-abc")
    (tmp_path / "later-other-run.jsonl").write_text(json.dumps(runs["beta"][1][0]) + "\n")  # newer, not its own
    run = load_run(tmp_path)
    assert run["run_id"] == "notebook-abc" and run["label"] == "nb (dp2 tp1 pp1 mb=4)"
    assert run["events"] == runs["alpha"][1] and run["metrics"].endswith("metrics-notebook-abc.jsonl")
