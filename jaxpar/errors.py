"""Error classes every room may raise without importing the config (imports nothing)."""


class ConfigError(ValueError):
    """A config or layout that cannot run; the message names the numbers and the fix."""
