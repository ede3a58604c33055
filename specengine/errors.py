"""One exception type for every user-facing error, so the CLI can print one clean line."""


class SpecEngineError(ValueError):
    """Bad input or a missing/unsupported resource, with a message that names the problem."""
