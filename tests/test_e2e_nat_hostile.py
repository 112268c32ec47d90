"""End to end, real daemons: a member that daemon A reached sends A unsolicited RELAYEDs naming daemon B as their
sender (junk inside, then its own PING under a fresh token). A keeps talking to B directly, nothing of A's goes
through the member, and A's DHT keeps B."""

from __future__ import annotations

import socket
import time

import pytest
import trio

from peerd.dht import DhtService
from peerd.metrics import Metrics
from peerd.tools.swarm import LocalSwarm
from peerd.transport import Endpoint
from peerd.transport.udp import UdpSocket
from peerd.wire import messages as m
from peerd.wire.identity import Identity, load_swarm_key

from .support.processes import wait_until

pytestmark = pytest.mark.e2e


def test_a_member_cannot_become_another_members_relay_hostile(swarm: LocalSwarm) -> None:
    a, b = swarm.start_many(2)
    a_id, b_id = bytes.fromhex(a.status["peer_id"]), bytes.fromhex(b.status["peer_id"])
    wait_until(lambda: b_id.hex() in a.call("status")["peers_known"], timeout=15, interval=0.2,
               what="A to have reached B")
    host, port = a.listen.rsplit(":", 1)
    a_addr = (host, int(port))
    secret = load_swarm_key(swarm.key_file)
    relays_from_a: list[bytes] = []

    async def attack() -> dict:
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        metrics = Metrics()
        mal = Endpoint(UdpSocket(udp), Identity.generate(), secret, metrics)
        dht = DhtService(mal, metrics)
        mal.on_message(m.MsgType.RELAY, lambda incoming: relays_from_a.append(incoming.peer.node_id))
        mal_hex = mal.identity.node_id.hex()
        async with trio.open_nursery() as nursery:
            await nursery.start(mal.serve)
            await nursery.start(dht.run)
            await dht.bootstrap([a_addr], timeout=10)  # A verifies the newcomer with a PING: A reached it

            async def status() -> dict:
                return await trio.to_thread.run_sync(a.call, "status")

            with trio.fail_after(10):
                while mal_hex not in (await status())["peers_known"]:
                    await trio.sleep(0.2)
            await mal.notify(a_addr, m.MsgType.RELAYED, {"src": b_id, "data": bytes(range(64))})
            sealer = mal._new_sealer()  # a token A has never seen bound
            ping = m.encode(m.MsgType.PING, {"rid": 12345, "from": mal._bindings[sealer.token]})
            await mal.notify(a_addr, m.MsgType.RELAYED, {"src": b_id, "data": sealer.seal(m.MsgType.PING, ping, a_id)})
            await trio.sleep(0.5)
            # A's traffic to B: a record A stores (on B, the only other daemon), and A's own checks
            await trio.to_thread.run_sync(lambda: a.call("dht_put", key="nat/hostile", value="x"))
            await trio.sleep(2.5)
            out = await status()
            nursery.cancel_scope.cancel()
        return out

    start = time.monotonic()
    status = trio.run(attack)
    assert status["paths"].get(b_id.hex()) is None, status["paths"]  # (old: "relayed", through the member)
    assert status["path_datagrams"].get("relayed", 0) == 0
    assert status["datagrams_dropped"].get("identity", 0) >= 1
    assert relays_from_a == []  # nothing of A's went through the member
    assert b_id.hex() in status["peers_known"] and status["peers"] >= 2
    assert len(b.call("dht_get", key="nat/hostile")["values"]) == 1  # A's STORE reached B
    assert time.monotonic() - start < 20
