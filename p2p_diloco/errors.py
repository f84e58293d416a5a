"""Errors a user can fix: each carries the exit code the command returns and a one-line message saying what to do."""

from __future__ import annotations

EXIT_BAD_INPUT = 2
"""Exit code for input the user must fix (a config value, a file, a model that does not match the swarm)."""
EXIT_NETWORK = 3
"""Exit code when the swarm could not be reached."""


class UserError(Exception):
    """Something the user must fix; str(error) is the one line to print."""

    exit_code = EXIT_BAD_INPUT


class NetworkUnreachableError(UserError):
    """The swarm (its initial peers) could not be reached."""

    exit_code = EXIT_NETWORK


class ConfigError(UserError, ValueError):
    """A configuration value the user must fix; the message says what."""
