"""Predictions in the notebook UI (#28, #29): every step time, tokens/s, MFU and cost names its source,
CPU devices show no MFU, planner rows show the settings that tell them apart and "Use" sets them,
the run panel pairs the running layout's prediction with the run's own measurements, and a
Hugging Face folder becomes the model."""
import json

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from workbench.planner import plan  # noqa: E402
from workbench.report import figures  # noqa: E402
from workbench.ui import run_panel  # noqa: E402
from workbench.ui.app import Workbench  # noqa: E402
from workbench.ui.memory_panel import MemoryPanel, given_html  # noqa: E402

# 16 H100 for a 7B model: 800+ candidates, among them interleaved schedules with 2/4/8 virtual
# stages and tp with and without sequence parallel (the planner answers in well under a second)
BIG = {"name": "big", "model": {"preset": "llama-7b"}, "train": {"global_batch": 64, "micro_batch": 1},
       "layout": {"dp": 16}, "resources": {"gpu": "h100-80gb", "gpus_per_node": 8, "nodes": 2}}


def plan_cells(panel: MemoryPanel) -> list[list[str]]:
    """The planner table's rows as the HTML of their cells (9 columns: layout ... Use)."""
    grid = panel.plan_box.children[-1]
    texts = [getattr(c, "value", getattr(c, "description", "")) for c in grid.children]
    return [texts[i:i + 9] for i in range(0, len(texts), 9)]


def test_the_planner_table_names_its_source_and_shows_no_mfu_for_cpu():
    wb = Workbench()  # the quickstart: 2 CPU workers
    wb.memory_panel._plan()
    result = plan(wb.spec)
    assert wb.state.plan["source"] == result.source and result.source
    source_line = wb.memory_panel.plan_box.children[0].value
    assert "wb-plan-source" in source_line and result.source.replace("'", "&#x27;") in source_line
    header, *rows = plan_cells(wb.memory_panel)
    assert "MFU" in header[5] and "tensor-core peak" in header[5]  # the tooltip says why
    assert rows and all("wb-no-mfu" in r[5] and ">-<" in r[5] for r in rows)
    assert "MFU" not in given_html(wb.state.plan)
    hover = figures.plan_figure(wb.state.plan).data[0]
    assert result.source in hover.hovertemplate and {m for _, m in hover.customdata} == {"-"}

    # the same job on GPUs: MFU as a percentage, and the label names that device's source
    wb.layout_panel.fields["resources.gpu"].value = "a100-80gb"
    wb.memory_panel._plan()
    gpu = plan(wb.spec)
    assert wb.state.plan["source"] == gpu.source != result.source
    header, *rows = plan_cells(wb.memory_panel)
    assert "title" not in header[5]
    want = [f"{c.mfu:.0%}" for c in gpu.candidates[:len(rows)]]
    assert [r[5].split(">")[1].split("<")[0] for r in rows] == want
    assert f"MFU {gpu.given.mfu:.0%}" in given_html(wb.state.plan)


def test_rows_that_differ_only_in_hidden_settings_show_them():
    result = plan(BIG)
    layouts = {json.dumps(c.layout, sort_keys=True) + f" mb={c.micro_batch}" for c in result.candidates}
    labels = {figures.layout_label(c.layout, c.micro_batch) for c in result.candidates}
    assert len(labels) == len(layouts) == len(result.candidates)  # no two rows read the same
    interleaved = [c for c in result.candidates if c.layout.get("virtual_stages", 1) > 2]
    sp = [c for c in result.candidates if c.layout["sequence_parallel"]]
    assert interleaved and sp
    assert f" v{interleaved[0].layout['virtual_stages']}" in figures.layout_label(interleaved[0].layout)
    assert " sp " in figures.layout_label(sp[0].layout) + " "


