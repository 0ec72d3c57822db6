"""Checkpoints in one process: exact resume (local disk and an object store), the schedule,
retention, the stage-module view, resume compatibility and the SIGTERM notice."""
import json
import os
import signal
import warnings

import fsspec
import pytest
import torch
import torch.nn as nn

from tests.helpers.events import losses
from tests.helpers.reference import reference_run
from tests.helpers.specs import tiny_gpt
from workbench.errors import ConfigError
from workbench.runtime.checkpoint import Checkpointer, union_module
from workbench.runtime.checkpoint_store import MANIFEST, Store
from workbench.runtime.loop import train
from workbench.runtime.preemption import PreemptionNotice
from workbench.spec import load_spec
from workbench.validate import check_resume

STEPS = 6


def tiny(uri=None, **ckpt) -> dict:
    return tiny_gpt(uri, name="ckpt", steps=STEPS, **ckpt)


def stop_after(n: int):
    calls = iter(range(1, 10_000))
    return lambda: next(calls) >= n


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """The uninterrupted run's loss at steps 1..STEPS."""
    return reference_run(tiny()).losses()


def test_interrupted_run_resumes_on_the_exact_curve(tmp_path, reference):
    events: list[dict] = []
    out = train(tiny(tmp_path, every_steps=2), events.append, should_stop=stop_after(3))
    assert out["status"] == "preempted" and out["step"] == 3
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [2, 3]  # on schedule + on stop
    assert events[-1] == {"event": "end", "status": "preempted", "step": 3}

    resumed: list[dict] = []
    out = train(tiny(tmp_path, every_steps=2), resumed.append, resume=True)
    assert out["status"] == "completed"
    assert {"event": "restart", "attempt": 0, "from_step": 3} in resumed
    assert [e["step"] for e in resumed if e["event"] == "step"] == [4, 5, 6]
    assert losses(resumed) == reference[3:]  # bit-for-bit, not approximately


def test_object_store_async_save_and_retention(reference):
    uri = "memory://workbench-test/async"
    events: list[dict] = []
    train(tiny(uri, every_steps=1, keep=2, async_save=True), events.append, should_stop=stop_after(4))
    store = Store(uri)
    assert store.committed_steps() == [4, 3]  # keep=2
    assert [e["uri"] for e in events if e["event"] == "checkpoint"][-1] == "memory:///workbench-test/async/step-000000004"
    manifest = json.loads(store.fs.cat(f"{store.step_dir(4)}/{MANIFEST}"))
    assert manifest["step"] == 4 and manifest["spec"]["model"]["preset"] == "gpt-tiny"
    assert set(manifest["files"]) >= {".metadata", "rng-rank00000.pt"}

    resumed: list[dict] = []
    train(tiny(uri, every_steps=1, keep=2, async_save=True), resumed.append, resume=True)
    assert losses(resumed) == reference[4:]
    fsspec.filesystem("memory").rm("/workbench-test", recursive=True)


def _linear_checkpointer(uri, clock, **ckpt):
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    saved = []
    spec = load_spec(tiny(uri, **ckpt)).to_dict()
    return Checkpointer(spec, [model], opt, clock=clock, on_saved=lambda s, u: saved.append(s)), model, saved


def test_time_based_saves_and_keep(tmp_path):
    now = [0.0]
    ck, model, saved = _linear_checkpointer(tmp_path, lambda: now[0], every_minutes=1.0, keep=2)
    plan = []

    def poll(step: int, stop: bool) -> tuple[bool, bool]:  # one rank: its flags are the agreed ones
        return ck.decide(step, ck.flags(step, stop, last_step=10), last_step=10)

    for step, minutes in enumerate([0.5, 1.2, 1.5, 2.3, 3.4], start=1):
        now[0] = minutes * 60
        save, stop = poll(step, False)
        plan.append(save)
        if save:
            ck.save(step)
    assert plan == [False, True, False, True, True] and saved == [2, 4, 5]
    assert Store(str(tmp_path)).committed_steps() == [5, 4]
    assert poll(10, False) == (True, False)  # the last step is always saved
    assert poll(7, True) == (True, True)  # a stop request saves, then stops


