"""Errors that describe a user mistake.

Every exception raised because of bad input (a wrong path, an invalid flag value, a prompt
that does not fit) is a :class:`DdspecError`. The CLI prints its message and exits with
status 2 instead of showing a stack trace; the message names the bad input and the fix.
"""


class DdspecError(Exception):
    """A user-facing error: the message says what is wrong and what to do about it."""


class ModelLoadError(DdspecError):
    """A target model or draft head could not be found, read or converted."""


class ConfigError(DdspecError, ValueError):
    """A setting is outside its valid range."""
