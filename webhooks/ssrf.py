"""Refuse webhook URLs that would make the fleet call into its own network (SSRF).

A webhook URL comes from a client, and the fleet POSTs to it from inside its network, so a
URL naming ``localhost``, a private address or the cloud metadata service would let a
client reach what only the fleet should. :func:`resolve` checks every address the host
resolves to and returns them, so the caller connects to exactly the addresses it checked:
a DNS answer that changes between check and connect (DNS rebinding) is never used.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud metadata services (AWS / GCP / Azure / OpenStack, AWS IPv6, Alibaba). Refused even
# when private addresses are allowed: nothing legitimate receives webhooks there.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)
NAT64_PREFIX = ipaddress.IPv6Network("64:ff9b::/96")


class UnsafeURLError(ValueError):
    """The URL may not receive webhooks; the message says why."""


class UnresolvableURLError(UnsafeURLError):
    """The host did not resolve. At delivery time this may pass, so it is retried."""


@dataclass(frozen=True)
class Target:
    """A checked URL: where to connect (only these addresses) and what to ask for."""

    scheme: str
    host: str
    port: int
    path: str  # path and query, as sent in the request line
    addresses: tuple[tuple[socket.AddressFamily, tuple], ...]  # (family, sockaddr)


def check_url(url: str, allow_private: bool) -> None:
    """Raise :class:`UnsafeURLError` unless ``url`` may receive webhooks."""
    resolve(url, allow_private)


def resolve(url: str, allow_private: bool) -> Target:
    """Parse ``url``, resolve its host anew, and check every address it resolves to."""
    scheme, host, port, path = _parse(url)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UnresolvableURLError(f"host {host!r} does not resolve: {exc}") from None
    addresses: list[tuple[socket.AddressFamily, tuple]] = []
    for family, _type, _proto, _name, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        reason = refusal(ipaddress.ip_address(sockaddr[0].split("%", 1)[0]), allow_private)
        if reason:
            raise UnsafeURLError(f"host {host!r} resolves to {sockaddr[0]}, {reason}")
        if (family, sockaddr) not in addresses:
            addresses.append((family, sockaddr))
    if not addresses:
        raise UnresolvableURLError(f"host {host!r} has no IPv4 or IPv6 address")
    return Target(scheme, host, port, path, tuple(addresses))


def refusal(address: IPAddress, allow_private: bool) -> str | None:
    """Why ``address`` may not receive webhooks, or None when it may."""
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        reason = refusal(embedded, allow_private)
        return f"which embeds {embedded}, {reason}" if reason else None
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if allow_private:
        return None
    for kind, flag in (
        ("a loopback", address.is_loopback),
        ("an unspecified", address.is_unspecified),
        ("a link-local", address.is_link_local),
        ("a multicast", address.is_multicast),
        ("a reserved", address.is_reserved),
        ("a private", address.is_private),
    ):
        if flag:
            return f"{kind} address"
    if not address.is_global:
        return "not a public address"
    return None


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for (mapped, 6to4, NAT64), which is what counts."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in NAT64_PREFIX:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _parse(url: str) -> tuple[str, str, int, str]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UnsafeURLError(f"not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise UnsafeURLError(f"scheme must be http or https, not {scheme or 'none'!r}")
    if not parts.hostname:
        raise UnsafeURLError("the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise UnsafeURLError("credentials in the URL are not supported")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return scheme, parts.hostname, port or (443 if scheme == "https" else 80), path
