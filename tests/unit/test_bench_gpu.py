"""bench/gpu/train_1b.py's CPU path: the same code the GPU run takes, with a tiny model."""
import json

import pytest


@pytest.mark.timeout(120)
def test_train_1b_cpu_smoke(tmp_path):
    from bench.gpu import train_1b

    out = tmp_path / "gpu.json"
    result = train_1b.main(["--device", "cpu", "--preset", "gpt-tiny", "--steps", "4", "--warmup", "1", "--reps", "1",
                            "--global-batch", "4", "--micro-batch", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["name"] == "gpu_1b" and saved["config"]["device"] == "cpu"
    for v in result["variants"].values():
        assert v["tokens_per_s"]["median"] > 0
    # same model, same data, both bf16: the first losses agree closely
    rt, plain = result["first_losses"]["runtime"], result["first_losses"]["plain"]
    assert rt[0] == pytest.approx(plain[0], rel=2e-2)


def test_flops_and_catalog_names():
    from bench.gpu.train_1b import flops_per_token, gpu_catalog_name
    from workbench.spec import load_spec

    shape = load_spec({"model": {"preset": "gpt-1.3b"}}).model.shape()
    assert 1.2e9 < shape.num_params() < 1.5e9
    assert flops_per_token(shape) == 6 * shape.num_params() + 12 * 24 * 2048 * 2048
    assert gpu_catalog_name("NVIDIA H200") == "h200" and gpu_catalog_name("NVIDIA H100 80GB HBM3") == "h100-80gb"


SMOKE = ["--device", "cpu", "--preset", "gpt-tiny", "--steps", "4", "--warmup", "1", "--reps", "1",
         "--global-batch", "4", "--micro-batch", "2"]


@pytest.mark.distributed
@pytest.mark.slow  # the whole suite keeps the script from rotting; the fast loop runs train_1b's smoke
@pytest.mark.timeout(300)
def test_run_all_cpu_smoke_measures_every_arm(spawn_pools, tmp_path, monkeypatch):
    """bench/gpu/run_all.py's CPU smoke mode: the single arm, ZeRO-3 and TP on 2 gloo ranks, the
    calibrate arm, activation checkpointing and a llama on one rank, each with its predictions
    (catalog and calibrated) beside it, and the GPU section rendered from the JSON it wrote."""
    from bench.gpu import run_all
    from bench.gpu.section import section
    from bench.report import sec_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # main sets it for its ranks; restored after the test
    out = tmp_path / "gpu.json"
    run_all.main([*SMOKE, "--out", str(out)], pools={1: spawn_pools.get(1), 2: spawn_pools.get(2)})
    saved = json.loads(out.read_text())
    arms = saved["arms"]
    assert saved["name"] == "gpu" and list(arms) == ["single", "zero3", "tp", "calibrate", "ckpt", "llama"]
    assert {a["status"] for a in arms.values()} == {"ok"}, arms
    assert arms["calibrate"]["profile"]["device"] == "cpu" and arms["calibrate"]["profile"]["probes"]
    assert arms["ckpt"]["layout"] == {"dp": 1, "activation_checkpointing": "full"}
    assert arms["zero3"]["layout"] == {"dp": 2, "zero": 3} and arms["tp"]["layout"] == {"dp": 1, "tp": 2}
    assert arms["zero3"]["global_batch"] == 8 and arms["tp"]["global_batch"] == 4
    for name in ("zero3", "tp", "ckpt", "llama"):
        a = arms[name]
        assert a["tokens_per_s"] > 0 and len(a["losses"]) == 4
        assert a["step_time_s"]["measured"] > 0 and a["step_time_s"]["predicted"] > 0
        assert a["step_time_s"]["predicted_calibrated"] > 0  # added once the calibrate arm ran
        assert [m["rank"] for m in a["memory"]] == list(range(a["world"]))
        for m in a["memory"]:  # the meter's tracked bytes against estimate_memory for the same layout
            assert 0.5 < m["measured_over_predicted"] < 1.5, (name, m)
    # tp=2 trains the single arm's model on the same batches: its first loss is the runtime's
    assert arms["tp"]["losses"][0] == pytest.approx(arms["single"]["first_losses"]["runtime"][0], rel=2e-2)
    assert arms["single"]["step_time_s"]["predicted"] > 0 and arms["single"]["step_time_s"]["predicted_calibrated"] > 0
    # full activation checkpointing recomputes the forward: the same losses, a slower step
    assert arms["ckpt"]["losses"] == pytest.approx(arms["tp"]["losses"], rel=2e-2)
    text = section(saved)
    assert "CPU smoke run" in text and "`zero3`" in text and "`tp`" in text and "`single` plain loop" in text
    assert "`ckpt`" in text and "`llama`" in text and "calibrate arm's quick profile" in text
    assert sec_gpu(saved) == text


def test_budget_skips_what_would_not_fit_and_says_so(monkeypatch):
    from bench.gpu import run_all

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    saved: list[dict] = []
    r = run_all.run(run_all.resolve(run_all.parser(), [*SMOKE, "--budget-s", "5"]), save=saved.append)
    for name, a in r["arms"].items():
        assert a["status"] == "skipped" and "budget" in a["reason"], (name, a)
    assert [list(x["arms"]) for x in saved] == [list(run_all.ARMS[:n]) for n in range(1, len(run_all.ARMS) + 1)]


def test_one_device_reports_that_zero3_and_tp_need_two(monkeypatch):
    from bench.gpu import run_all
    from bench.gpu.section import section

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    r = run_all.run(run_all.resolve(run_all.parser(), [*SMOKE, "--gpus", "1", "--arms", "zero3,tp"]))
    for a in r["arms"].values():
        assert a["status"] == "skipped" and a["reason"].startswith("needs >= 2 GPUs (found 1)")
    text = section({**r, "machine": {}})
    assert "- `zero3` skipped: needs >= 2 GPUs" in text and "- `tp` skipped: needs >= 2 GPUs" in text


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failed_arm_is_recorded_and_the_next_one_still_runs(spawn_pools, monkeypatch):
    """The single arm gets a pool whose rank has exited (a real failure of SpawnPool.run); zero3
    then runs on the session's 2-rank pool."""
    from bench.gpu import run_all
    from workbench.runtime.spawn import SpawnPool

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    dead = SpawnPool(1)
    dead.close()
    r = run_all.run(run_all.resolve(run_all.parser(), [*SMOKE, "--arms", "single,zero3"]),
                    pools={1: dead, 2: spawn_pools.get(2)})
    # close() stops the rank, or kills it if it is still importing torch after 10 s: either way it is gone
    assert r["arms"]["single"]["status"] == "failed"
    assert "WorkerError" in r["arms"]["single"]["error"] and "while running a job" in r["arms"]["single"]["error"]
    assert r["arms"]["zero3"]["status"] == "ok" and r["arms"]["zero3"]["tokens_per_s"] > 0


def test_gpu_section_without_results_says_pending():
    from bench.gpu.section import section

    assert "GPU figures are pending" in section(None)


def test_arm_layouts_for_one_to_eight_gpus():
    from bench.gpu import arms

    base = arms.base_spec("gpt-1.3b", None, "bf16", 30, 8, 4, "h100-80gb")
    for world in (1, 2, 4, 8):
        zero3, tp = arms.arm_spec("zero3", world, base), arms.arm_spec("tp", world, base)
        assert zero3["layout"] == {"dp": world, "zero": 3} and zero3["train"]["global_batch"] == 8 * world
        assert tp["layout"] == {"dp": 1, "tp": world} and tp["train"]["global_batch"] == 8
        assert zero3["resources"]["gpus_per_node"] == tp["resources"]["gpus_per_node"] == world
        if world >= 2:  # gpt-1.3b (16 heads) runs both layouts on 2, 4 and 8 GPUs
            assert arms.skip_reason("zero3", world, zero3) is None and arms.skip_reason("tp", world, tp) is None
            assert arms.predict(zero3)["step_time_s"] > 0 and "h100-80gb" in arms.predict(tp)["source"]
    assert base == arms.base_spec("gpt-1.3b", None, "bf16", 30, 8, 4, "h100-80gb")  # arm_spec copies
