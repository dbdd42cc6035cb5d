"""Errors of the geotrain client: each carries the head's one-line message (what went wrong and the fix) and the
gRPC status code name; docs/api.md lists which call answers which code."""
import grpc


class GeotrainError(Exception):
    """A call failed; str(error) is the head's message, error.code the status code's name ("NOT_FOUND")."""

    def __init__(self, message, code="UNKNOWN"):
        super().__init__(message)
        self.message = message
        self.code = code


class InvalidArgumentError(GeotrainError):
    """A bad spec (an unknown key, a wrong type, a value out of range) or request."""


class NotFoundError(GeotrainError):
    """No such job."""


class FailedPreconditionError(GeotrainError):
    """The call does not fit the state of things: cancelling an ended job, planning with no alive workers or
    with no plan that fits."""


class UnauthenticatedError(GeotrainError):
    """No token, or the head refused it."""


class UnavailableError(GeotrainError):
    """The head cannot be reached (or is shutting down): try again, or check the address."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
}


def from_rpc_error(error, address):
    """The exception for a failed call to the head at `address`, worded as the CLI words it."""
    code = error.code()
    details = error.details() or str(code)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        message = (f"cannot reach the head at {address} ({details}); is it running? start it with "
                   f"`geotrain head start`, or pass head='HOST:PORT'")
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        message = f"the head at {address} refused the call: {details}"
    else:
        message = details
    return _BY_CODE.get(code, GeotrainError)(message, code.name)

