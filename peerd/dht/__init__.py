"""Kademlia DHT: sans-I/O core (routing, lookups, records) and its trio driver."""

from .core import DhtCore
from .lookup import Lookup
from .records import Record, RecordStore, location
from .routing import Contact, RoutingTable
from .service import BootstrapError, DhtService, PutResult

__all__ = [
    "BootstrapError",
    "Contact",
    "DhtCore",
    "DhtService",
    "Lookup",
    "PutResult",
    "Record",
    "RecordStore",
    "RoutingTable",
    "location",
]
