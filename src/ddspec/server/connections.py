"""Connection limits below the app: a deadline for a request's headers, and a cap on open sockets.

uvicorn closes a keep-alive connection that stays idle after a response (``timeout_keep_alive``),
but waits forever for a connection that sends nothing, or half a request line and half its
headers: a few hundred such sockets use up the process's file descriptors and every endpoint,
/health too, stops answering. :func:`protocol_class` makes uvicorn's h11 protocol with

* a headers deadline: from the moment a connection opens (or its previous response ends) its
  next request's headers must be complete within ``header_timeout_s``, else the connection is
  closed (with a 408 when it had started a request). The body has its own deadline in the app
  (``read_body``), which can answer with a JSON error.
* a connection cap: past ``max_connections`` open sockets, a new connection closes the oldest
  one that is still waiting for its headers (an idle or stalled client, never a request being
  served); when every connection is busy, the new one gets a 503 and is closed. So a crowd of
  idle sockets cannot lock out a health check.
"""

from __future__ import annotations

import time

from uvicorn.protocols.http.h11_impl import H11Protocol

TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
               b"content-length: 49\r\n\r\nthe request's headers did not arrive in time: 408")
BUSY_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: 46\r\n\r\ntoo many open connections: retry in a moment")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a headers deadline and a connection cap (class attributes)."""

    header_timeout_s: float = 10.0
    max_connections: int = 256

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._header_timer = None
        self._waiting_since = time.monotonic()  # None while a request is being served
        self._got_bytes = False
        super().connection_made(transport)
        if len(self.connections) > self.max_connections and not self._make_room():
            transport.write(BUSY_503)
            transport.close()
            return
        self._arm()

    def _make_room(self) -> bool:
        """Close the oldest connection waiting for headers (not this one); False when none is."""
        waiting = [c for c in self.connections if c is not self and getattr(c, "_waiting_since", None) is not None]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c._waiting_since)
        oldest._close(timed_out=False)
        return True

    def _arm(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._close, True)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _close(self, timed_out: bool) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if timed_out and self._got_bytes:
            self.transport.write(TIMEOUT_408)
        self._waiting_since = None
        self.transport.close()

    def _serving(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        self._got_bytes = self._got_bytes or bool(data)
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # the next request's headers get their own deadline (uvicorn's keep-alive timer also runs)
        self._got_bytes = False
        self._track()

    def _track(self) -> None:
        if self._serving():
            self._disarm()
            self._waiting_since = None
        else:
            if self._waiting_since is None:
                self._waiting_since = time.monotonic()
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._waiting_since = None
        super().connection_lost(exc)


def protocol_class(header_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol subclass with these limits (uvicorn's ``http=`` takes the class)."""
    if header_timeout_s <= 0:
        raise ValueError(f"the headers timeout must be > 0 seconds, got {header_timeout_s}")
    if max_connections < 2:
        raise ValueError(f"max_connections must be >= 2, got {max_connections}")
    return type("DdspecH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": float(header_timeout_s), "max_connections": int(max_connections)})


def raise_file_limit() -> int:
    """Raise the soft limit on open files to the hard one (sockets are files); returns the soft limit."""
    try:
        import resource
    except ImportError:  # not on this platform
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 65536 if hard == resource.RLIM_INFINITY else hard
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
    return soft
