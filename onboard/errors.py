"""The one exception type the CLI turns into a one-line error and a non-zero exit."""


class OnboardError(Exception):
    """A problem with the user's input or environment, explained in one line."""
