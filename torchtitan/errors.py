class UserError(Exception):
    """A mistake in the user's configuration or inputs.

    Raised with one message that names the option (or file), the bad value and what would be valid.
    The trainer's entry point prints the message and exits non-zero instead of showing a traceback.
    """
