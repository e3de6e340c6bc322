"""Errors a client can act on: a gRPC status plus a message naming the field and what is allowed."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """Bad input or a refused request; servers turn it into the gRPC status `code` with `message`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def out_of_range(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.OUT_OF_RANGE, message)


def precondition(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.FAILED_PRECONDITION, message)


def check_session_id(session_id: str) -> str:
    """Session ids are 1-128 printable characters."""
    if not session_id:
        raise invalid("session_id is empty; send 1-128 printable characters")
    if len(session_id) > 128 or not session_id.isprintable():
        raise invalid(f"session_id must be 1-128 printable characters (got {len(session_id)} characters)")
    return session_id
