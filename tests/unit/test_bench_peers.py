"""The peer benchmark (bench/bench_peers.py) at its smallest: each plain peer script trains the
same model as workbench on the session's shared 2-rank gloo pool (same losses), and the section
renders what the benchmark writes."""
import pytest

from bench import bench_peers

# One pair per peer script (FSDP2, parallelize_module with SP, pipelining): 3 steps each arm.
SMOKE = ["zero3", "tp-sp", "pp-1f1b"]


@pytest.mark.distributed
@pytest.mark.slow  # a benchmark's harness: the whole suite keeps it from rotting
@pytest.mark.timeout(180)
def test_peer_scripts_train_the_same_model_as_workbench(spawn_pools, monkeypatch):
    monkeypatch.setattr(bench_peers, "config", lambda quick, preset=None: {
        "preset": "gpt-tiny", "steps": 2, "skip": 1, "reps": 1, "warmup": 0})
    r = bench_peers.run(quick=True, only=SMOKE, pool=spawn_pools.get(2))
    assert set(r["pairs"]) == set(SMOKE)
    for name, p in r["pairs"].items():
        assert not p["failed"], (name, p["failed"])
        assert len(p["losses"]["workbench"]) == len(p["losses"]["peer"]) == 3
        assert p["loss_rel_diff"] < 1e-5, name  # same weights, batches and AdamW: summation order only
        assert p["ratio"]["median"] > 0 and p["cpu_ratio"]["median"] > 0  # CPU summed over both ranks
    text = bench_peers.section(r, None, None)
    assert all(f"`{name}`" in text for name in SMOKE)


def test_section_without_results_says_so():
    assert "Not measured yet" in bench_peers.section(None, None, None)


def test_every_pair_names_its_peer():
    for name, (layout, peer, _options) in bench_peers.PAIRS.items():
        assert peer in bench_peers.PEER_LABEL, name
        assert layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) == 2, name


def test_a_pair_that_lost_runs_says_so_beside_its_ratio():
    """A ratio over fewer rounds than asked is still printed; the line and the docs row say how many
    arm runs failed and why (DeepSpeed's peer once lost 3 of 6 rounds and nothing showed it)."""
    ok = {"n": 3, "median": 1.0, "min": 0.9, "max": 1.1, "q1": 1.0, "q3": 1.0}
    error = "\n".join(["peer: Traceback", "  File x", "ValueError: Group <ProcessGroup> is not registered"])
    pair = {"tokens_per_s": {"workbench": ok, "peer": ok}, "ratio": ok, "ratio_ci95": [0.9, 1.1], "cpu_ratio": ok,
            "loss_rel_diff": 1e-7, "rounds": 3, "failed": [error] * 3}
    line = bench_peers._line(pair)
    assert "3 arm runs failed (ValueError: Group <ProcessGroup> is not registered), 3 rounds measured" in line
    result = {"pairs": {"zero2-ds": pair}, "peer_labels": {"zero2-ds": "DeepSpeed ZeRO"}, "goal": 0.95,
              "config": {"preset": "gpt-tiny", "global_batch": 8, "micro_batch": 2, "steps": 10, "skip": 3, "reps": 6}}
    assert "3 arm runs failed" in bench_peers.section(result, None, None)
    assert "failed" not in bench_peers._line({**pair, "failed": []})


def test_a_run_of_some_pairs_keeps_the_others_and_the_notes():
    """`--only sp/tp` used to rewrite peers.json with that pair alone, dropping the other pairs and the notes."""
    previous = {"pairs": {"zero1": {"ratio": {"median": 2.0}}, "sp/tp": {"ratio": {"median": 0.86}}},
                "peer_labels": {"zero1": "plain FSDP2 / ZeRO optimizer", "sp/tp": "workbench tp=2 (no SP)"},
                "layouts": {"zero1": {"dp": 2, "zero": 1}, "sp/tp": {"tp": 2, "sequence_parallel": True}},
                "notes": "written by hand"}
    result = {"pairs": {"sp/tp": {"ratio": {"median": 0.9}}}, "peer_labels": {"sp/tp": "workbench tp=2 (no SP)"},
              "layouts": {"sp/tp": {"tp": 2, "sequence_parallel": True}}, "goal": 0.95}
    out = bench_peers.merged(previous, result)
    assert out["pairs"] == {"zero1": {"ratio": {"median": 2.0}}, "sp/tp": {"ratio": {"median": 0.9}}}
    assert set(out["peer_labels"]) == set(out["layouts"]) == {"zero1", "sp/tp"}
    assert out["notes"] == "written by hand" and out["goal"] == 0.95
    assert bench_peers.merged(None, result) == result
