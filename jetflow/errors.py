"""The base of every error that is the user's to fix (a config value, a file, a checkpoint, data, a
missing optional package, a run that diverged): `jetflow` prints it as one line (what, where, how to
fix) and exits 2; `jetflow --debug ...` shows the traceback. Any other exception is a bug in jetflow
and keeps its traceback."""


class UserError(Exception):
    """Something the user can fix; its message says what and how."""


class UsageError(UserError, ValueError):
    """A command's own argument (not a config key) is invalid: `jetflow launch --nodes 0`."""


class MissingDependencyError(UserError, ImportError):
    """An optional package is not installed; the message gives the install command."""
