"""A/B of two revisions: one bench_peers pair's workbench arm on a committed revision and on the
working tree, with the pair's peer beside them, alternated round by round in one script.

What a speed claim about a change needs: the same arm before and after it, measured side by side
on the same host, since this host moves 25% between runs (bench_peers' notes). Each revision runs
in its own 2-rank spawn pool whose processes import workbench (and bench) from that revision's tree:
a `git worktree` of `--base`, first on the pool's sys.path (a spawned process starts with its
parent's sys.path; the editable install's finder comes after it). Before any round, a spawned
process of each tree says where it imports workbench from, and a wrong tree stops the run. Round 0
warms both pools and is not measured; then per round each arm's median steady step (rank 0's step
ends after bench_peers' warm-up steps), in the order base, work, peer, reversed every other round.
Printed: each arm's median step and spread, and per round work's speed over base (base step / work
step) and each arm against the peer (peer step / arm step), with the median's 95% bootstrap interval.
Run: python -m bench.ab_revisions --pair pp-1f1b [--base HEAD] [--reps 13] [--steps 40]
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import runpy
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import bench_peers
from bench.common import median_ci, stats, table

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def worktree(rev: str):
    """A detached `git worktree` of `rev` in a temporary folder, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="workbench-ab-") as parent:
        path = str(Path(parent, "tree"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", path, rev], check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", path], check=False)


@contextlib.contextmanager
def _spawning_from(root: str):
    """Processes spawned inside start with `root` first on sys.path, and do not run this script
    again as their __main__ (the other tree may not have it): what they run travels by module name."""
    main = sys.modules["__main__"]
    spec, file = main.__dict__.get("__spec__"), main.__dict__.get("__file__")
    sys.path.insert(0, root)
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        sys.path.remove(root)
        main.__spec__ = spec
        if file is not None:
            main.__file__ = file


def imports_from(root: str) -> str:
    """The file a process spawned under `_spawning_from(root)` imports workbench from, as the ranks
    of a pool made there will."""
    with tempfile.TemporaryDirectory() as d:
        script, out = Path(d, "where.py"), Path(d, "where.txt")
        script.write_text(f"import pathlib, workbench\npathlib.Path({str(out)!r}).write_text(workbench.__file__)\n")
        with _spawning_from(root):
            p = mp.get_context("spawn").Process(target=runpy.run_path, args=(str(script),))
            p.start()
        p.join(120)
        return out.read_text() if out.exists() else f"nothing (exit code {p.exitcode})"


def _pool_at(root: str):
    from workbench.runtime.spawn import SpawnPool

    where = imports_from(root)
    if not where.startswith(str(Path(root, "workbench"))):
        raise RuntimeError(f"a process started with {root} first on its path imports workbench from {where}")
    with _spawning_from(root):
        return SpawnPool(2)


def _median_step_ms(events: list[dict], skip: int) -> float:
    t = sorted((e for e in events if e["event"] == "peer"), key=lambda e: e["rank"])[0]["times"]
    return statistics.median(b - a for a, b in zip(t[skip:], t[skip + 1:])) * 1e3


def run(pair: str, base: str = "HEAD", reps: int = 13, steps: int = 40) -> dict:
    """Per arm ("base", "work", "peer"), the median step in ms of each measured round."""
    cfg = {**bench_peers.config(False), "steps": steps}
    jobs = bench_peers._jobs(pair, cfg)
    arms = [("base", "workbench"), ("work", "workbench"), ("peer", "peer")]
    step_ms: dict[str, list[float]] = {name: [] for name, _ in arms}
    with worktree(base) as tree:
        pools = {"base": _pool_at(tree), "work": _pool_at(str(ROOT))}
        try:
            for r in range(reps + 1):
                for name, arm in arms if r % 2 == 0 else arms[::-1]:
                    # bench_peers._arm_job travels by name: each pool's ranks run their own tree's
                    events = pools["base" if name == "base" else "work"].run(jobs[arm], fn=bench_peers._arm_job,
                                                                             timeout_s=900)
                    if r:
                        step_ms[name].append(_median_step_ms(events, cfg["skip"]))
        finally:
            for pool in pools.values():
                pool.close()
    return step_ms


def summary(step_ms: dict[str, list[float]]) -> str:
    rows = [[arm, f"{statistics.median(v):.2f}", f"{min(v):.2f}..{max(v):.2f}"] for arm, v in step_ms.items()]
    ratios = {"work speed / base": [b / w for b, w in zip(step_ms["base"], step_ms["work"])],
              "base / peer": [p / b for b, p in zip(step_ms["base"], step_ms["peer"])],
              "work / peer": [p / w for w, p in zip(step_ms["work"], step_ms["peer"])]}
    lines = [table(rows, ["arm", "median step ms", "spread"]), ""]
    for name, v in ratios.items():
        s = stats(v)
        lo, hi = median_ci(v)  # one round: (v, v)
        lines.append(f"{name}: {s['median']:.3f} ({s['min']:.3f}..{s['max']:.3f}; 95% {lo:.3f}..{hi:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", required=True, choices=sorted(bench_peers.PAIRS))
    p.add_argument("--base", default="HEAD", help="the revision to compare the working tree with")
    p.add_argument("--reps", type=int, default=13)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    step_ms = run(args.pair, args.base, args.reps, args.steps)
    print(f"{args.pair}: {args.base} (base) against the working tree (work), {args.reps} rounds of {args.steps} steps")
    print(summary(step_ms))
    return step_ms


if __name__ == "__main__":
    main()
