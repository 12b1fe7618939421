"""The project's exceptions. ConfigError is the only one reported as a user's mistake (one line,
exit 2); anything else that escapes is a bug or a fault and keeps its traceback."""


class ConfigError(Exception):
    """Bad input: reported as one line, before anything is written."""


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite (outside fp16's skipped steps)."""


class OutOfMemory(RuntimeError):
    """A rank ran out of device memory; the message says what would fit."""


class NothingToDo(Exception):
    """The run asked for is already complete: say so and exit 0, touching nothing."""
