"""HOST:PORT parsing for flags: names, IPv4, and bracketed IPv6 literals."""

from __future__ import annotations

import ipaddress
import socket

from .wire.messages import unusable_ip


def parse_hostport(text: str, *, bare_port_host: str | None = None) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, or (when ``bare_port_host`` is given) just ``port``."""
    text = text.strip()
    if bare_port_host is not None and text.isdigit():
        host, port_text = bare_port_host, text
    elif text.startswith("["):
        end = text.find("]")
        if end < 0 or not text[end + 1 :].startswith(":"):
            raise ValueError(f"{text!r}: write IPv6 addresses as [ADDRESS]:PORT")
        host, port_text = text[1:end], text[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{text!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{text!r}: expected HOST:PORT")
        if ":" in host:
            raise ValueError(f"{text!r}: write IPv6 addresses in brackets, as [ADDRESS]:PORT")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: the port must be a number from 0 to 65535")
    return host, int(port_text)


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_ip(host: str) -> str:
    """A name or literal to one IP literal (announced addresses travel as raw IPs)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r}: {e.strerror}") from None
    return str(infos[0][4][0])


def family_of(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET


def peer_address(host: str, port: int) -> tuple[str, int]:
    """An address to announce to peers (``--announce``): resolved to one IP literal, and one that peers accept
    (never unspecified, broadcast or multicast, port 1..65535; PROTOCOL.md, addresses). Raises ValueError."""
    ip = resolve_ip(host)
    why = unusable_ip(ipaddress.ip_address(ip).packed)
    if why:
        raise ValueError(f"{format_hostport(ip, port)} is {why}: announce the address peers reach this node at")
    if not 1 <= port <= 65535:
        raise ValueError(f"{format_hostport(ip, port)}: announce a port from 1 to 65535")
    return ip, port
