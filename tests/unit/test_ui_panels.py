"""The notebook panels without a browser: every view is drawn from the state, edits never leave a
stale chart or plan, dispatch settings stay per backend, nothing is clamped, Resume needs a checkpoint."""
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from workbench.memory import estimate_memory  # noqa: E402
from workbench.spec import load_spec  # noqa: E402
from workbench.ui import figures  # noqa: E402
from workbench.ui.app import Workbench  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# (field, values): valid and invalid ones for the quickstart's gpt-tiny (4 heads, 2 layers)
EDITS = [("layout.dp", [1, 2, 3, 4, 8, 0]), ("layout.tp", [1, 2, 3, 4, 100]), ("layout.pp", [1, 2, 3]),
         ("layout.zero", [0, 1, 2, 3]), ("precision.dtype", ["fp32", "bf16"]),
         ("layout.activation_checkpointing", ["none", "full"]), ("train.micro_batch", [1, 2, 3, 4]),
         ("train.global_batch", [16, 32, 12]), ("resources.gpu", ["cpu", "a100-80gb", "t4"])]


def shown(box):
    return box.figure


def bars(fig) -> dict:
    """Per trace name: its y values (what the chart draws), plus the title and shaded ranks."""
    out = {t.name: [round(v, 9) if v is not None else None for v in (t.y or ())] for t in fig.data}
    out["title"] = fig.layout.title.text
    out["shapes"] = len(fig.layout.shapes or ())
    return out


def test_random_edit_sequences_always_show_the_final_form():
    rng = random.Random(0)
    wb = Workbench()
    fields = wb.layout_panel.fields
    for _ in range(8):
        for key, values in rng.sample(EDITS, k=4):
            fields[key].value = rng.choice(values)
        chart = shown(wb.memory_panel.fig_box)
        try:
            spec = load_spec(wb.state.raw)
        except Exception:  # noqa: BLE001 - invalid: no chart, the error in the form
            assert chart is None and wb.state.error
            assert sum(bool(e.value) for e in wb.layout_panel.errors.values()) == 1
            continue
        assert chart is not None, wb.state.estimate_note
        assert bars(chart) == bars(figures.memory_figure(estimate_memory(spec).to_dict()))
        assert not any(e.value for e in wb.layout_panel.errors.values())


