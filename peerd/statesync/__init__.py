"""State sync for joining peers: snapshots advertised in the DHT, downloaded in chunks from several donors."""

from .service import Advert, Fetched, StateSync, StateSyncError

__all__ = ["Advert", "Fetched", "StateSync", "StateSyncError"]