def test_use_sets_virtual_stages_and_sequence_parallel_and_resets_them():
    wb = Workbench(BIG)
    rows = plan(BIG).to_dict()["candidates"]  # all of them (the panel's table shows the top 8)
    v8 = next(c for c in rows if c["layout"].get("virtual_stages") == 8 and c["layout"]["sequence_parallel"])
    wb.memory_panel.apply(v8)
    lay, f = wb.spec.layout, wb.layout_panel.fields
    assert (lay.pp_schedule, lay.virtual_stages, lay.sequence_parallel) == ("interleaved-1f1b", 8, True)
    assert f["layout.virtual_stages"].value == 8 and f["layout.sequence_parallel"].value is True
    assert not f["layout.virtual_stages"].disabled
    plain = next(c for c in rows if c["layout"]["pp"] == 1 and c["layout"]["tp"] == 1)
    wb.memory_panel.apply(plain)  # nothing of the interleaved layout stays behind
    lay = wb.spec.layout
    assert (lay.pp, lay.virtual_stages, lay.sequence_parallel) == (1, 2, False)  # 2: the spec's default
    assert f["layout.virtual_stages"].disabled and f["layout.sequence_parallel"].value is False
    # the form's own fields edit them too
    f["layout.tp"].value, f["layout.dp"].value = 2, 8
    f["layout.sequence_parallel"].value = True
    assert wb.spec.layout.sequence_parallel and wb.spec.layout.tp == 2


def tiny_run(steps: int = 4) -> tuple[dict, list[dict]]:
    """A real run of gpt-tiny in this process (the training loop the workers run): its events."""
    from tests.helpers.reference import reference_run
    from tests.helpers.specs import tiny_gpt

    spec = tiny_gpt(name="pred", steps=steps, layout={"dp": 1}, resources={"gpu": "cpu", "gpus_per_node": 1})
    return spec, reference_run(spec).events


def test_predicted_beside_measured_for_the_running_layout():
    import statistics

    from workbench.spec import load_spec

    spec_dict, events = tiny_run()
    spec = load_spec(spec_dict)
    pred = run_panel.predict_run(spec)
    given, source = plan(spec).given, plan(spec).source
    assert (pred["step_time_s"], pred["tokens_per_s"], pred["source"]) == (
        given.step_time_s, given.tokens_per_s, source)
    steps = [e for e in events if e["event"] == "step"]
    text = run_panel.prediction_html(pred, steps, spec)
    steady = steps[1:]  # step 1 holds the warm-up
    step = statistics.median(e["step_time_s"] for e in steady)
    tok = statistics.median(e["tokens_per_s"] for e in steady)
    assert "<td class='wb-predicted-step' " in text and run_panel._duration(given.step_time_s) in text
    assert run_panel._duration(step) in text and f"{tok:,.0f}" in text and f"{given.tokens_per_s:,.0f}" in text
    assert f"{step / given.step_time_s:.2f}x" in text and "median of steps 2-4" in text
    assert "dp1 tp1 pp1 mb=4 on cpu" in text and source.replace("'", "&#x27;") in text
    assert "waiting for steps" in run_panel.prediction_html(pred, [], spec)

    fig = figures.run_figure(events, predicted=pred)
    lines = {t.hovertemplate.split(":")[0]: t for t in fig.data if t.name == "predicted"}
    assert list(lines["predicted tokens_per_s"].y) == [given.tokens_per_s] * 2
    assert list(lines["predicted step_time_s"].y) == [given.step_time_s] * 2
    assert source in lines["predicted step_time_s"].hovertemplate
    assert [t.name for t in figures.run_figure(events).data] == ["loss", "tokens_per_s", "step_time_s"]


def test_the_run_panel_pairs_the_running_spec_not_the_edited_form():
    """What Run fixes (the spec, its estimate, its prediction) stays the run's while the form changes."""
    _, events = tiny_run(3)
    wb = Workbench({"name": "pred", "model": {"preset": "gpt-tiny"}, "layout": {"dp": 1},
                    "train": {"steps": 3, "global_batch": 8, "micro_batch": 4},
                    "resources": {"gpu": "cpu", "gpus_per_node": 1}})
    st, panel = wb.state, wb.run_panel
    ran = st.spec
    # what RunPanel.run() records before its thread starts the workers, and what the thread adds
    panel.run_spec, panel._run_estimate = ran, st.estimate
    st.start_events("run 1")
    panel.prediction = run_panel.predict_run(ran)
    for e in events:
        st.add_event(e)
    wb.layout_panel.fields["layout.dp"].value = 2  # the form moves on
    wb.layout_panel.fields["train.micro_batch"].value = 2
    panel.render()
    assert wb.spec.layout.dp == 2
    assert "dp1 tp1 pp1 mb=4 on cpu" in panel.predicted.value
    assert run_panel._duration(plan(ran).given.step_time_s) in panel.predicted.value
    mem = panel.mem_box.figure
    assert mem.layout.title.text.startswith("Memory per rank: measured beside predicted")
    assert list(mem.data[0].x[0]) == ["rank 0", "rank 0"]  # the run's one rank, not the form's two


