"""Errors the user can fix."""


class ConfigError(Exception):
    """Bad input: reported as one line, before anything is written."""
