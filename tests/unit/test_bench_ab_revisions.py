"""bench/ab_revisions.py: a revision's processes import workbench from that revision's tree (what
makes its A/B an A/B), the worktree goes away afterwards, and the summary pairs the arms by round."""
from pathlib import Path

from bench.ab_revisions import ROOT, imports_from, summary, worktree


def test_a_spawned_process_imports_workbench_from_the_tree_first_on_its_path():
    with worktree("HEAD") as tree:
        assert imports_from(tree) == str(Path(tree, "workbench", "__init__.py"))
    assert not Path(tree).exists()
    assert imports_from(str(ROOT)) == str(ROOT / "workbench" / "__init__.py")


def test_the_summary_pairs_the_arms_round_by_round():
    text = summary({"base": [20.0, 30.0, 25.0], "work": [10.0, 30.0, 25.0], "peer": [10.0, 15.0, 25.0]})
    assert "work speed / base: 1.000 (1.000..2.000;" in text  # base / work per round: 2, 1, 1
    assert "base / peer: 0.500 (0.500..1.000;" in text  # peer / base per round: 0.5, 0.5, 1
    assert "work / peer: 1.000 (0.500..1.000;" in text  # peer / work per round: 1, 0.5, 1