def test_manifestless_directories_are_never_loaded(tmp_path):
    ck, model, saved = _linear_checkpointer(tmp_path, lambda: 0.0)
    ck.save(2)
    weights = model.weight.detach().clone()
    ck.save(3)
    os.remove(tmp_path / "step-000000003" / MANIFEST)  # as if the writer died before the commit
    (tmp_path / "step-000000009.partial").mkdir()  # an interrupted local write
    with torch.no_grad():
        model.weight.zero_()
    assert ck.restore() == 2
    torch.testing.assert_close(model.weight, weights, rtol=0, atol=0)
    ck.save(4)  # the next commit clears the stale directories below it
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000002", "step-000000004", "step-000000009.partial"]


def test_union_module_keeps_the_full_models_names():
    full = nn.Module()
    full.emb = nn.Embedding(8, 4)
    full.blocks = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(4)})
    full.head = nn.Linear(4, 8)
    first, last = nn.Module(), nn.Module()
    first.emb, first.blocks = full.emb, nn.ModuleDict({"0": full.blocks["0"], "1": full.blocks["1"]})
    last.blocks, last.head = nn.ModuleDict({"2": full.blocks["2"], "3": full.blocks["3"]}), full.head
    view = union_module([first, last])
    assert sorted(n for n, _ in view.named_parameters()) == sorted(n for n, _ in full.named_parameters())
    assert dict(view.named_parameters())["blocks.3.weight"] is full.blocks["3"].weight


def test_resume_rules_name_the_difference():
    saved = load_spec(tiny())
    assert check_resume(load_spec(dict(tiny(), layout={"dp": 2}, resources={"gpus_per_node": 2})), saved) == []
    with pytest.raises(ConfigError, match=r"model\.layers: checkpoint has 4, this spec has 6"):
        check_resume(load_spec(dict(tiny(), model={"preset": "gpt-tiny", "layers": 6})), saved)
    with pytest.raises(ConfigError, match=r"train\.optimizer: checkpoint has 'adamw', this spec has 'sgd'"):
        check_resume(load_spec(dict(tiny(), train=dict(tiny()["train"], optimizer="sgd"))), saved)
    notes = check_resume(load_spec(dict(tiny(), precision={"dtype": "bf16"})), saved)  # converted on load
    assert len(notes) == 1 and "precision.dtype changed ('fp32' -> 'bf16')" in notes[0]
    notes = check_resume(load_spec(dict(tiny(), train=dict(tiny()["train"], global_batch=16))), saved)
    assert len(notes) == 1 and "global_batch" in notes[0]
    other = load_spec(dict(tiny(), name="review-b", train=dict(tiny()["train"], lr=1e-3)))  # another job, same shape
    with pytest.raises(ConfigError, match=r"belong to the job '.*', and this spec is the job 'review-b'.*model\.init: "
                                          r"checkpoint"):
        check_resume(other, saved)


