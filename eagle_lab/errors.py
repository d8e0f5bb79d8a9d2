"""The one exception type for mistakes a user can cause (bad path, config, prompt...).

Entry points catch it, print one line on stderr and exit non-zero; anything else is a bug
and keeps its traceback.
"""


class EagleLabError(Exception):
    """A user-facing error: the message alone must say what is wrong and how to fix it."""
