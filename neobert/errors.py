"""Errors that mean "the input is wrong" (a config, a data file, a checkpoint, a model path), as opposed to a
bug. Every `experiments.*` command line prints these as one clear line and exits with status 2; anything else
keeps its traceback."""

from __future__ import annotations


class UserInputError(ValueError):
    """Bad input the user can fix; the message says what and where."""


class ConfigError(UserInputError):
    """A configuration that cannot be used; the message names the offending key or file."""


class DataError(UserInputError):
    """A data source that cannot be used (missing, empty, undecodable, a missing column, labels out of range)."""


class CheckpointError(UserInputError):
    """A checkpoint that cannot be used (missing, corrupt, truncated, or of another model)."""


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C after Lightning's graceful shutdown; the message says where it stopped and how to
    resume. Command lines print it as one line and exit with status 130 (the shell's for SIGINT)."""

