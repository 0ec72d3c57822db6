"""The `workbench` command: run, validate, memory, plan, dispatch (see DESIGN.md, Contracts)."""
from __future__ import annotations

import argparse
import json
import sys

from workbench.errors import ConfigError, WorkerError
from workbench.spec_input import clip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench", description="Plan, run and dispatch parallel training jobs.")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument("spec", help="job spec (YAML)")
        c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a spec field, e.g. --set layout.dp=4 (repeatable)")
        return c

    run = command("run", "Run the job on the backend named in the spec (default: local Ray).")
    run.add_argument("--metrics-out", help="write metrics events as JSON lines to this file")
    run.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    run.add_argument("--report", help="write a self-contained HTML report of the run to this file")
    run.add_argument("--no-progress", action="store_true", help="no terminal progress bar")

    command("validate", "Check the spec; exit 2 with the reason if it is invalid.")
    memory = command("memory", "Predicted memory per rank.")
    memory.add_argument("--json", action="store_true", help="machine-readable output")
    plan = command("plan", "Candidate layouts for the spec's resources, best first.")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--top", type=int, default=10, help="how many candidates to show (default 10)")
    dispatch = command("dispatch", "Submit the job to a backend, or print the request with --dry-run.")
    dispatch.add_argument("--backend", help="local | ray | sagemaker | vertex | azureml (default: the spec's)")
    dispatch.add_argument("--dry-run", action="store_true", help="print the exact request; needs no credentials or network")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except ConfigError as e:
        # capped, and printable whatever undecodable bytes (a file name, a --set value) it quotes
        text = clip(str(e)).encode("utf-8", "backslashreplace").decode("utf-8")
        print(f"error: {text}", file=sys.stderr)
        return 2
    except WorkerError as e:
        print(f"error: training failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _load(args):
    from workbench.spec import load_spec

    return load_spec(args.spec, args.overrides)


def _run(args) -> int:
    from workbench.launch import run

    spec = _load(args)
    result = run(spec, metrics_out=args.metrics_out, resume=args.resume, progress=not args.no_progress,
                 report=args.report)
    return 0 if result.status == "completed" else result.exit_code


def _validate(args) -> int:
    spec = _load(args)
    print(f"ok: {spec!r}")
    return 0


def _memory(args) -> int:
    from workbench.memory import estimate_memory

    est = estimate_memory(_load(args))
    print(json.dumps(est.to_dict(), indent=2) if args.json else est.table())
    return 0


def _plan(args) -> int:
    from workbench.planner import plan

    result = plan(_load(args))
    print(json.dumps(result.to_dict(top=args.top), indent=2) if args.json else result.table(top=args.top))
    return 0


def _dispatch(args) -> int:
    from backends import dispatch

    spec = _load(args)
    out = dispatch(spec, backend=args.backend, dry_run=args.dry_run)
    if args.dry_run:
        print(json.dumps(out, indent=2, default=str))
    else:
        print(f"submitted: {out.job_id}")
    return 0


_COMMANDS = {"run": _run, "validate": _validate, "memory": _memory, "plan": _plan, "dispatch": _dispatch}

if __name__ == "__main__":
    sys.exit(main())
