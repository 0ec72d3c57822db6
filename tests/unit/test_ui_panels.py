"""The notebook panels without a browser: every view is drawn from the state, edits never leave a
stale chart or plan, dispatch settings stay per backend, nothing is clamped, Resume needs a checkpoint."""
import html
import json
import random
from pathlib import Path

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from tests.helpers.cli import run_cli  # noqa: E402
from workbench.memory import estimate_memory  # noqa: E402
from workbench.report import figures  # noqa: E402
from workbench.spec import load_spec  # noqa: E402
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


@pytest.mark.slow  # ~11 s: each Show request bundles and scans the code folder
def test_random_edit_sequences_leave_no_derived_view_stale():
    """#34: after each random batch of edits, every view derived from the form shows what its inputs
    give now, or is gone: the dry-run request (Show request now draws the same, job-name stamps aside;
    else it was cleared with a note), the planner's table (a plan now finds the same rows; else it was
    removed) and the run's measured-beside-predicted (the running spec's, whatever the form says)."""
    import re

    from tests.helpers.reference import reference_run
    from tests.helpers.specs import tiny_gpt
    from workbench.ui import run_panel

    stamp = re.compile(r"-\d{8}-\d{6}")  # the job name's time stamp, new on every dry run
    ran = tiny_gpt(name="walk", steps=3, layout={"dp": 1}, resources={"gpu": "cpu", "gpus_per_node": 1})
    events = reference_run(ran).events
    wb = Workbench(ran)
    st, panel, d, fields = wb.state, wb.run_panel, wb.dispatch_panel, wb.layout_panel.fields
    panel.run_spec, panel._run_estimate = st.spec, st.estimate  # what Run records, then its events
    st.start_events("run 1")
    panel.prediction = run_panel.predict_run(st.spec)
    for e in events:
        st.add_event(e)
    d.backend.value = "ray"
    valid = st.raw
    rng = random.Random(1)
    for _ in range(12):
        if st.spec is None:  # an invalid form derives nothing: back to the run's job
            st.set_raw(valid)
        if rng.random() < 0.4:
            d.show_request()
        if rng.random() < 0.5:
            wb.memory_panel._plan()
        request, planned = d.request.value, st.plan
        for key, values in rng.sample(EDITS, k=rng.randint(1, 3)):
            fields[key].value = rng.choice(values)
        if d.request.value:
            d.show_request()
            assert stamp.sub("", d.request.value) == stamp.sub("", request)
        elif request:
            assert "press Show request again" in d.note.value or st.spec is None
        if st.plan is not None:  # kept: the edits changed only what the planner chooses (the layout)
            assert st.plan is planned
            if st.spec is not None:
                wb.memory_panel._plan()
                assert st.plan["candidates"] == planned["candidates"]
        else:
            assert not wb.memory_panel.plan_box.children
        panel.render()
        assert "dp1 tp1 pp1 mb=4 on cpu" in panel.predicted.value
        assert list(panel.mem_box.figure.data[0].x[0]) == ["rank 0", "rank 0"]  # the run's one rank


def test_the_chart_matches_the_cli_after_an_invalid_edit(tmp_path):
    wb = Workbench()
    f = wb.layout_panel.fields
    f["layout.tp"].value = 3  # invalid: 4 heads
    f["layout.tp"].value = 1
    f["layout.dp"].value = 4
    path = tmp_path / "s.yaml"
    wb.save(path)
    cli = run_cli("memory", path, "--json")  # in this process (tests/helpers/cli.py)
    assert cli.returncode == 0, cli.stderr
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
    # without resources.gpus_per_node the GPUs follow the layout: a plan for 1 GPU does not answer dp=4
    wb = Workbench({"model": {"preset": "gpt-tiny"}, "train": {"global_batch": 16, "micro_batch": 4},
                    "resources": {"gpu": "cpu"}})
    wb.memory_panel._plan()
    assert wb.state.plan is not None and wb.state.plan["world_size"] == 1
    wb.layout_panel.fields["layout.dp"].value = 4
    assert wb.state.plan is None and not wb.memory_panel.plan_box.children


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
    assert [t.name for t in fig.data][3:] == ["run 1"] * 3 and len(fig.data[0].x) == 0  # old curves only beneath
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


