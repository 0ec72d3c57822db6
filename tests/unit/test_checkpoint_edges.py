"""Checkpoint edge cases found by fault injection (issue 20): resume between an fp32 master and a
torch optimizer in both directions (state compared exactly), every checkpoint corrupt, and a
store that refuses directory renames (the commit is the manifest alone)."""
import json
import os
import shutil
import socket
import time
import warnings

import fsspec
import pytest
import torch
import yaml

from tests.helpers.events import losses
from tests.helpers.reference import reference_run
from tests.helpers.specs import tiny_gpt
from tests.helpers.stores import register as register_norename
from workbench.cli import main as cli_main
from workbench.errors import ConfigError
from workbench.models import build_model_meta
from workbench.parallel.apply import parallelize
from workbench.parallelism import Parallelism
from workbench.runtime.checkpoint import Checkpointer, CheckpointError, build_checkpointer
from workbench.runtime.checkpoint_lease import LEASE
from workbench.runtime.checkpoint_store import RESUME_OR_FRESH, Store
from workbench.runtime.loop import build_train_step, train
from workbench.spec import load_spec

STEPS = 4


def tiny(uri, dtype="fp32", **ckpt) -> dict:
    return tiny_gpt(uri, name="edges", steps=STEPS, dtype=dtype, **ckpt)


def restored(spec: dict):
    """A fresh single-process model + train step of `spec` with the newest checkpoint loaded."""
    spec = load_spec(spec)
    parallelism = Parallelism.from_spec(spec)
    parallelized = parallelize(build_model_meta(spec), None, parallelism, device=torch.device("cpu"), seed=0)
    step_fn = build_train_step(parallelized, spec, parallelism, torch.device("cpu"), None)
    events = []
    ckpt = build_checkpointer(spec, parallelized.modules, step_fn.optimizer, events.append,
                              extra_state=step_fn.stateful())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = ckpt.restore()
    ckpt.close()
    return step, parallelized, step_fn, events


def test_fp32_optimizer_state_becomes_a_bf16_runs_master_and_back(tmp_path):
    train(tiny(tmp_path / "a", every_steps=2), [].append)  # fp32: a torch AdamW over fp32 weights
    step, parallelized, fp32_step, _ = restored(tiny(tmp_path / "a"))
    weights = {n: p.detach().clone() for n, p in parallelized.modules[0].named_parameters()}
    opt = fp32_step.optimizer
    moments = [torch.cat([opt.state[p][k].reshape(-1) for p in parallelized.modules[0].parameters()])
               for k in ("exp_avg", "exp_avg_sq")]

    step, parallelized, bf16_step, events = restored(tiny(tmp_path / "a", dtype="bf16"))  # fp32 -> bf16 master
    assert step == STEPS
    master = bf16_step.master
    torch.testing.assert_close(master.full_master(), torch.cat([w.reshape(-1) for w in weights.values()]),
                               rtol=0, atol=0)  # the fp32 master is the fp32 weights, exactly
    for got, want in zip(master.store.moments, moments):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert master.num_steps == STEPS
    assert all(p.dtype == torch.bfloat16 for p in parallelized.modules[0].parameters())
    assert any("converted" in e.get("message", "") for e in events if e["event"] == "warning")

    # bf16 master -> fp32 torch optimizer: the weights are the master, the moments the master's.
    train(tiny(tmp_path / "b", dtype="bf16", every_steps=2), [].append)
    _, _, bf16_step, _ = restored(tiny(tmp_path / "b", dtype="bf16"))
    flat, saved_moments = bf16_step.master.full_master(), [m.clone() for m in bf16_step.master.store.moments]
    step, parallelized, fp32_step, _ = restored(tiny(tmp_path / "b"))
    params = list(parallelized.modules[0].parameters())
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in params]), flat, rtol=0, atol=0)
    for k, want in zip(("exp_avg", "exp_avg_sq"), saved_moments):
        got = torch.cat([fp32_step.optimizer.state[p][k].reshape(-1) for p in params])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert int(fp32_step.optimizer.state[params[0]]["step"]) == STEPS


def test_every_checkpoint_corrupt_refuses_unless_fresh_is_asked(tmp_path, capsys):
    train(tiny(tmp_path, every_steps=2), [].append)
    for step in (2, 4):
        path = tmp_path / f"step-{step:09d}" / "__0_0.distcp"
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as err:
        train(tiny(tmp_path), [].append, resume=True)
    message = str(err.value)
    assert "step-000000004: __0_0.distcp: CRC-32 mismatch" in message
    assert "step-000000002: __0_0.distcp: CRC-32 mismatch" in message and "--resume-or-fresh" in message
    with pytest.raises(ConfigError, match="every checkpoint under"):  # the driver's check, before any worker
        from workbench.launch import check_resume_from_checkpoint

        check_resume_from_checkpoint(load_spec(tiny(tmp_path)))
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(tiny(tmp_path)))
    assert cli_main(["run", str(spec_file), "--resume", "--no-progress"]) == 2  # refused before any worker
    assert "every checkpoint under" in capsys.readouterr().err
    events = []
    with pytest.warns(UserWarning, match="no complete checkpoint"):
        train(tiny(tmp_path), events.append, resume=RESUME_OR_FRESH)
    assert {"event": "restart", "attempt": 0, "from_step": 0, "rejected": [4, 2]} in events
    assert len(losses(events)) == STEPS


def test_a_store_that_refuses_directory_renames_saves_retains_and_resumes(tmp_path):
    register_norename()
    uri = f"norename://{tmp_path}/run"
    with pytest.raises(OSError, match="refused"):
        fsspec.filesystem("norename").mv(str(tmp_path), str(tmp_path) + "-moved")
    reference = reference_run(tiny(None) | {"checkpoint": {}})
    first = []
    train(tiny(uri, every_steps=1, keep=2), first.append, should_stop=iter([False, False, True]).__next__)
    store = Store(uri)
    assert not store.local and store.committed_steps() == [3, 2]
    resumed = []
    train(tiny(uri, every_steps=1, keep=2), resumed.append, resume=True)
    assert losses(resumed) == reference.losses()[3:]
    shutil.rmtree(tmp_path / "run")


def test_a_run_whose_lease_was_taken_over_stops_writing(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_LEASE_TTL_S", "0.8")  # a heartbeat every 0.1 s
    model = torch.nn.Linear(4, 2)
    ck = Checkpointer(load_spec(tiny(tmp_path)).to_dict(), [model], torch.optim.SGD(model.parameters(), lr=0.1))
    ck.save(1)
    store = Store(str(tmp_path))
    other = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": "other", "token": "other-token",
             "heartbeat_unix": time.time()}
    store.write_atomic(store.path(LEASE), json.dumps(other).encode())  # as a run that took it over
    deadline = time.monotonic() + 30
    while ck.lease.lost is None and time.monotonic() < deadline:  # the next heartbeat notices
        time.sleep(0.05)
    with pytest.raises(CheckpointError, match="taken over by run 'other'"):
        ck.save(2)
    assert store.committed_steps() == [1]
    ck.close()
    assert json.loads(store.fs.cat_file(store.path(LEASE)))["run_id"] == "other"  # not ours to remove
