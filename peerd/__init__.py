"""peerd: a daemon for decentralized deep-learning training."""

__version__ = "0.1.0"