def test_resume_is_offered_for_a_complete_checkpoint_and_its_curve_continues(tmp_path, monkeypatch):
    """Real checkpoints from the in-process loop: Resume shows only while a complete one of this run
    exists under checkpoint.uri, and the resumed run's events carry the stopped run's curve on."""
    from workbench.runtime.checkpoint_store import MANIFEST, Store, step_name
    from workbench.runtime.loop import train
    from workbench.ui import run_panel

    uri = tmp_path / "ckpt"
    spec = {"name": "resume-me", "model": {"preset": "gpt-tiny"}, "layout": {"dp": 1},
            "train": {"steps": 6, "global_batch": 8, "micro_batch": 4},
            "resources": {"gpu": "cpu", "gpus_per_node": 1}, "checkpoint": {"uri": str(uri), "every_steps": 2}}
    calls = iter(range(1, 100))
    stopped: list[dict] = []
    monkeypatch.setenv("WORKBENCH_RUN_ID", "notebook-run-a")  # as the panel gives it to the ranks (_with_run_id)
    train(spec, stopped.append, should_stop=lambda: next(calls) >= 3)  # stops after step 3, saving it
    assert stopped[-1] == {"event": "end", "status": "preempted", "step": 3}

    wb = Workbench(spec)
    st, panel = wb.state, wb.run_panel
    panel.run_id = "notebook-run-a"  # the panel's run wrote them
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
    check_another_runs_checkpoint_is_never_resumed(panel, Store(str(uri)), 2)
    check_a_fresh_run_asks_before_writing_over_checkpoints(panel, Store(str(uri)), 2)

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
    assert st.history[0]["label"] == "run 1" and [t.name for t in fig.data][3:] == ["run 1"] * 3


def test_step_time_per_rank_names_the_slowest_rank():
    from workbench.report import figures
    from workbench.ui import run_panel

    events = [{"event": "memory", "step": 5, "rank": r, "step_time_s": t, "cpu_s": t / 2, "measured": {}}
              for r, t in ((0, 0.020), (1, 0.030), (2, 0.021))]
    text = run_panel._rank_times_html(figures.latest_rank_times(events))
    assert "(step 5; slowest rank 1: 1.50x the fastest)" in text
    assert "rank 1: 30.0 ms <span style='color:var(--jp-content-font-color2, #777)'>(CPU 15.0 ms)</span>" in text
    assert run_panel._rank_times_html({}) == ""


def check_another_runs_checkpoint_is_never_resumed(panel, store, step: int) -> None:
    """#34: the newest checkpoint under the URI is another run's (or has no id: written before runs
    had one): no Resume, the note names it and asks ("Continue that run", or the CLI); Resume pressed
    anyway (the folder changed after the button was drawn) starts nothing and deletes nothing, and
    neither does "Continue that run" when the folder changed after it was drawn. (Continuing another
    run for real, through Ray: tests/integration/test_ui_run_resume.py.)"""
    manifest = store.read_manifest(step)
    for owner in ("older-run-b", None):
        changed = {k: v for k, v in manifest.items() if k != "run_id"}
        if owner:
            changed["run_id"] = owner
        store.write_manifest(store.step_dir(step), changed)
        panel.render()
        assert panel.resumable_step() is None and panel.resume_button.layout.display == "none"
        assert panel.continue_button.layout.display == "" and panel._offered == (step, owner)
        note = panel.note.value
        assert f"(step {step}) was written by " in note and "notebook-run-a" in note and "--resume" in note
        assert (owner or "before checkpoints named their run") in note and "press Continue that run" in note
        runs = len(panel.state.history)
        panel.run(resume=True)
        assert panel.state.run_state == "preempted" and len(panel.state.history) == runs  # nothing started
        assert "Resume is not offered" in panel.note.value and store.committed_steps()[0] == step
        store.write_manifest(store.step_dir(step), {**changed, "run_id": "newer-run-c"})  # after the drawing
        panel.continue_button.click()
        assert panel.state.run_state == "preempted" and len(panel.state.history) == runs  # nothing started
        assert "the checkpoint folder changed since the button was drawn" in panel.note.value
        assert f"step {step} of newer-run-c" in panel.note.value and panel.continue_button.layout.display == "none"
        assert panel.run_id == "notebook-run-a" and store.committed_steps()[0] == step
    store.write_manifest(store.step_dir(step), manifest)
    panel.render()
    assert panel.resumable_step() == step and panel.continue_button.layout.display == "none"


