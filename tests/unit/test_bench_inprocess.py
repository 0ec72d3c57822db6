"""The in-process benchmarks at tiny sizes, then figures and the report drawn from their JSON."""
import pytest
import torch

from bench.common import write_result

pytestmark = pytest.mark.slow  # the benchmarks' harnesses: the whole suite keeps them from rotting


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from bench import bench_activation_ckpt, bench_overhead

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {"activation_ckpt": bench_activation_ckpt.run(quick=True), "overhead": bench_overhead.run(quick=True)}
    finally:
        torch.set_num_threads(threads)
    folder = tmp_path_factory.mktemp("results")
    for name, r in out.items():
        write_result(name, r, folder)
    return out, folder


@pytest.mark.timeout(120)
def test_activation_checkpointing_saves_memory_in_order(results):
    modes = results[0]["activation_ckpt"]["modes"]
    act = {m: modes[m]["activations"] for m in ("none", "selective", "full")}
    assert act["none"] > act["selective"] > act["full"] > 0
    for m in ("selective", "full"):
        assert 0 < modes[m]["memory_saved"] < 1
        assert modes[m]["step_s"]["median"] > 0
        # the meter and the estimator agree on what checkpointing keeps
        assert modes[m]["predicted_activations"] == pytest.approx(act[m], rel=0.05)


@pytest.mark.timeout(120)
def test_overhead_has_every_variant(results):
    r = results[0]["overhead"]
    cpu = r["whole"]["cpu_mean_step_s"]
    assert set(cpu) >= {"runtime, JSONL sink", "runtime, no-op sink", "plain loop"}
    assert all(v["median"] > 0 for v in cpu.values())
    assert isinstance(r["metrics_overhead"], float)
    assert isinstance(r["checkpoint_overhead"], float)
    assert all(run["checkpoints"] > 0 for run in r["whole"]["runs"][r["whole"]["checkpoint_name"]])
    parts = r["components"]["times"]
    assert parts["memory measurement"]["median"] > parts["JSONL event"]["median"] > 0


@pytest.mark.timeout(120)
def test_figures_and_report_from_json(results, tmp_path):
    from bench.plots import plot_all
    from bench.report import write_report

    _, folder = results
    drawn = plot_all(folder, tmp_path / "img")
    assert set(drawn) == {"activation_ckpt", "overhead"}
    for paths in drawn.values():
        for p in paths:
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size < 200_000
    doc = write_report(folder, tmp_path / "docs" / "benchmarks.md", tmp_path / "img")
    text = doc.read_text()
    assert "](../img/bench_overhead.png)" in text and "-core VM" in text
    assert "Not run yet" in text  # the benchmarks not run here say so instead of inventing numbers
    assert "GPU figures are pending" in text
