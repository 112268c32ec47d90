"""Moshpit nodes for hostile tests: one node, a group formed of them."""

from __future__ import annotations

import random
from dataclasses import fields
from types import SimpleNamespace

import numpy as np

from peerd.allreduce.options import DEFAULT_OPTIONS, AverageOptions
from peerd.moshpit.matchmaking import Candidate, Group
from peerd.moshpit.service import (
    MoshpitService,
)
from peerd.transport.endpoint import Endpoint
from peerd.wire.identity import Identity

from .dht_swarm import SECRET, DhtNode
from .memnet import MemNet, MemSocket


def node(net: MemNet, index: int, *, sock: MemSocket | None = None, allreduce=None) -> SimpleNamespace:
    """A DHT node (tests/test_dht_network.DhtNode) with a MoshpitService on top."""
    n = DhtNode(net, index)
    if sock is not None:
        net.sockets[n.addr] = sock
        n.sock = sock
        n.endpoint = Endpoint(sock, n.identity, SECRET, n.metrics)
        n.dht = type(n.dht)(n.endpoint, n.metrics, rng=random.Random(index), refresh_interval=30.0)
    n.moshpit = MoshpitService(n.endpoint, n.dht, allreduce or SimpleNamespace(), n.metrics, address=n.addr,
                               rng=random.Random(index))
    return n


def _group(a) -> Group:
    other = Identity.generate()
    members = (Candidate(1.0, a.identity.node_id, a.identity.public_key, a.addr),
               Candidate(1.0, other.node_id, other.public_key, ("127.0.0.1", 7)))
    return Group(77, members, 0, a.identity.node_id)


def asked_options(options: AverageOptions, center: np.ndarray | None) -> dict:
    """What the averager was asked for, as keywords: the deadlines, and every other option the caller set."""
    asked = {"floor_s": options.floor_s, "max_phase_s": options.max_phase_s}
    for f in fields(options):
        value = getattr(options, f.name)
        if f.name not in asked and value != getattr(DEFAULT_OPTIONS, f.name):
            asked[f.name] = value
    if center is not None:
        asked["center"] = center
    return asked
