"""The local socket: length-prefixed msgpack frames between the daemon and local clients."""
