"""One exception type for every user-facing error, so the CLI can print one clean line."""
from __future__ import annotations


class SpecEngineError(ValueError):
    """Bad input or a missing/unsupported resource, with a message that names the problem.

    `param` names the call argument at fault when there is one (the server's 400 reports it).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickles with its param (a replica's refusal reaches another process's 400)
        return type(self), (str(self), self.param)
