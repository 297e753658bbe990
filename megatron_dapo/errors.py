"""The one error type a user should see as a single line: bad input, not a bug.

``InputError`` names the file, row, field, key or checkpoint at fault and the fix. The CLI prints it
as ``megatron-dapo: error: <message>`` on stderr, with no traceback, and exits with code 2
(cli.py). Everything that validates user input raises it (or a subclass: ``ConfigError``), as early
as the input allows: before a model is built and before anything is written to the run directory.
It subclasses ValueError, so callers that catch ValueError keep working.
"""


class InputError(ValueError):
    """Input that cannot be used (data file, checkpoint, run directory, responses file)."""


class ConfigError(InputError):
    """A configuration that cannot be used: unknown key, wrong type, inconsistent values, or a
    setting this machine or this model cannot run (raised where the setting is checked)."""


def one_line(err: BaseException) -> str:
    """The first line of an exception's message, for wrapping third-party errors."""
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]


def shown(value: object, limit: int = 60) -> str:
    """A user's value quoted inside a one-line message: as written (LaTeX keeps single backslashes,
    unlike repr), whitespace collapsed so that it stays one line, cut at ``limit`` characters."""
    text = " ".join(str(value).split())
    return f"'{text[:limit]}...'" if len(text) > limit else f"'{text}'"
