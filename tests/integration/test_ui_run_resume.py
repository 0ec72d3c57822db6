"""The run panel on the local Ray backend, without a browser: Run, Stop within STOP_WITHIN_STEPS (2)
steps of the step the panel had, Resume from the checkpoint the stop wrote, one continued loss curve."""
import time

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from backends.ray_relay import STOP_WITHIN_STEPS  # noqa: E402
from workbench.ui.app import Workbench  # noqa: E402

# slow: the browser test drives the same panel through Ray; test_ui_panels.py covers the panel's logic fast
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 40


def wait_for(cond, what: str, limit_s: float = 300.0) -> None:
    """Wait for a state; the limit only catches a hang."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"no {what} after {limit_s} s"
        time.sleep(0.05)


def steps_of(events: list[dict]) -> list[int]:
    return [e["step"] for e in events if e["event"] == "step"]


def test_run_stop_and_resume_from_the_panel(tmp_path):
    uri = tmp_path / "ckpt"
    wb = Workbench({"name": "panel-resume", "model": {"preset": "gpt-tiny"}, "layout": {"dp": 2},
                    "train": {"steps": STEPS, "global_batch": 8, "micro_batch": 2},
                    "resources": {"gpu": "cpu", "gpus_per_node": 2},
                    "checkpoint": {"uri": str(uri), "every_steps": 5}}, refresh_s=0.1)
    st, panel = wb.state, wb.run_panel
    assert panel.resume_button.layout.display == "none"  # nothing under the URI yet

    panel.run()
    ran = panel.run_spec
    wait_for(lambda: len(steps_of(st.snapshot())) >= 7, "step 7")
    check_the_pairing_stays_with_the_running_spec(wb, ran)
    panel.stop()
    wait_for(lambda: st.run_state != "running", "the end of the stopped run")
    stopped = st.snapshot()
    end = stopped[-1]
    assert end["event"] == "end" and end["status"] == "preempted", end
    # by state: every rank stopped after the same step, at most STOP_WITHIN_STEPS after the step the panel had
    assert panel.stop_step <= end["step"] <= panel.stop_step + STOP_WITHIN_STEPS < STEPS, (panel.stop_step, end)
    assert steps_of(stopped) == list(range(1, end["step"] + 1))
    assert end["step"] in [e["step"] for e in stopped if e["event"] == "checkpoint"]  # the stop saved its step
    print(f"Stop pressed with step {panel.stop_step} in the panel; the run ended after step {end['step']}")
    wait_for(lambda: panel.resumable_step() == end["step"], "the stop's checkpoint", limit_s=30)
    check_the_checkpoint_is_this_runs(wb, uri, end["step"])
    check_the_metrics_are_kept_beside_the_checkpoints(wb, uri, stopped)
    panel.render()
    assert panel.resume_button.layout.display == "" and "Resume continues" in panel.note.value

    panel.resume_button.click()
    wait_for(lambda: st.run_state != "running", "the end of the resumed run")
    resumed = st.snapshot()
    assert resumed[-1] == {"event": "end", "status": "completed", "step": STEPS}, panel.note.value
    assert {"event": "restart", "attempt": 0, "from_step": end["step"]} in resumed
    assert steps_of(resumed) == list(range(1, STEPS + 1))  # the stopped run's steps, then its own
    assert [e["loss"] for e in resumed if e["event"] == "step"][:end["step"]] == [
        e["loss"] for e in stopped if e["event"] == "step"]
    panel.render()
    fig = panel.run_box.figure
    assert list(fig.data[0].x) == list(range(1, STEPS + 1))  # the chart continues the curve
    assert [s.x0 for s in fig.layout.shapes if s.type == "line"] == [end["step"]] * 3
    assert st.history[-1]["label"] == "run 1" and fig.data[3].name == "run 1"
    assert panel.resume_button.layout.display == "none"  # completed: nothing to resume
    assert panel.progress.value == STEPS and panel.progress_text.value == f"completed at step {STEPS} / {STEPS}"
    measured = [t for t in panel.mem_box.figure.data if t.name == "params"]  # the memory chart's measured bars
    assert measured and all(v > 0 for v in measured[0].y if v is not None), measured
    check_another_panel_continues_it_on_purpose(wb, uri)


def check_the_pairing_stays_with_the_running_spec(wb, ran) -> None:
    """While the run goes the form changes (#34's stale pairing): the panel keeps showing the running
    layout's prediction (plan(spec).given, fixed at Run) beside the measured steps, and the measured
    memory beside the running spec's estimate; then the form is put back."""
    from workbench.ui import run_panel

    panel, fields = wb.run_panel, wb.layout_panel.fields
    wait_for(lambda: panel.prediction is not None, "the prediction", limit_s=60)
    assert panel.prediction == run_panel.predict_run(ran) and "step_time_s" in panel.prediction
    fields["layout.dp"].value, fields["train.micro_batch"].value = 1, 4
    assert wb.spec.layout.dp == 1 and ran.layout.dp == 2
    panel.render()
    text = panel.predicted.value
    assert "dp2 tp1 pp1 mb=2 on cpu" in text and run_panel._duration(panel.prediction["step_time_s"]) in text
    assert "median of steps 2-" in text and "waiting for steps" not in text
    predicted = [t for t in panel.run_box.figure.data if t.name == "predicted"]
    assert [t.y[0] for t in predicted] == [panel.prediction["tokens_per_s"], panel.prediction["step_time_s"]]
    wait_for(lambda: panel.mem_box.figure is not None, "the measured memory", limit_s=60)
    panel.render()
    assert list(panel.mem_box.figure.data[0].x[0]) == ["rank 0", "rank 0", "rank 1", "rank 1"]  # the run's 2 ranks
    fields["layout.dp"].value, fields["train.micro_batch"].value = 2, 2
    assert wb.spec.layout == ran.layout


def check_the_checkpoint_is_this_runs(wb, uri, step: int) -> None:
    """#34: the ranks under Ray recorded the panel's run id in the checkpoint; a fresh panel on the same
    URI (another run) is not offered that checkpoint and says whose it is."""
    from workbench.runtime.checkpoint_store import Store, manifest_run_id

    panel = wb.run_panel
    assert panel.run_id and manifest_run_id(Store(str(uri)).read_manifest(step)) == panel.run_id
    other = Workbench(wb.state.raw)
    other.state.start_events("run 1")
    other.state.add_event({"event": "end", "status": "preempted", "step": 0})
    other.run_panel.render()
    assert other.run_panel.resumable_step() is None and other.run_panel.resume_button.layout.display == "none"
    assert f"written by another run ({panel.run_id})" in other.run_panel.note.value


def check_the_metrics_are_kept_beside_the_checkpoints(wb, uri, events: list[dict]) -> None:
    """A later session compares this run from its checkpoint folder alone (Compare runs)."""
    from workbench.ui.runs import load_run

    wait_for(lambda: (uri / f"metrics-{wb.run_panel.run_id}.jsonl").is_file(), "the kept metrics", limit_s=30)
    run = load_run(uri)
    assert run["run_id"] == wb.run_panel.run_id and run["label"] == "panel-resume (dp2 tp1 pp1 mb=2)"
    assert steps_of(run["events"]) == steps_of(events)


def check_another_panel_continues_it_on_purpose(wb, uri) -> None:
    """#34: a panel that did not write the newest checkpoint (another session's, say) is asked, and
    "Continue that run" continues it for real: under that run's id, its kept curve carried on, two
    more steps; the first run's events are untouched."""
    from workbench.runtime.checkpoint_store import Store, manifest_run_id
    from workbench.ui.runs import read_events

    owner, done = wb.run_panel.run_id, wb.state.snapshot()
    kept = uri / f"metrics-{owner}.jsonl"
    wait_for(lambda: kept.is_file() and steps_of(read_events(kept))[-1:] == [STEPS], "the kept metrics", limit_s=30)
    other = Workbench({**wb.state.raw, "train": {**wb.state.raw["train"], "steps": STEPS + 2}}, refresh_s=0.1)
    st, panel = other.state, other.run_panel
    st.start_events(st.run_label())  # a run of its own that stopped before writing a checkpoint
    st.add_event({"event": "end", "status": "preempted", "step": 0})
    panel.render()
    assert panel.resume_button.layout.display == "none" and panel.continue_button.layout.display == ""
    assert panel._offered == (STEPS, owner) and f"written by another run ({owner})" in panel.note.value
    panel.continue_button.click()
    wait_for(lambda: st.run_state != "running", "the end of the continued run")
    events = st.snapshot()
    assert events[-1] == {"event": "end", "status": "completed", "step": STEPS + 2}, panel.note.value
    assert {"event": "restart", "attempt": 0, "from_step": STEPS} in events
    assert steps_of(events) == list(range(1, STEPS + 3))  # the kept curve, then its two new steps
    assert panel.run_id == owner and manifest_run_id(Store(str(uri)).read_manifest(STEPS + 2)) == owner
    assert st.history[-1]["label"] == "run 1" and st._label == f"run 2 (continues {owner} from step {STEPS})"
    assert wb.state.snapshot() == done
