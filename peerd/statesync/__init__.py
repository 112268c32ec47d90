"""State sync for joining peers: snapshots advertised in the DHT, downloaded in chunks from several donors."""

from .advert import Advert
from .service import Fetched, StateSync, StateSyncError

__all__ = ["Advert", "Fetched", "StateSync", "StateSyncError"]
