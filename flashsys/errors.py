"""Errors flashsys raises on purpose."""


class UsageError(Exception):
    """Bad input to the command line or the trainer: printed as one clear line, exit code 2."""
