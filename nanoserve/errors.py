"""The exceptions nanoserve raises on purpose, shared by every module.

Owns: one small hierarchy under `NanoserveError`, so callers (the CLI, the server) can tell
"the user asked for something wrong" apart from a bug. Refuses: any behaviour beyond
carrying a message; mapping errors to exit codes or HTTP statuses is the caller's job.
"""


class NanoserveError(Exception):
    """Base class of every error nanoserve raises deliberately."""


class ModelNotFoundError(NanoserveError):
    """A model path or the default model is missing or unreadable; the message says the fix."""


class UnsupportedModelError(NanoserveError):
    """The model exists but uses an architecture, tokenizer or feature nanoserve cannot run."""


class InvalidRequestError(NanoserveError, ValueError):
    """A request field is invalid; `param` names the offending field (e.g. "temperature")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
