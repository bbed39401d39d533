"""One HTTP POST to a checked webhook target, connecting only to the addresses checked.

``http.client`` rather than requests: it follows no redirects, reads no proxy settings from
the environment (a proxy would connect to a host we never checked), and lets the connection
go to the checked IP while TLS still verifies the certificate for the URL's host name.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
from dataclasses import dataclass

from webhooks.ssrf import Target


class TransportError(Exception):
    """The request got no HTTP response (connection, TLS or timeout); worth retrying."""


@dataclass(frozen=True)
class Response:
    status: int
    retry_after: str | None  # the raw Retry-After header, when there is one


def post(target: Target, body: bytes, headers: dict[str, str], timeout_s: float) -> Response:
    """POST ``body``; the whole exchange (connect, send, response headers) is bounded by
    ``timeout_s``, so a receiver that trickles bytes cannot hold a delivery thread."""
    if target.scheme == "https":
        conn: http.client.HTTPConnection = _PinnedHTTPS(target, timeout_s)
    else:
        conn = _PinnedHTTP(target, timeout_s)
    expired = threading.Event()

    def abort() -> None:
        expired.set()
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(timeout_s, abort)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()
        if expired.is_set():  # the watchdog fired while connecting: its shutdown missed
            raise TimeoutError
        conn.request("POST", target.path, body=body, headers=headers)
        response = conn.getresponse()
        return Response(response.status, response.getheader("Retry-After"))
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            raise TransportError(f"timed out after {timeout_s:g}s") from None
        raise TransportError(f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
    finally:
        watchdog.cancel()
        conn.close()


def _connect(target: Target, timeout_s: float) -> socket.socket:
    """Connect to the first checked address that answers, never to a fresh DNS answer."""
    error: OSError = OSError(f"no address to connect to for {target.host}")
    for family, sockaddr in target.addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(sockaddr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error


class _PinnedHTTP(http.client.HTTPConnection):
    def __init__(self, target: Target, timeout_s: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout_s)
        self._target = target

    def connect(self) -> None:
        self.sock = _connect(self._target, self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(self, target: Target, timeout_s: float) -> None:
        self._tls = ssl.create_default_context()
        super().__init__(target.host, target.port, timeout=timeout_s, context=self._tls)
        self._target = target

    def connect(self) -> None:
        sock = _connect(self._target, self.timeout)
        try:
            self.sock = self._tls.wrap_socket(sock, server_hostname=self._target.host)
        except BaseException:
            sock.close()
            raise