def check_a_fresh_run_asks_before_writing_over_checkpoints(panel, store, step: int) -> None:
    """#34: Run (a fresh run, a new id) with checkpoints under the URI would write over them (its steps,
    then its retention): nothing starts, the note says whose the newest is, and "Continue that run" is
    offered; with the URI emptied the question goes."""
    st, manifest, uri = panel.state, store.read_manifest(step), panel.state.spec.checkpoint.uri
    for owner, whose in (("notebook-run-a", "this panel's last run"), ("older-run-b", "run older-run-b")):
        store.write_manifest(store.step_dir(step), {**manifest, "run_id": owner})
        runs, run_id = len(st.history), panel.run_id
        panel.run()
        assert len(st.history) == runs and panel.run_id == run_id and st.run_state == "preempted"  # nothing started
        assert f"holds checkpoints, the newest of step {step} by {whose}" in html.unescape(panel.note.value)
        assert "would write over them" in panel.note.value and "Nothing was loaded or deleted" in panel.note.value
        panel.render()  # the question stays through redraws while the folder is as it was
        assert panel.continue_button.layout.display == "" and panel._offered == (step, owner)
        assert "would write over them" in panel.note.value and store.committed_steps()[0] == step
    steps = st.spec.train.steps
    st.update({"train.steps": step})  # that run is done at this length: nothing to continue
    panel.continue_button.click()
    assert len(st.history) == runs and f"checkpoint is at step {step} and this spec trains {step} steps" in \
        panel.note.value
    st.update({"train.steps": steps})
    store.write_manifest(store.step_dir(step), manifest)
    st.update({"checkpoint.uri": uri + "-elsewhere"})
    assert panel.continue_button.layout.display == "none" and "would write over them" not in panel.note.value
    st.update({"checkpoint.uri": uri})


def test_run_labels_are_unique_and_a_resume_keeps_its_runs_number():
    from workbench.ui.state import WorkbenchState

    st = WorkbenchState()
    assert [st.run_label(), st.run_label(), st.run_label(resume=True), st.run_label(resume=True),
            st.run_label()] == ["run 1", "run 2", "run 2 (resumed)", "run 2 (resumed 2x)", "run 3"]


def test_a_spec_given_by_its_size_survives_edits_and_matches_the_cli(tmp_path):
    """#34: examples/zero-paper-7.5b.yaml (model: {params: 7.5e9}) keeps its model through form edits
    (it became a 1x1 shape, "model: missing vocab"); its chart equals `workbench memory --json`."""
    wb = Workbench(str(ROOT / "examples" / "zero-paper-7.5b.yaml"))
    lp, f = wb.layout_panel, wb.layout_panel.fields
    assert "7.5 B parameters" in lp.size_note.value and lp.shape_rows["layers"].layout.display == "none"
    f["layout.zero"].value = 2
    f["layout.tp"].value = 2  # 128 ranks on the GPUs that follow the layout
    f["train.micro_batch"].value = 3  # invalid (64 is not a multiple of dp x 3), then back
    assert wb.state.spec is None and wb.layout_panel.errors["train"].value
    f["train.micro_batch"].value = 1
    assert wb.state.error is None and wb.state.raw["model"]["params"] == 7.5e9
    path = tmp_path / "s.yaml"
    wb.save(path)
    cli = run_cli("memory", path, "--json")  # in this process (tests/helpers/cli.py)
    assert cli.returncode == 0, cli.stderr
    expected = json.loads(cli.stdout)
    assert bars(shown(wb.memory_panel.fig_box)) == bars(figures.memory_figure(expected))
    assert expected["world_size"] == 128 and wb.state.spec.layout.tp == 2
    f["model.preset"].value = "gpt-tiny"  # a preset gives it a shape: the size goes
    assert wb.state.raw["model"].get("params") is None and lp.shape_rows["layers"].layout.display == ""
    assert lp.size_note.value == ""


