"""The runtime's one kind of error that is the user's to fix: a file or a setting it was handed that it cannot
use (an unreadable plan, a kernel store that is not a writable folder). Its message is one line; `onboard` says it
as an error of the input, exit 1, never as an internal error."""


class InputError(ValueError):
    """A problem with what the runtime was handed, explained in one line."""
