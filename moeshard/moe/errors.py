"""Errors that carry a one-line, user-facing message (the CLI prints it and exits 2)."""


class MoeshardError(Exception):
    """Bad input (malformed checkpoint, corrupt shard, wrong model); the message names the file."""


class ConfigError(MoeshardError):
    """config.json is missing a field, has a bad value, or names an unsupported model."""


class CheckpointError(MoeshardError):
    """A checkpoint tensor is missing, mis-shaped, or its file is unreadable."""


class StoreError(MoeshardError):
    """A model directory or shard file is malformed, truncated, corrupted or foreign."""


class Terminated(BaseException):
    """SIGTERM arrived during a generation (raised like KeyboardInterrupt for SIGINT, so no
    `except Exception` swallows it); the CLI exits 143 after writing the partial result."""
