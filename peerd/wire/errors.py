"""The one exception type for bad input from the network."""

from __future__ import annotations


class WireError(ValueError):
    """A datagram or message that must be dropped.

    ``reason`` is the label the daemon counts the drop under
    (``peerd_datagrams_dropped_total{reason}``): one of ``malformed``, ``version``,
    ``auth``, ``replay``, ``identity``, ``type``.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
