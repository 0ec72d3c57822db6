"""`workbench ARGS` in the test's own process: `workbench.cli.main` with its stdout and stderr
captured, answered as a `subprocess.CompletedProcess` (returncode, stdout, stderr).

A new `python -m workbench.cli` process costs its imports (torch, Ray, the cloud SDKs: 2-10 s of
CPU on 2 cores) and, for `run` and `calibrate` on the local backend, an embedded Ray cluster of
its own. Everything the CLI does past `sys.exit(main())` is `main()`'s, so a test starts a process
only where the process itself is under test (signals, the interpreter's exit code, a fresh
import); the rest call this, and in-process Ray jobs share the pytest process's embedded cluster
(docs/testing.md)."""
from __future__ import annotations

import contextlib
import io
import subprocess
import warnings

from workbench.cli import main


def run_cli(*args) -> subprocess.CompletedProcess:
    """`workbench ARGS` through `main()`; an exception that escapes it fails the test, as a
    traceback from the process would (exit 1 there). Warnings end up in stderr, each time (a
    process shows each once per place), but for the kinds the interpreter hides by default."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", hidden)
        try:
            code = main(argv)
        except SystemExit as e:  # argparse refusing the command line
            code = e.code if isinstance(e.code, int) else 2
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return subprocess.CompletedProcess(["workbench", *argv], code, out.getvalue(), err.getvalue() + shown)