def test_the_chart_matches_the_cli_after_an_invalid_edit(tmp_path):
    wb = Workbench()
    f = wb.layout_panel.fields
    f["layout.tp"].value = 3  # invalid: 4 heads
    f["layout.tp"].value = 1
    f["layout.dp"].value = 4
    path = tmp_path / "s.yaml"
    wb.save(path)
    cli = subprocess.run([sys.executable, "-m", "workbench.cli", "memory", str(path), "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    expected = figures.memory_figure(json.loads(cli.stdout))
    assert bars(shown(wb.memory_panel.fig_box)) == bars(expected)
    assert len(shown(wb.memory_panel.fig_box).data[0].x) == 4
    assert wb.memory_panel.fig_box.outputs[0]["data"]["application/vnd.plotly.v1+json"]["data"][0]["x"] == [
        "rank 0", "rank 1", "rank 2", "rank 3"]


def test_out_of_range_numbers_are_refused_not_clamped():
    wb = Workbench()
    wb.layout_panel.fields["layout.tp"].value = 100
    assert wb.layout_panel.fields["layout.tp"].value == 100 and wb.state.spec is None
    assert "layout.tp(100)" in wb.layout_panel.errors["layout"].value


def test_a_plan_goes_when_the_job_changes_and_stays_when_one_is_used():
    wb = Workbench()
    wb.memory_panel._plan()
    candidate = wb.state.plan["candidates"][-1]
    wb.memory_panel.apply(candidate)
    assert wb.state.plan is not None and wb.memory_panel.plan_box.children
    wb.layout_panel.fields["train.global_batch"].value = 32
    assert wb.state.plan is None and not wb.memory_panel.plan_box.children
    wb.layout_panel.fields["layout.tp"].value = 3
    assert wb.memory_panel.plan_button.disabled


def test_dispatch_settings_are_a_form_per_backend_and_never_invalidate_the_job():
    wb = Workbench()
    d = wb.dispatch_panel
    d.backend.value = "sagemaker"
    role = d.forms["sagemaker"]["role"]
    for i in range(1, 40):  # typed key by key
        role.value = "arn:aws:iam::123456789012:role/Training"[:i]
    d.backend.value = "vertex"
    d.forms["vertex"]["project"].value = "my-project"
    assert wb.state.spec is not None and shown(wb.memory_panel.fig_box) is not None
    d.backend.value = "sagemaker"
    assert role.value == "arn:aws:iam::123456789012:role/Training"
    assert wb.spec.backend.sagemaker.role == role.value and wb.spec.backend.vertex.project == "my-project"
    assert d.settings.children == (d.form_boxes["sagemaker"],)


def test_dispatch_errors_reach_the_panel():
    pytest.importorskip("boto3")
    wb = Workbench()
    d = wb.dispatch_panel
    d.backend.value = "sagemaker"
    d.submit()  # no role, no bucket
    assert "backend.sagemaker.role is required" in d.note.value and not d.submit_button.disabled
    d.forms["sagemaker"]["role"].value = "arn:aws:iam::123456789012:role/Training"
    d.forms["sagemaker"]["bucket"].value = "my-bucket"
    d.show_request()
    assert "wb-request-summary" in d.summary.value and "instance" in d.summary.value
    from workbench.prices import PRICES_DATE
    from workbench.ui.dispatch_panel import _price

    assert "not in the price table" in d.summary.value  # CPUs have no price
    a100 = load_spec({**wb.state.raw, "resources": {"gpu": "a100-80gb", "gpus_per_node": 2}})
    assert _price(a100, "sagemaker").endswith(f"(on demand, list price of {PRICES_DATE})")  # says where it is from
    assert "wb-copy" in d.request.value and "nothing was sent" in d.note.value


def test_run_history_overlays_and_resume_needs_a_checkpoint(tmp_path):
    wb = Workbench()
    st, panel = wb.state, wb.run_panel
    st.start_events("run 1")
    for k in range(1, 4):
        st.add_event({"event": "step", "step": k, "loss": 5.0 - k, "tokens_per_s": 1e3, "step_time_s": 0.1,
                      "time": float(k)})
    st.add_event({"event": "end", "status": "preempted", "step": 3})
    panel.render()
    assert "cannot be resumed" in panel.note.value and panel.resume_button.layout.display == "none"
    assert "[end] status=preempted, step=3" in panel.log.value
    st.update({"checkpoint.uri": str(tmp_path / "ckpt")})
    (tmp_path / "ckpt").mkdir()
    assert panel.resume_button.layout.display == "none"  # a URI, but no checkpoint in it
    st.start_events("run 2")
    fig = shown(panel.run_box)
    assert [t.name for t in fig.data][3:] == ["run 1"] and len(fig.data[0].x) == 0  # old curves only beneath
    panel.log_loss.value = True
    assert shown(panel.run_box).layout.yaxis.type == "log"


def test_the_code_bundle_leaves_the_notebook_folder_out(tmp_path, monkeypatch):
    (tmp_path / "my_notebook.ipynb").write_text("{}")
    monkeypatch.chdir(tmp_path)  # a notebook's kernel runs in the notebook's folder
    wb = Workbench(str(ROOT / "examples" / "quickstart.yaml"))
    d = wb.dispatch_panel
    d.backend.value = "ray"
    d.show_request()
    assert "top_level" in d.request.value and "my_notebook.ipynb" not in d.request.value


def test_resume_is_offered_for_a_complete_checkpoint_and_its_curve_continues(tmp_path):
    """Real checkpoints from the in-process loop: Resume shows only while a complete one exists
    under checkpoint.uri, and the resumed run's events carry the stopped run's curve on."""
    from workbench.runtime.checkpoint_store import MANIFEST, step_name
    from workbench.runtime.loop import train
    from workbench.ui import run_panel

    uri = tmp_path / "ckpt"
    spec = {"name": "resume-me", "model": {"preset": "gpt-tiny"}, "layout": {"dp": 1},
            "train": {"steps": 6, "global_batch": 8, "micro_batch": 4},
            "resources": {"gpu": "cpu", "gpus_per_node": 1}, "checkpoint": {"uri": str(uri), "every_steps": 2}}
    calls = iter(range(1, 100))
    stopped: list[dict] = []
    train(spec, stopped.append, should_stop=lambda: next(calls) >= 3)  # stops after step 3, saving it
    assert stopped[-1] == {"event": "end", "status": "preempted", "step": 3}

    wb = Workbench(spec)
    st, panel = wb.state, wb.run_panel
    st.start_events("run 1")
    for e in stopped:
        st.add_event(e)
    panel.render()
    assert panel.resumable_step() == 3
    # memory events (each rank's step time) come at step 1, every 5th and the last
    assert "Step time per rank</b> (step 1)" in panel.rank_times.value and "rank 0: " in panel.rank_times.value
    assert panel.resume_button.layout.display == "" and "Resume continues from its newest checkpoint" in panel.note.value
    (uri / step_name(3) / MANIFEST).unlink()  # step 3 un-committed: step 2 is the newest complete one
    panel.render()
    assert panel.resumable_step() == 2 and panel.resume_button.layout.display == ""
    st.update({"checkpoint.uri": str(tmp_path / "empty")})  # a URI with nothing in it
    assert panel.resumable_step() is None and panel.resume_button.layout.display == "none"
    assert "cannot be resumed" in panel.note.value
    st.update({"checkpoint.uri": str(uri)})
    assert panel.resume_button.layout.display == ""

    # What Resume starts with: the stopped run's events up to the checkpoint, then the loop's own.
    carried = run_panel._continued(st.snapshot(), panel.resumable_step())
    assert [e["step"] for e in carried if e["event"] == "step"] == [1, 2]
    st.start_events("run 2 (resumed)", carry=carried)
    resumed: list[dict] = []
    train({**spec, "checkpoint": {"uri": str(uri), "every_steps": 2}}, resumed.append, resume=True)
    assert {"event": "restart", "attempt": 0, "from_step": 2} in resumed
    for e in resumed:
        st.add_event(e)
    panel.render()
    fig = shown(panel.run_box)
    assert list(fig.data[0].x) == [1, 2, 3, 4, 5, 6]  # one curve, continued
    assert [s.x0 for s in fig.layout.shapes if s.type == "line"] == [2, 2, 2]  # the resume, marked
    assert st.history[0]["label"] == "run 1" and [t.name for t in fig.data][3:] == ["run 1"]


def test_step_time_per_rank_names_the_slowest_rank():
    from workbench.ui import figures, run_panel

    events = [{"event": "memory", "step": 5, "rank": r, "step_time_s": t, "cpu_s": t / 2, "measured": {}}
              for r, t in ((0, 0.020), (1, 0.030), (2, 0.021))]
    text = run_panel._rank_times_html(figures.latest_rank_times(events))
    assert "(step 5; slowest rank 1: 1.50x the fastest)" in text
    assert "rank 1: 30.0 ms <span style='color:#777'>(CPU 15.0 ms)</span>" in text
    assert run_panel._rank_times_html({}) == ""
