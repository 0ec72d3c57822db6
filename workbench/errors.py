"""The one error type users see: a ConfigError says the rule, the numbers and the fix."""


class ConfigError(ValueError):
    """Anything a user can get wrong in a spec or a command line.

    The message is meant to be read by a person: it states the rule that was broken, the
    numbers involved and a fix, e.g. ``dp(2) x tp(2) x pp(3) = 12 ranks, but resources give 8
    GPUs. Use degrees whose product is 8 (e.g. dp=2, tp=2, pp=2).``
    """


class WorkerError(RuntimeError):
    """A training worker failed; the message names the rank and the cause."""


def did_you_mean(word: str, known) -> str:
    """" Did you mean 'x'?" for the closest known name, or "" when none is close."""
    import difflib

    guess = difflib.get_close_matches(word, list(known), n=1)
    return f" Did you mean {guess[0]!r}?" if guess else ""
