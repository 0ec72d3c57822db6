"""The benchmark helpers: statistics, alternation, steady-state throughput, results files."""
import pytest

from bench.common import (
    interleave,
    median_ci,
    paired_ratios,
    read_result,
    stats,
    steady_tokens_per_s,
    table,
    tiny_spec,
    write_result,
)


def test_stats_median_and_spread():
    s = stats([3.0, 1.0, 2.0, 10.0])
    assert s["n"] == 4 and s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 10.0
    assert s["q1"] <= s["median"] <= s["q3"]
    assert stats([])["n"] == 0


def test_interleave_alternates_and_skips_warmup():
    calls = []

    def make(name):
        def f():
            calls.append(name)
            return float(len(calls))
        return f

    out = interleave({"a": make("a"), "b": make("b")}, reps=2, warmup=1)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # order flips every round
    assert out == {"a": [4.0, 5.0], "b": [3.0, 6.0]}  # warm-up round dropped
    assert paired_ratios(out["a"], out["b"]) == [4.0 / 3.0, 5.0 / 6.0]


def test_steady_tokens_per_s_leaves_out_warmup():
    times = [0.0, 5.0, 6.0, 7.0, 8.0]  # a slow first step, then 1 s per step
    assert steady_tokens_per_s(times, tokens_per_step=100, skip=1) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="more than"):
        steady_tokens_per_s(times[:2], 100, skip=1)


def test_tiny_spec_sets_world_size_and_validates():
    from workbench.spec import load_spec

    spec = load_spec(tiny_spec("gpt-tiny", layout={"dp": 2, "zero": 1}, train={"global_batch": 8}))
    assert spec.layout.dp == 2 and spec.resources.gpus_per_node == 2 and spec.train.micro_batch == 4


def test_results_round_trip_with_machine(tmp_path):
    path = write_result("x", {"value": 1.5}, tmp_path)
    back = read_result("x", tmp_path)
    assert path.name == "x.json" and back["value"] == 1.5 and back["machine"]["cpus"] >= 1
    assert read_result("missing", tmp_path) is None
    text = table([["a", 1.23456], ["b", float("nan")]], ["name", "v"])
    assert "1.23" in text and "-" in text.splitlines()[-1]


def test_median_ci_brackets_the_median_and_narrows_with_more_rounds():
    few = [0.9, 1.1, 0.95, 1.05, 1.0]
    lo, hi = median_ci(few)
    assert lo <= 1.0 <= hi and hi - lo > 0
    many = few * 8
    lo2, hi2 = median_ci(many)
    assert lo2 <= 1.0 <= hi2 and hi2 - lo2 < hi - lo
    assert median_ci(few) == median_ci(few)  # seeded


def test_cpu_share_groups_processes_by_role():
    from bench.bench_cpu_share import group

    assert group("/venv/bin/python -c import sys; from backends.local_ray import _rank_main; _rank_main(5)") == "ranks"
    assert group("/venv/bin/python -u -m workbench.cloud_entry --spec s.json") == "ranks"
    assert group("/venv/bin/python -m torch.distributed.run --standalone -m workbench.cloud_entry") == "other"
    assert group("/venv/bin/python -m bench.torchrun --standalone -m workbench.cloud_entry") == "other"
    assert group("ray::RankRelay") == "Ray actors"
    assert group("ray::RankRelay.run") == "Ray actors"
    assert group("ray::DashboardAgent") == "Ray daemons"
    assert group("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x") == "Ray daemons"


def test_cpu_share_labels_drop_the_paths():
    import sys

    from bench.bench_cpu_share import label

    assert label(f"{sys.executable} -u /v/lib/python3.11/site-packages/ray/_private/log_monitor.py --x") == \
        "python -u ray/_private/log_monitor.py --x"


def test_cpu_share_labels_name_an_actor_by_its_class_during_a_call():
    from bench.bench_cpu_share import label

    # Ray retitles an actor's process while a method runs; the suite once failed on exactly this
    assert label("ray::RankRelay.exchange") == label("ray::RankRelay") == "ray::RankRelay"
    assert label("ray::IDLE") == "ray::IDLE"
