"""The one exception type the CLI turns into a one-line error and a non-zero exit."""


class OnboardError(Exception):
    """A problem with the user's input or environment, explained in one line."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception from code we do not own, as one short line: its type and its message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}"
