"""Calls that could block forever (opening a pipe waits for a writer), run so that a regression
fails its test instead of hanging the suite."""
from __future__ import annotations

import threading
from collections.abc import Callable

from workbench.errors import ConfigError


def refusal_within(call: Callable[[], object], seconds: float = 20) -> str | None:
    """The message of the ConfigError `call()` raises within `seconds` (in a daemon thread), else None."""
    outcome: list[str] = []

    def run() -> None:
        try:
            call()
        except ConfigError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    return outcome[0] if outcome else None