def test_sigterm_sets_the_notice_and_restores_the_handler(monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionNotice() as notice:
        assert not notice.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert notice.requested and notice.seconds_left() > 0
        monkeypatch.setenv("WORKBENCH_PREEMPT_GRACE_S", "0")
        assert notice.seconds_left() < 0 and "grace period" in notice.overrun_message()
    assert signal.getsignal(signal.SIGTERM) is before


def test_resume_without_checkpoint_warns_and_starts_fresh(tmp_path):
    ck, _, _ = _linear_checkpointer(tmp_path / "empty", lambda: 0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ck.restore() == 0
    assert any("no complete checkpoint" in str(w.message) for w in caught)


def test_each_manifest_names_the_run_that_wrote_it_and_resume_loads_any(tmp_path, monkeypatch):
    """#34: the run id (WORKBENCH_RUN_ID, as the local backend sets it per job) is in every manifest, so
    the notebook tells its own checkpoints from another run's; `restore` (the CLI's explicit --resume)
    still loads another run's, and one written before runs had an id."""
    from workbench.runtime.checkpoint_store import manifest_run_id

    monkeypatch.setenv("WORKBENCH_RUN_ID", "run-a")
    ck, model, _ = _linear_checkpointer(tmp_path, lambda: 0.0)
    ck.save(2)
    ck.close()
    store = Store(str(tmp_path))
    manifest = store.read_manifest(2)
    assert manifest_run_id(manifest) == "run-a"
    # an old checkpoint: its manifest without the id
    del manifest["run_id"]
    store.write_manifest(store.step_dir(2), manifest)
    assert manifest_run_id(store.read_manifest(2)) is None and manifest_run_id(None) is None
    assert manifest_run_id({"run_id": 7}) is None  # not an id: never matches a run
    monkeypatch.setenv("WORKBENCH_RUN_ID", "run-b")
    ck, model, _ = _linear_checkpointer(tmp_path, lambda: 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ck.restore() == 2  # explicit resume: loads it whoever wrote it
    ck.save(3)
    ck.close()
    assert manifest_run_id(store.read_manifest(3)) == "run-b"


def test_a_fresh_run_refuses_a_uri_holding_another_runs_checkpoints(tmp_path, monkeypatch, capsys):
    """A fresh run (no resume) into a URI holding another run's checkpoints would write over the steps
    both reach, drop the others through retention, and make a later --resume load whichever run wrote
    the newest: the driver (before any worker) and the ranks refuse it, and nothing under the URI
    changes. The same run started again (its own id) is not refused; a checkpoint from before runs
    had an id is another run's."""
    import yaml

    from workbench.cli import main as cli_main
    from workbench.launch import check_fresh_checkpoint_uri

    monkeypatch.setenv("WORKBENCH_RUN_ID", "run-a")
    train(tiny(tmp_path, every_steps=2), [].append, should_stop=stop_after(4))
    store = Store(str(tmp_path))
    manifests = lambda: {s: store.fs.cat(f"{store.step_dir(s)}/{MANIFEST}") for s in store.committed_steps()}  # noqa: E731
    files = lambda: sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.name != "lease.json")  # noqa: E731
    before, listed = manifests(), files()
    assert sorted(before) == [2, 4]

    monkeypatch.setenv("WORKBENCH_RUN_ID", "run-b")
    with pytest.raises(ConfigError) as err:  # every rank's check (here the one rank's)
        train(tiny(tmp_path, every_steps=2), [].append)
    assert "holds another run's checkpoints (steps 2, 4; the newest, step 4, by run run-a)" in str(err.value)
    assert "`workbench run --resume`" in str(err.value) and "checkpoint.keep: 3" in str(err.value)
    monkeypatch.delenv("WORKBENCH_RUN_ID")  # the CLI: a new run, refused before Ray or any worker starts
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(tiny(tmp_path, every_steps=2)))
    assert cli_main(["run", str(spec_file), "--no-progress"]) == 2
    assert "holds another run's checkpoints" in capsys.readouterr().err
    assert cli_main(["validate", str(spec_file)]) == 2  # validate refuses what run refuses
    assert "holds another run's checkpoints" in capsys.readouterr().err
    assert cli_main(["validate", str(spec_file), "--resume"]) == 0  # and passes what run --resume takes
    spec_file.unlink()
    assert manifests() == before and files() == listed  # nothing written, nothing deleted

    monkeypatch.setenv("WORKBENCH_RUN_ID", "run-a")
    check_fresh_checkpoint_uri(load_spec(tiny(tmp_path)))  # its own checkpoints: the same run again
    manifest = store.read_manifest(4)
    del manifest["run_id"]  # written before runs had an id
    store.write_manifest(store.step_dir(4), manifest)
    with pytest.raises(ConfigError, match=r"step 4, by a run from before checkpoints named their run"):
        check_fresh_checkpoint_uri(load_spec(tiny(tmp_path)))
