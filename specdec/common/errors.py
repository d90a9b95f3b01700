"""Errors the core raises; the gRPC shells map each class to one status code.

Every message says what to change, so it can be shown to a client verbatim.
"""


class SpecDecError(Exception):
    """Base class of all errors the core raises on purpose."""


class InvalidRequestError(SpecDecError, ValueError):
    """A field of the request is invalid (→ INVALID_ARGUMENT). `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class SessionNotFoundError(SpecDecError, KeyError):
    """Unknown or expired session id (→ NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "session not found"


class StalePositionError(SpecDecError):
    """A call names a sequence position the session does not hold (→ FAILED_PRECONDITION)."""


class ContextOverflowError(SpecDecError):
    """Prompt plus draft would exceed the model's context (→ OUT_OF_RANGE)."""


class CapacityError(SpecDecError):
    """Out of session slots or queue space (→ RESOURCE_EXHAUSTED)."""


class ModelNotFoundError(SpecDecError, FileNotFoundError):
    """A model spec could not be resolved to local weights (→ NOT_FOUND / CLI error)."""
