"""Mixed precision on one process: loss scaling logic, bf16/fp16 training close to fp32, overflow skip."""
import pytest
import torch

from tests.helpers.events import losses
from workbench import build_model
from workbench.parallel.precision import DynamicLossScaler, apply_precision, autocast, mixed_precision_policy
from workbench.runtime.loop import train

BASE = {"model": {"preset": "gpt-tiny", "layers": 2, "seq_len": 32}, "train": {"steps": 4, "global_batch": 4, "micro_batch": 2, "lr": 3e-3}}


def run(precision=None):
    events = []
    state = train({**BASE, "precision": precision or {"dtype": "fp32"}}, events.append, gather_state=True)["state"]
    return [e for e in events if e["event"] == "step"], [e for e in events if e["event"] == "memory"], state


@pytest.fixture(scope="module")
def fp32():
    return run()


def test_scaler_backs_off_on_overflow_and_grows_after_clean_steps():
    s = DynamicLossScaler(1024.0, growth_interval=3)
    assert s.found_inf([torch.ones(3), None], torch.device("cpu")) is False
    assert s.found_inf([torch.tensor([1.0, float("inf")])], torch.device("cpu")) is True
    assert s.found_inf([torch.tensor([float("nan")], dtype=torch.float16)], torch.device("cpu")) is True
    s.update(True)
    assert s.scale == 512.0
    for _ in range(3):
        s.update(False)
    assert s.scale == 1024.0
    off = DynamicLossScaler(1024.0, enabled=False)
    loss = torch.tensor(2.0)
    assert off.scale_loss(loss) is loss and off.found_inf([torch.tensor([float("inf")])], torch.device("cpu")) is False


def test_precision_helpers():
    model = torch.nn.Linear(4, 4)
    assert apply_precision(model, "bf16").weight.dtype == torch.bfloat16
    assert mixed_precision_policy("fp16").param_dtype == torch.float16
    assert mixed_precision_policy("fp16").reduce_dtype == torch.float32
    with autocast("cpu", "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype,rtol", [("bf16", 2e-2), ("fp16", 5e-3)])
def test_mixed_precision_tracks_fp32(dtype, rtol, fp32):
    steps, memory, state = run({"dtype": dtype})
    torch.testing.assert_close(losses(steps), losses(fp32[0]), rtol=rtol, atol=0)
    assert max((state[k] - fp32[2][k]).abs().max().item() for k in state) < 0.05
    m, ref = memory[-1]["measured"], fp32[1][-1]["measured"]
    # 2 + 2 + 4 + 8 bytes per parameter against fp32's 4 + 4 + 0 + 8.
    assert (m["params"] * 2, m["grads"] * 2, m["master"]) == (ref["params"], ref["grads"], ref["params"])
    assert abs(m["optimizer"] - ref["optimizer"]) < 1024  # torch.optim's step counters
    assert ("loss_scale" in steps[0]) == (dtype == "fp16")


def test_fp16_overflow_is_skipped_and_the_scale_drops(fp32):
    steps, _, state = run({"dtype": "fp16", "initial_loss_scale": 2.0**40})
    assert [e["skipped"] for e in steps] == [True] * 4
    assert [e["loss_scale"] for e in steps] == [2.0**40, 2.0**39, 2.0**38, 2.0**37]
    init = build_model(BASE).state_dict()
    assert all(torch.equal(state[k], init[k]) for k in state)  # nothing was applied
