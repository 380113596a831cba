"""The one error type of a bad job: a config value, a combination, a flag or a file the harness reads."""


class ConfigError(ValueError):
    """A bad config value or combination; the message is one line: field and fix."""
