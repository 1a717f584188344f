"""Connections: uvicorn's h11 protocol, plus a deadline for a request's headers.

uvicorn (0.54, h11) arms no timer when a connection opens: one that never sends a byte, or
sends half a request line and stalls, holds its socket and file descriptor for as long as the
client likes (its keep-alive timeout starts only once a response has been sent). Here every
connection must deliver a complete request head within `header_timeout_s` of opening, and of
each response it was sent; otherwise it is closed. The body has its own deadline
(`ServerLimits.body_timeout_s`, in routes).
Owns: `with_header_timeout`, the protocol class `nanoserve serve` (and the test harness) hand
to uvicorn. Refuses: anything about requests; it only watches when their heads arrive.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT_S = 10.0


class HeaderTimeoutProtocol(H11Protocol):
    """H11Protocol that closes a connection whose next request head is late."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._cycle_waited_for = self.cycle
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not self._cycle_waited_for:  # a request head arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._cycle_waited_for = self.cycle
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_is_late)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_is_late(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class to give uvicorn.Config(http=...) for this deadline."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})