def test_dispatch_request_goes_stale_spot_stays_valid_and_addresses_are_checked():
    """#34: the dry run goes when the layout changes; spot without an interval keeps the job valid with
    a note under the box; defaults are placeholders; two Ray addresses typed together are refused."""
    wb = Workbench()
    d, f = wb.dispatch_panel, wb.layout_panel.fields
    d.backend.value = "ray"
    d.show_request()
    assert "wb-request" in d.request.value
    f["layout.dp"].value = 1
    assert d.request.value == d.summary.value == "" and "press Show request again" in d.note.value
    d.backend.value = "sagemaker"
    d.spot.value = True
    assert wb.state.spec is not None and wb.state.raw["backend"]["spot"] is False and d.spot.value
    assert "every N steps" in d.spot_note.value and "every_minutes" not in d.spot_note.value
    d.ckpt_uri.value, d.ckpt_every.value = "/tmp/wb-ckpt", 10
    assert wb.spec.backend.spot and d.spot_note.value == ""
    address = d.forms["ray"]["address"]
    assert address.value == "" and address.placeholder == "http://127.0.0.1:8265"
    address.value = "http://127.0.0.1:8265http://ray-head.internal:8265"
    assert "more than one address" in d.field_errors.value and wb.spec.backend.ray.address == "http://127.0.0.1:8265"
    for bad, why in (("ray-head:8265", "more than one address (or none)"), ("ftp://h:1", "scheme"),
                     ("http://h:99999", "Port out of range"), ("http:// h", "space")):
        address.value = bad
        assert why in d.field_errors.value, (bad, d.field_errors.value)
    address.value = "http://ray-head.internal:8265"
    assert d.field_errors.value == "" and wb.spec.backend.ray.address == "http://ray-head.internal:8265"


def test_import_shows_what_it_would_replace_and_asks_first():
    """#34: an import that changes typed settings lists them (old -> new) and changes nothing until
    Apply; Keep drops it; one that changes nothing but the name applies at once."""
    from workbench.ui.import_config import replaced

    wb = Workbench()
    ic = wb.import_config
    wb.dispatch_panel.backend.value = "sagemaker"
    wb.dispatch_panel.forms["sagemaker"]["role"].value = "arn:aws:iam::1:role/T"
    typed = wb.state.raw
    config = json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                         "zero_optimization": {"stage": 3}}).encode()
    ic._uploaded([{"name": "ds.json", "content": config}])
    text = wb.message.value
    assert "ds.json (deepspeed) is read; nothing is changed until Apply import. It would replace" in text
    assert "layout.zero: 0 -&gt; 3" in text and "backend.sagemaker.role: arn:aws:iam::1:role/T -&gt; (unset)" in text
    assert "filled in by the Hugging Face Trainer at launch" in text
    assert wb.state.raw == typed and ic.confirm.layout.display == ""  # asked, nothing changed yet
    ic.keep_button.click()
    assert wb.state.raw == typed and ic.confirm.layout.display == "none" and "unchanged" in wb.message.value
    ic._uploaded([{"name": "ds.json", "content": config}])
    ic.apply_button.click()
    assert wb.spec.layout.zero == 3 and wb.spec.backend.sagemaker.role is None and wb.name.value == "ds"
    assert "It replaced" in wb.message.value and ic.confirm.layout.display == "none" and ic.pending is None
    ic._uploaded([{"name": "ds.json", "content": config}])  # the same file again: nothing to replace, no question
    assert ic.pending is None and ic.confirm.layout.display == "none" and "wb-note-warning" not in wb.message.value
    assert replaced({"a": {"b": 1}, "name": "x"}, {"a": {"b": 2}, "name": "y"}) == ["a.b: 1 -> 2"]


def test_small_planner_rows_keep_their_precision():
    from workbench.ui.memory_panel import gib_text

    assert [gib_text(b) for b in (12 * 2**20, 2**30 / 3, 15.5 * 2**30, 300 * 2**10)] == [
        "0.0117", "0.333", "15.5", "0.00029"]


def test_the_progress_line_names_the_start_up_phase_and_wakes_for_a_later_run():
    import threading

    wb = Workbench(refresh_s=0.05)
    st, panel = wb.state, wb.run_panel
    st.start_events("run 1")
    st.finish("failed")
    time_ok = threading.Event()
    st.observe(lambda topic: time_ok.set() if topic == "events" and st.run_state == "running" else None)
    panel.run_spec, panel._phase, panel._t0 = wb.spec, "1/3 starting Ray…", __import__("time").monotonic()
    st.start_events("run 2")  # the refresher sleeps without a timeout since run 1 ended: this wakes it
    assert time_ok.wait(5.0)
    st.add_event({"event": "note", "message": "still starting Ray (attempt 2 of 3): 30 s; load 9"})
    assert panel._progress_line(None, None, True).startswith("1/3 starting Ray… ")
    assert panel._progress_line(None, None, True).endswith("· still starting Ray (attempt 2 of 3): 30 s")
    st.add_event({"event": "worker", "rank": 0})
    assert panel._progress_line(None, None, True).startswith("3/3 1 of 2 rank(s) started")
    st.finish("failed")
