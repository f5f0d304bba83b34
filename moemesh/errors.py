"""Errors meant for the user: each carries a message that names what to change."""


class ConfigError(ValueError):
    """A checkpoint or flag the system cannot run, with a message meant for the user."""


class CLIError(Exception):
    """A user error on the command line, reported as `moemesh: error: <message>` (exit status 2)."""


class LoadError(ValueError):
    """A checkpoint whose files do not hold what its config.json promises (a missing or misshapen tensor)."""
