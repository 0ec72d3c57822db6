"""The start-up breakdown (workbench/startup.py) of a run's `startup` event, and the rank's part of
it: the per-rank loop reports its phases once, after step 1 (runtime/loop.py `on_started`)."""
import pytest

from workbench.startup import by_owner, format_startup, startup_rows

EVENT = {"event": "startup", "launch_to_step_1_s": 10.0, "reused": False,
         "driver": {"checks_s": 0.1, "ray_s": 0.0, "job_s": 0.0, "placement_s": 0.4, "relays_s": 1.5,
                    "store_s": 4.0, "ranks_s": 4.0},
         "ranks": {"0": {"python_start_s": 1.0, "import_torch_s": 3.0, "import_workbench_s": 1.0,
                         "import_dynamo_s": 1.0, "job_waited_s": 0.0, "spec_s": 0.0, "process_group_s": 0.5,
                         "model_s": 1.0, "data_s": 0.0, "checkpoint_s": 0.1, "first_step_s": 2.0}}}


def test_the_split_by_owner_adds_up_to_launch_to_step_1():
    split = by_owner(EVENT)
    assert split["Ray"] == pytest.approx(1.9)  # placement and relays
    # the 4 s wait for rank 0's imports: torch's share is (3 + 1) of the 6 s of imports; its process group
    assert split["torch"] == pytest.approx(4.0 * 4 / 6 + 0.5)
    assert sum(split.values()) == pytest.approx(10.0)


def test_the_table_names_every_phase_in_order_and_the_overlap():
    rows = startup_rows(EVENT)
    assert [r[0] for r in rows][:2] == ["driver: spec loaded and checked, checkpoint lease", "driver: Ray init / attach"]
    assert rows[-1] == ["launch to end of step 1", "", 10.0]
    assert ["  rank 0: import torch (overlapped)", "torch", 3.0] in rows
    text = format_startup(EVENT)
    assert "critical path: Ray 1.90 s" in text and "kept from the previous run" not in text
    assert "kept from the previous run" in format_startup({**EVENT, "reused": True})


def test_the_loop_reports_each_ranks_start_up_once_after_step_1():
    from workbench.runtime.loop import STARTUP_PHASES, train

    reports = []
    spec = {"name": "t", "model": {"preset": "gpt-tiny"}, "train": {"steps": 3, "global_batch": 2, "micro_batch": 2}}
    train(spec, lambda event: None, on_started=reports.append)
    assert len(reports) == 1
    (phases,) = reports
    assert list(phases) == list(STARTUP_PHASES)
    assert all(v >= 0 for v in phases.values()) and phases["first_step_s"] > 0


def test_a_kept_rank_process_imported_before_the_launch():
    rows = startup_rows({**EVENT, "reused": True})
    assert ["  rank 0: import torch (before launch)", "torch", 3.0] in rows
