"""Tooling around the daemon (fault injectors, benches, labs): nothing in the daemon's own packages imports it."""
