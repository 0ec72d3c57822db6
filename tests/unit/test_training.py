"""Single-process training features: schedules applied and resumed exactly, eval events, the
TensorBoard and MLflow trackers read back from their real files, and the CLI's data prepare."""
import json
import math
import os

import pytest

from tests.helpers.events import loss_by_step, losses, series
from tests.helpers.marks import fast_first
from tests.helpers.reference import reference_run
from tests.helpers.specs import tiny_gpt
from workbench.cli import main
from workbench.data import DEFAULT_TEXT
from workbench.runtime.loop import train
from workbench.schedule import lr_curve
from workbench.spec import load_spec

STEPS = 8


def tiny(tmp_path=None, schedule="cosine", **extra) -> dict:
    """`extra`: whole top-level sections (tracking, or a train section that replaces this one)."""
    ckpt = {"uri": tmp_path / "ckpt", "every_steps": 1} if tmp_path is not None else {}
    spec = tiny_gpt(**ckpt, name="train-features", steps=STEPS, global_batch=4, micro_batch=2,
                    train={"lr": 1e-2, "schedule": schedule, "warmup_steps": 3, "min_lr": 1e-3, "eval_every": 4,
                           "eval_batches": 2})
    return {**spec, "data": {"source": "text", "val_fraction": 0.2}, **extra}


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny()).events


def test_schedule_is_applied_and_eval_events_come_on_schedule(reference):
    assert series(reference, "lr") == pytest.approx(lr_curve(load_spec(tiny()).train))
    evals = [e for e in reference if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [4, 8]
    for e in evals:
        assert math.isclose(e["perplexity"], math.exp(e["loss"])) and 0 < e["loss"] < math.log(256) + 0.5
    # A constant schedule trains differently: the schedule really reached the optimizer.
    const = []
    train(tiny(schedule="constant", train={**tiny()["train"], "schedule": "constant", "warmup_steps": 0}), const.append)
    assert losses(const)[1:] != losses(reference)[1:]


@pytest.mark.parametrize("stop", fast_first([2, 5], [2]))  # mid-warmup, mid-decay
def test_resume_gets_the_same_lr_and_loss_curve(tmp_path, reference, stop):
    calls = iter(range(1, 100))
    first = []
    train(tiny(tmp_path), first.append, should_stop=lambda: next(calls) >= stop)
    resumed = []
    train(tiny(tmp_path), resumed.append, resume=True)
    assert series(resumed, "step") == list(range(stop + 1, STEPS + 1))
    assert series(first, "lr") + series(resumed, "lr") == series(reference, "lr")
    assert losses(first) + losses(resumed) == losses(reference)  # bit-for-bit
    assert losses(first, "eval") + losses(resumed, "eval") == losses(reference, "eval")


def test_trackers_write_real_tensorboard_and_mlflow_files(tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = []
    uri = f"file:{tmp_path / 'mlruns'}"
    train(tiny(tracking={"tensorboard": str(tmp_path / "tb"), "mlflow": uri}), events.append)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    loss = [(s.step, s.value) for s in acc.Scalars("train/loss")]
    assert loss == [(step, pytest.approx(value)) for step, value in loss_by_step(events).items()]
    assert [s.value for s in acc.Scalars("eval/perplexity")] == pytest.approx(series(events, "perplexity", "eval"))
    assert [s.value for s in acc.Scalars("train/lr")] == pytest.approx(series(events, "lr"))
    peak = [e["measured"]["peak"] for e in events if e["event"] == "memory"]
    assert [s.value for s in acc.Scalars("memory/peak_bytes")] == pytest.approx(peak)
    (text,) = acc.Tensors("spec/text_summary")
    assert b"schedule: cosine" in text.tensor_proto.string_val[0]

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("train-features").experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "eval/loss")
    assert [(m.step, m.value) for m in history] == [(e["step"], pytest.approx(e["loss"])) for e in events if e["event"] == "eval"]
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == STEPS
    assert run.data.params["train.schedule"] == "cosine" and run.data.params["layout.dp"] == "1"
    spec_file = client.download_artifacts(run.info.run_id, "spec.yaml", str(tmp_path))
    assert load_spec(spec_file) == load_spec(tiny(tracking={"tensorboard": str(tmp_path / "tb"), "mlflow": uri}))


def test_mlflow_uri_with_a_password_is_refused():
    from workbench import ConfigError

    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_PASSWORD"):
        load_spec({"tracking": {"mlflow": "https://me:secret@mlflow.example.com"}})


def test_cli_data_prepare(tmp_path, capsys):
    out = tmp_path / "tok"
    rc = main(["data", "prepare", str(DEFAULT_TEXT), "--out", str(out), "--vocab-size", "300", "--no-progress"])
    assert rc == 0 and "tokens" in capsys.readouterr().out
    assert json.loads((out / "index.json").read_text())["vocab_size"] == 300
    assert main(["data", "prepare", str(tmp_path / "none.txt"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
