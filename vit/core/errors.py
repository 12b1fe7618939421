"""The project's exceptions. ConfigError is the only one reported as a user's mistake (one line,
exit 2; CannotGoOn, exit 3); anything else that escapes is a bug or a fault and keeps its
traceback."""


class ConfigError(Exception):
    """Bad input: reported as one line, before anything is written."""

    exit_status = 2


class CannotGoOn(ConfigError):
    """A checkpoint that cannot go on on this number of ranks: one line and exit 3, which
    scripts/retry.sh takes as a reason to wait for a host to come back (exit 2, a mistake, it does
    not retry)."""

    exit_status = 3


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite (outside fp16's skipped steps)."""


class OutOfMemory(RuntimeError):
    """A rank ran out of device memory; the message says what would fit."""


class NothingToDo(Exception):
    """The run asked for is already complete: say so and exit 0, touching nothing."""
