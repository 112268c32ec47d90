"""A donor's advertisement of a snapshot in the DHT (``peerd/state/<run id>``, subkey: its node id)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import msgpack

Address = tuple[str, int]  # a donor's address (an IP literal and a port)

MAX_STEP = 2**63 - 1


@dataclass(frozen=True)
class Advert:
    """One donor's advertisement, as read from the DHT."""

    node_id: bytes
    run_key: str
    layout: str
    step: int
    size: int
    sha: bytes
    addr: Address | None

    def encode(self) -> bytes:
        return msgpack.packb(
            {"run_key": self.run_key, "layout": self.layout, "step": self.step, "size": self.size,
             "sha": self.sha, "addr": list(self.addr) if self.addr else None},
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, node_id: bytes, value: bytes) -> Advert | None:
        """None for a value that is not a well-formed advertisement (a record is untrusted input)."""
        try:
            v = msgpack.unpackb(value, raw=False)
            addr = v["addr"]
            if addr is not None:
                host, port = addr
                ipaddress.ip_address(host)
                if type(port) is not int or not 1 <= port <= 65535:
                    return None
                addr = (host, port)
            ad = cls(node_id, v["run_key"], v["layout"], v["step"], v["size"], v["sha"], addr)
        except Exception:
            return None
        ok = (isinstance(ad.run_key, str) and isinstance(ad.layout, str) and type(ad.step) is int
              and -1 <= ad.step <= MAX_STEP and type(ad.size) is int and 0 <= ad.size <= MAX_STEP
              and isinstance(ad.sha, bytes) and len(ad.sha) == 32)
        return ad if ok else None


def ad_key(run: str) -> bytes:
    return f"peerd/state/{run}".encode()
