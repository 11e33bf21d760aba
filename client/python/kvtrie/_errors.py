"""Errors of the kvtrie package: a failed call raises :class:`Error` with the gRPC status code.

The server's messages start with the field at fault (``model.head_dim: namespace '' stores model
'stories260K' with head_dim=8, request has 16``); so do the client's own argument checks
(``v.shape: (5, 4, 31, 8) differs from k.shape (5, 4, 32, 8) (axis 2, tokens)``).

The errors a caller acts on rather than shows carry a machine-readable ``reason`` (the server's
``google.rpc.ErrorInfo`` detail, client/status_reason.h): match on it, never on the message text.
"""

from __future__ import annotations

import enum
import re

__all__ = ["StatusCode", "Error", "InvalidArgumentError", "NotFoundError", "from_status",
           "STALE_PREDICTOR_VERSION"]

#: ``Error.reason`` of a Put encoded against a learned predictor state version the server no
#: longer keeps (FAILED_PRECONDITION): fetch the latest state and encode again.
STALE_PREDICTOR_VERSION = "STALE_PREDICTOR_VERSION"


class StatusCode(enum.IntEnum):
    """gRPC status codes (the values of ``grpc::StatusCode`` and ``absl::StatusCode``)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): ")


class Error(Exception):
    """A kvtrie call failed.

    Attributes:
        code: the gRPC status code (:class:`StatusCode`), e.g. ``StatusCode.INVALID_ARGUMENT``
            for a shape, dtype or token-count mismatch, ``UNAVAILABLE`` when the server is down,
            ``DATA_LOSS`` for a stored block that failed its checksum.
        message: the server's (or the client's) message, starting with the field at fault.
        reason: the server's machine-readable reason (``google.rpc.ErrorInfo.reason``, e.g.
            :data:`STALE_PREDICTOR_VERSION`), ``""`` when it gave none.
    """

    def __init__(self, code: int, message: str, reason: str = "") -> None:
        try:
            self.code = StatusCode(code)
        except ValueError:
            self.code = StatusCode.UNKNOWN
        self.message = message
        self.reason = reason
        super().__init__(f"{self.code.name}: {message}")

    @property
    def stale_predictor_version(self) -> bool:
        """True when a Put was encoded against a predictor state version the server freed."""
        return (self.code == StatusCode.FAILED_PRECONDITION
                and self.reason == STALE_PREDICTOR_VERSION)

    @property
    def field(self) -> str | None:
        """The field the message names first (``"model.head_dim"``, ``"k.dtype"``), if any."""
        m = _FIELD.match(self.message)
        return m.group(1) if m else None


class InvalidArgumentError(Error, ValueError):
    """INVALID_ARGUMENT: a request that does not fit (shape, dtype, token count, model spec)."""


class NotFoundError(Error, LookupError):
    """NOT_FOUND: a prefix, node or model that is not stored."""


def from_status(code: int, message: str, reason: str = "") -> Error:
    """The exception for a non-OK status (used by the C++ extension)."""
    if code == StatusCode.INVALID_ARGUMENT:
        return InvalidArgumentError(code, message, reason)
    if code == StatusCode.NOT_FOUND:
        return NotFoundError(code, message, reason)
    return Error(code, message, reason)