def test_a_prediction_that_cannot_be_made_says_why():
    from workbench.spec import load_spec

    spec = load_spec({"model": {"params": 1e9}, "layout": {"dp": 2}, "resources": {"gpu": "cpu"}})
    pred = run_panel.predict_run(spec)
    assert "error" in pred and "shape" in pred["error"]
    assert "no prediction: " in run_panel.prediction_html(pred, [], spec)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """Small random transformers models saved as a released model is (config.json + safetensors), offline."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hf")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0))
    gpt2.save_pretrained(root / "gpt2")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=128, rope_theta=500000.0, bos_token_id=0, eos_token_id=0))
    llama.save_pretrained(root / "llama")
    (root / "unknown").mkdir()
    (root / "unknown" / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    return root


def test_a_model_folder_becomes_the_model_and_the_charts_show_its_shape(hf_folders):
    from workbench.memory import estimate_memory
    from workbench.spec import load_spec

    wb = Workbench()
    lp, f = wb.layout_panel, wb.layout_panel.fields
    for name, (layers, hidden, heads) in (("gpt2", (3, 64, 4)), ("llama", (2, 64, 4))):
        lp.model_path.value = str(hf_folders / name)
        assert wb.state.error is None and wb.state.raw["model"] == {"init": "hf", "path": str(hf_folders / name)}
        assert (f["model.layers"].value, f["model.hidden"].value, f["model.heads"].value) == (layers, hidden, heads)
        assert f["model.layers"].disabled and f["model.preset"].disabled and not f["model.seq_len"].disabled
        want = load_spec({**wb.state.raw, "model": {"init": "hf", "path": str(hf_folders / name)}})
        assert wb.spec.model.shape() == want.model.shape()
        chart = wb.memory_panel.fig_box.figure
        expected = figures.memory_figure(estimate_memory(want).to_dict())
        assert chart.layout.title.text == expected.layout.title.text
        assert [list(t.y) for t in chart.data] == [list(t.y) for t in expected.data]
        wb.memory_panel._plan()
        assert wb.state.plan["given"]["step_time_s"] == plan(want).given.step_time_s
    f["model.seq_len"].value = 64  # the one shape field a folder's model may change
    f["layout.dp"].value = 1  # other edits keep the folder
    assert wb.spec.model.init == "hf" and wb.spec.model.shape().seq_len == 64 and wb.spec.layout.dp == 1

    lp.model_path.value = ""  # back to the model the folder replaced
    assert wb.state.raw["model"] == {"preset": "gpt-tiny"} and not f["model.layers"].disabled


@pytest.mark.parametrize("folder", ["missing", ".", "unknown"])
def test_a_bad_model_folder_shows_one_plain_error_next_to_the_field(hf_folders, folder):
    from workbench.errors import ConfigError
    from workbench.spec import load_spec

    wb = Workbench()
    path = str(hf_folders / folder)
    wb.layout_panel.model_path.value = path
    with pytest.raises(ConfigError) as why:
        load_spec(wb.state.raw)
    assert wb.state.spec is None and wb.state.error == str(why.value) and "Traceback" not in wb.state.error
    shown = [name for name, box in wb.layout_panel.errors.items() if box.value]
    assert shown == ["model"]  # the Model section: the HF folder field is its last row
    assert wb.memory_panel.fig_box.figure is None  # no chart of an earlier model
    wb.layout_panel.model_path.value = str(hf_folders / "gpt2")
    assert wb.state.error is None and not any(box.value for box in wb.layout_panel.errors.values())


def test_a_spec_with_a_model_folder_shows_it_in_the_form(hf_folders, tmp_path):
    from workbench.spec import load_spec

    path = tmp_path / "ft.yaml"
    load_spec({"name": "ft", "model": {"init": "hf", "path": str(hf_folders / "llama")}, "layout": {"dp": 2},
               "resources": {"gpu": "cpu"}}).save(path)
    wb = Workbench(str(path))
    assert wb.layout_panel.model_path.value == str(hf_folders / "llama")
    assert wb.layout_panel.fields["model.layers"].value == 2 and wb.layout_panel.fields["model.layers"].disabled
