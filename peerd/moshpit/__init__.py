"""Moshpit averaging: grid keys, matchmaking through the DHT, the round scheduler."""

from .keys import Grid, KeyManager
from .matchmaking import Candidate, Group, Matchmaker

__all__ = ["Candidate", "Grid", "Group", "KeyManager", "Matchmaker"]
