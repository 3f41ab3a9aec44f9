"""Errors flashsys raises on purpose."""


class UsageError(Exception):
    """Bad input to the command line or the trainer: printed as one clear line, exit code 2."""


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite: training stops, and the last good checkpoint is kept."""
