"""The hostile side of `peerd bench soak`: one member attacker (holds the swarm key, many identities) and one
outsider (no key), in their own process so their CPU and GIL do not skew the bench's own measurements.

Run as ``python -m peerd.tools.bench.soak_attack CONFIG_JSON``. It sends exactly ``datagrams`` datagrams (a bounded
loop), only to the daemons' 127.0.0.1 addresses named in the config, round-robin over the attack classes:
a steady phase at ``rate`` datagrams/s, then a burst as fast as it can, then a steady tail. It also answers
the daemons' DHT requests to one of its identities (FIND_VALUE with ``total`` = 65535 pages). Every
``PROGRESS_S`` it prints one JSON line on stdout ({"sent", "by_class", "phase"}); the last has "done": true.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import random
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np

from ...allreduce.arctopk import phase_group_id
from ...allreduce.frames import HEADER as BODY_HEADER
from ...allreduce.frames import BodyType
from ...dht.records import Record
from ...statesync.advert import Advert, ad_key
from ...trainer.records import OuterRecord, record_key
from ...wire import messages as m
from ...wire.envelope import FLAG_SEALED, HEADER, MAGIC, VERSION
from ...wire.errors import WireError
from ...wire.identity import Identity, load_swarm_key, node_id_of
from ...wire.seal import Opener, Sealer
from .soak_probe import opener_for, seal_for

PROGRESS_S = 0.5
IDENTITIES = 64  # member identities the attacker signs and seals with
FLOOD_PER_STORE = 5  # records in one flood STORE (fits a 1200-byte datagram)
BURST_CHUNK = 256  # datagrams sent between two looks at the clock in the burst
MEMBER_CLASSES = ("mm_join_bad_addr", "progress_far_ahead", "dht_store_flood", "state_advert_huge",
                  "report_throttle", "held_data", "slot_squat", "nonfinite_data", "huge_weight", "find_value_pages",
                  "replay", "cross_receiver_replay", "relay_hijack", "connect_reflect", "relay_starve",
                  "outer_forgery", "outer_stall", "weight_inflation", "topk_selection_poison", "token_squat",
                  "snapshot_poison")
OUTSIDER_CLASSES = ("random", "mutated", "wrong_key", "random_token")
# the outsider-only phase of the bench (its daemon CPU per datagram): no key, so none of these can be opened
OUTSIDER_CPU_CLASSES = ("random_token", "random", "mutated", "wrong_key")
CONTROL_TYPES = (0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x10, 0x11, 0x12, 0x18)
CLASSES = MEMBER_CLASSES + OUTSIDER_CLASSES
# FIND_VALUE's records the asker holds already, and VALUE's bitmap of those the responder has (PROTOCOL.md 8.4),
# where this checkout's wire has them
FIND_VALUE_EXTRA: dict[str, Any] = {"held": []} if "held" in m.SCHEMAS[m.MsgType.FIND_VALUE] else {}
VALUE_EXTRA: dict[str, Any] = {"have": b""} if "have" in m.SCHEMAS[m.MsgType.VALUE] else {}
Target = tuple[str, int]


class _Member:
    """One attacker identity with its own sealing token (bound to it by the ``from`` of its control bodies)."""

    def __init__(self, secret: bytes, ident: Identity | None = None) -> None:
        self.ident = ident or Identity.generate()
        binding = self.ident.bind_token()
        self.sealer = Sealer(secret, binding.token)
        self.frm: dict[str, Any] = binding.sender()

    def body(self, mtype: m.MsgType, fields: dict[str, Any], frm: dict[str, Any] | None = None) -> bytes:
        """Encoded without the encoder's validation: these bodies are meant to be refused."""
        return m.encode(mtype, {"rid": random.getrandbits(64), "from": frm or self.frm, **fields}, check=False)

    def record(self, key: bytes, subkey: bytes, value: bytes, ttl: float = 600.0) -> list:
        now = time.monotonic()
        return Record.create(self.ident, key, subkey, value, ttl, wall=time.time(), now=now).to_wire(now)


class Attack:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.get("seed", 0))
        self.targets: list[Target] = [(h, int(p)) for h, p in cfg["targets"]]
        for host, _ in self.targets:  # never anything but loopback
            if not ipaddress.ip_address(host).is_loopback:
                raise ValueError(f"refusing to attack {host}: the soak only sends to 127.0.0.1")
        self.secret = load_swarm_key(cfg["key_file"])
        self.run_id: str = cfg["run"]
        self.victims = [bytes.fromhex(v) for v in cfg["victims"]]
        self.round0: int = int(cfg.get("round", 0))
        self.group_key: str = cfg.get("group_key", "")
        self.sent = dict.fromkeys(CLASSES, 0)
        self.answered = 0
        self.phase = "setup"
        self.stop = threading.Event()
        self.msock = _udp()  # the member attacker's flood socket
        self.rsock = _udp()  # its DHT responder (one identity, answers the daemons' requests)
        self.osock = _udp()  # the outsider
        self.xsock = _udp()  # the on-path replayer of cross_receiver_replay (its own source: its own ration)
        self.xanswers = 0  # datagrams that came back to it (must stay 0)
        self.csock = _udp()  # where connect_reflect's CONNECTs say the peer is: what a daemon punches there counts
        self.reflected = 0  # datagrams that arrived there (must stay 0)
        self.members = [_Member(self.secret) for _ in range(max(1, int(cfg.get("identities", IDENTITIES))))]
        self.responder = _Member(self.secret)
        # the responder's identity under a token of its own (the responder thread seals with the other): a member
        # the daemons reached, so its RELAYEDs and CONNECTs get past the "reached" check to the real ones
        self.relayer = _Member(self.secret, self.responder.ident)
        self.wrong = [_Member(os.urandom(32)) for _ in range(4)]
        self.captured: list[bytes] = []  # datagrams seen (own sealed ones, and what daemons sent us): to mutate
        self.last_sealed: dict[int, list[bytes]] = {}  # per target: a datagram is sealed for its receiver
        self._to = 0  # the target the datagram being built is for
        self._builders: dict[str, Callable[[], tuple[socket.socket, bytes]]] = {
            c: getattr(self, f"_b_{c}") for c in CLASSES
        }
        self._prepare()
        if not set(cfg.get("classes") or CLASSES) & set(MEMBER_CLASSES):
            # outsider only: nothing member-sealed is sent, so give `mutated` sealed datagrams to flip bits in
            # (sealed here, never sent: as if captured on the path)
            for to in range(len(self.targets)):
                self._to = to
                for mb, body in self.report_bodies[:32]:
                    self._seal(mb, m.MsgType.REPORT, body)
            self._to = 0

    # -- pools of bodies, signed once (an Ed25519 signature costs ~50 us: not per datagram) ---------------
    def _prepare(self) -> None:
        rng, run = self.rng, self.run_id
        n = int(self.cfg["datagrams"])
        self.join_bodies = []
        for i in range(16):
            mb = self.members[i % len(self.members)]
            # IPv6 to an IPv4 node, the limited broadcast (also IPv4-mapped), unspecified ("this host"). No
            # multicast: a daemon without the fix would send there, and that may leave the machine.
            bad = [[b"\0" * 15 + b"\1", 4000 + i], [b"\xff" * 4, 4000 + i], [b"\0" * 4, 9],
                   [b"\0" * 10 + b"\xff" * 6, 4000 + i]][i % 4]
            frm = {**mb.frm, "addr": bad}
            fields = {"run": run, "round": self.round0 + i % 3, "key": self.group_key, "expiry": time.time() + 30}
            self.join_bodies.append((mb, mb.body(m.MsgType.MM_JOIN, fields, frm)))
        self.progress_bodies = []
        for i in range(max(4, len(self.members))):
            mb = self.members[i % len(self.members)]
            value = msgpack.packb([2**32 - 2, 2**32 - 3, 2**31, self.round0 + 5000][i % 4])
            rec = mb.record(f"{run}/progress".encode(), mb.ident.node_id, value)
            self.progress_bodies.append((mb, mb.body(m.MsgType.STORE, {"records": [rec]})))
        distinct = max(1, min(n // len(CLASSES) // max(1, len(self.targets)), int(self.cfg.get("flood_stores", 4000))))
        self.flood_bodies = []
        for i in range(distinct):
            mb = self.members[i % len(self.members)]
            recs = [mb.record(b"flood/" + rng.randbytes(12).hex().encode(), b"", rng.randbytes(24))
                    for _ in range(FLOOD_PER_STORE)]
            self.flood_bodies.append((mb, mb.body(m.MsgType.STORE, {"records": recs})))
        self.advert_bodies = []
        for i in range(16):
            mb = self.members[i % len(self.members)]
            size = [2**33, 2**63 - 1, 2**40, 10**15][i % 4]
            ad = Advert(mb.ident.node_id, f"{run}/layout", "layout", 10**9, size, rng.randbytes(32),
                        ("127.0.0.1", self.rsock.getsockname()[1]))
            rec = mb.record(ad_key(run), mb.ident.node_id.hex().encode(), ad.encode())
            self.advert_bodies.append((mb, mb.body(m.MsgType.STORE, {"records": [rec]})))
        # DiLoCo outer rounds: a forged claim on shard 0 of a group (its own bytes' hash, a final, an address
        # that is no IP literal, or under a victim's subkey), and records that never publish a final
        run_key = f"{run}/{'0' * 16}"
        self.forgery_bodies, self.stall_bodies = [], []
        for i in range(16):
            mb = self.members[i % len(self.members)]
            key = record_key(run_key, self.round0 + i % 4)
            addr = [("example.com", 80), ("127.0.0.1", 0), ("0.0.0.0", 9), ("127.0.0.1", 9)][i % 4]
            forged = OuterRecord(mb.ident.node_id, self.group_key[:16] or "0000beef", 4, 0, rng.randbytes(32),
                                 rng.randbytes(32), rng.randbytes(32), b"", 1 << 20, addr)  # type: ignore[arg-type]
            subkey = (self.victims[i % len(self.victims)] if i % 2 and self.victims else mb.ident.node_id).hex()
            self.forgery_bodies.append((mb, mb.body(m.MsgType.STORE, {"records": [
                mb.record(key, subkey.encode(), forged.encode())]})))
            stall = replace(forged, index=i % 4, final=b"", addr=("127.0.0.1", 9))
            self.stall_bodies.append((mb, mb.body(m.MsgType.STORE, {"records": [
                mb.record(key, mb.ident.node_id.hex().encode(), stall.encode())]})))
        self.squat_bodies = []
        keys = [f"{run}/progress".encode(), ad_key(run)] + [
            f"{run}/{r}/{self.group_key}".encode() for r in range(self.round0, self.round0 + 40)]
        for j, key in enumerate(keys):
            for k, victim in enumerate(self.victims):
                mb = self.members[(j + k) % len(self.members)]
                subkey = victim if (j + k) % 2 else victim.hex().encode()
                value = msgpack.packb([time.time() + 5, b"\x7f\0\0\1", 9]) if j > 1 else msgpack.packb(2**32 - 2)
                self.squat_bodies.append((mb, mb.body(m.MsgType.STORE, {"records": [mb.record(key, subkey, value)]})))
        self.report_bodies = []
        for i in range(64):
            mb = self.members[i % len(self.members)]
            group = rng.getrandbits(32) if i % 2 else i  # random ids, and the small ones
            fields = {"group": group, "phase": i % 2, "expected": 100_000, "received": 1, "bytes": 1200,
                      "seconds": 0.05, "kernel_drops": 0, "position": 100_000 + i, "arrived": 0.0}
            self.report_bodies.append((mb, mb.body(m.MsgType.REPORT, fields)))
        self.value_bodies = []
        for i in range(16):
            mb = self.members[i % len(self.members)]
            key = f"{run}/progress".encode() if i % 2 else f"{run}/{self.round0}/{self.group_key}".encode()
            rec = mb.record(key, f"pg{i:04d}".encode(), b"x")
            self.value_bodies.append((mb, mb.body(m.MsgType.VALUE, {"records": [rec], "total": 65535, "nodes": [],
                                                                    **VALUE_EXTRA})))
        count = 275  # 1100 bytes of values
        self.data_values = {
            "held_data": np.asarray(rng.random(), dtype="<f4").repeat(count).tobytes(),
            "nonfinite_data": np.array([np.nan, np.inf, -np.inf, 1.0] * (count // 4 + 1), "<f4")[:count].tobytes(),
            "huge_weight": np.full(count, 1e30, "<f4").tobytes(),
            # a sign-flipped gradient of ordinary size, sent under a believable but inflated weight (2**24 samples)
            "weight_inflation": (-rng.random() * np.ones(count)).astype("<f4").tobytes(),
            # finite 24-bit words where arc-topk's non-owners send NaN: blended in, they would spoil a selection
            "topk_selection_poison": np.asarray([rng.randrange(1 << 24) for _ in range(count)], "<f4").tobytes(),
        }
        self.big_held = np.zeros(16000, "<f4").tobytes()  # a 64 KB body
        # requests sealed for one daemon and replayed to the others: valid bodies, so only the seal refuses them
        # (a join of a run no daemon has: the one copy that does open, at its receiver, matches nobody)
        self.xr_bodies = []
        for i in range(16):
            mb = self.members[i % len(self.members)]
            mtype, fields = [
                (m.MsgType.FIND_NODE, {"target": rng.randbytes(32)}),
                (m.MsgType.FIND_VALUE, {"key": b"xr/" + rng.randbytes(8).hex().encode(), "offset": 0,
                                        **FIND_VALUE_EXTRA}),
                (m.MsgType.STATE_GET, {"run": b"xr", "sha": rng.randbytes(32), "offset": 0, "length": 1024}),
                (m.MsgType.MM_JOIN, {"run": f"{run}-xr", "round": 0, "key": "xr", "expiry": time.time() + 30}),
            ][i % 4]
            self.xr_bodies.append((mb, mtype, mb.body(mtype, fields)))
        # token_squat: a member presents a binding of its own for a token of an identity that has not spoken to the
        # daemon yet (as it would for a member's new token, seen in a header elsewhere); the token is derived from
        # its owner's key, so every one is refused (``identity``). Few tokens: no churn of the token tables.
        self.squats: list[tuple[Sealer, bytes]] = []
        for i in range(16):
            owner = Identity.generate().bind_token(rng)
            mb = self.members[i % len(self.members)]
            frm = {"pk": mb.ident.public_key, "sig": owner.nonce + mb.ident.sign_token(owner.token), "addr": None}
            self.squats.append((Sealer(self.secret, owner.token), mb.body(m.MsgType.PING, {}, frm)))
        # snapshot_poison: state adverts of plausible size at far-ahead and implausible steps (2**62), whose bytes
        # (served by the responder) are NaN; no trainer may take them over (statesync ranking, peerd.torch.snapcheck)
        self.poison = np.full(1024, np.nan, "<f4").tobytes()
        self.poison_sha = hashlib.sha256(self.poison).digest()
        self.poison_key = f"{run}/poison"
        self.poison_bodies = []
        for i in range(16):
            mb = self.members[i % len(self.members)]
            step = [2**62, 10**6, 9_999, 2**63 - 1][i % 4]
            ad = Advert(mb.ident.node_id, self.poison_key, "p" * 64, step, len(self.poison), self.poison_sha,
                        ("127.0.0.1", self.rsock.getsockname()[1]))
            rec = mb.record(ad_key(run), mb.ident.node_id.hex().encode(), ad.encode())
            self.poison_bodies.append((mb, mb.body(m.MsgType.STORE, {"records": [rec]})))

        # relay_hijack: RELAYEDs naming another daemon as src, with junk or a fresh-token PING of a minted identity
        self.hijack_inner = [_Member(self.secret) for _ in range(16)]
        # relay_starve: RELAYs from minted identities (and the reached one) to another daemon, near MTU-sized
        self.starve_data = rng.randbytes(1000)

    def _other(self) -> bytes:
        """Another daemon's node id than this datagram's target (itself when there is only one)."""
        return self.victims[(self._to + 1) % len(self.victims)]

    # -- one datagram per call -------------------------------------------------------------------------------
    def _seal(self, mb: _Member, mtype: int, body: bytes) -> bytes:
        d = seal_for(mb.sealer, mtype, body, self.victims[self._to])
        kept = self.last_sealed.setdefault(self._to, [])
        if len(kept) < 256:
            kept.append(d)
        else:
            kept[self.rng.randrange(256)] = d
        return d

    def _pick(self, pool: list[tuple[_Member, bytes]], mtype: m.MsgType) -> tuple[socket.socket, bytes]:
        mb, body = pool[self.rng.randrange(len(pool))]
        return self.msock, self._seal(mb, mtype, body)

    def _b_mm_join_bad_addr(self) -> tuple[socket.socket, bytes]:
        return self._pick(self.join_bodies, m.MsgType.MM_JOIN)

    def _b_progress_far_ahead(self) -> tuple[socket.socket, bytes]:
        return self._pick(self.progress_bodies, m.MsgType.STORE)

    def _b_dht_store_flood(self) -> tuple[socket.socket, bytes]:
        self._flood_i = (getattr(self, "_flood_i", -1) + 1) % len(self.flood_bodies)
        mb, body = self.flood_bodies[self._flood_i]
        return self.msock, self._seal(mb, m.MsgType.STORE, body)

    def _b_state_advert_huge(self) -> tuple[socket.socket, bytes]:
        return self._pick(self.advert_bodies, m.MsgType.STORE)

    def _b_report_throttle(self) -> tuple[socket.socket, bytes]:
        return self._pick(self.report_bodies, m.MsgType.REPORT)

    def _data(self, kind: str, weight: float, big: bool = False, phase: int = 0) -> tuple[socket.socket, bytes]:
        mb = self.members[self.rng.randrange(len(self.members))]
        group = self.rng.getrandbits(32) if self.rng.random() < 0.9 else self.rng.randrange(16)
        group = phase_group_id(group, phase) if phase else group
        values = self.big_held if big else self.data_values[kind]
        count = len(values) // 4
        header = BODY_HEADER.pack(group, 0, 1 << 20, self.rng.randrange((1 << 20) - count), count, weight)
        return self.msock, self._seal(mb, int(BodyType.RS_DATA), header + values)

    def _b_held_data(self) -> tuple[socket.socket, bytes]:
        # 64 KB bodies (finding 6) in the steady phases; the burst sends MTU-sized ones, for its rate
        return self._data("held_data", 1.0, big=self.phase != "burst" and self.rng.random() < 0.1)

    def _b_nonfinite_data(self) -> tuple[socket.socket, bytes]:
        return self._data("nonfinite_data", [1.0, float("nan"), float("inf")][self.rng.randrange(3)])

    def _b_huge_weight(self) -> tuple[socket.socket, bytes]:
        return self._data("huge_weight", 3.0e38)

    def _b_weight_inflation(self) -> tuple[socket.socket, bytes]:
        return self._data("weight_inflation", float(2**24))

    def _b_topk_selection_poison(self) -> tuple[socket.socket, bytes]:
        return self._data("topk_selection_poison", 1.0, phase=1)  # arc-topk's selection phase

    def _b_slot_squat(self) -> tuple[socket.socket, bytes]:
        return self._pick(self.squat_bodies, m.MsgType.STORE)

    def _b_outer_forgery(self) -> tuple[socket.socket, bytes]:
        return self._pick(self.forgery_bodies, m.MsgType.STORE)

    def _b_outer_stall(self) -> tuple[socket.socket, bytes]:
        return self._pick(self.stall_bodies, m.MsgType.STORE)

    def _b_find_value_pages(self) -> tuple[socket.socket, bytes]:
        return self._pick(self.value_bodies, m.MsgType.VALUE)  # unsolicited; answers go from the responder

    def _b_replay(self) -> tuple[socket.socket, bytes]:
        kept = self.last_sealed.get(self._to)
        if not kept:
            return self._b_report_throttle()
        return self.msock, kept[self.rng.randrange(len(kept))]

    def _b_cross_receiver_replay(self) -> tuple[socket.socket, bytes]:
        """Sealed for daemon B (this datagram's target) and, as an on-path outsider would, the same bytes sent to
        every other daemon, which must drop them (``auth``: their node id is not in the associated data); the
        returned copy goes to B a second time (``replay``). Nothing may come back for the copies."""
        mb, mtype, body = self.xr_bodies[self.rng.randrange(len(self.xr_bodies))]
        data = seal_for(mb.sealer, mtype, body, self.victims[self._to])
        self._send(self.msock, data, self.targets[self._to], "cross_receiver_replay")  # the original, to B
        for j, target in enumerate(self.targets):
            if j != self._to:
                self._send(self.xsock, data, target, "cross_receiver_replay")
        return self.xsock, data

    def _b_relay_hijack(self) -> tuple[socket.socket, bytes]:
        """A RELAYED naming another daemon as ``src``: junk inside, or the attacker's own PING under a fresh token.
        A daemon must not make the attacker that daemon's relay, nor learn its address from the PING."""
        if self.rng.random() < 0.5:
            data = self.rng.randbytes(self.rng.randrange(21, 200))
        else:
            mb = self.hijack_inner[self.rng.randrange(len(self.hijack_inner))]
            data = seal_for(mb.sealer, m.MsgType.PING, mb.body(m.MsgType.PING, {}), self.victims[self._to])
        body = self.relayer.body(m.MsgType.RELAYED, {"src": self._other(), "data": data})
        return self.rsock, seal_for(self.relayer.sealer, m.MsgType.RELAYED, body, self.victims[self._to])

    def _b_connect_reflect(self) -> tuple[socket.socket, bytes]:
        """A CONNECT naming a peer the DHT never named, at a reflection target (``csock``): no PING may go there."""
        host, port = self.csock.getsockname()[:2]
        peer = m.pack_contact(self.rng.randbytes(32), host, port)
        body = self.relayer.body(m.MsgType.CONNECT, {"peer": peer})
        return self.rsock, seal_for(self.relayer.sealer, m.MsgType.CONNECT, body, self.victims[self._to])

    def _b_relay_starve(self) -> tuple[socket.socket, bytes]:
        """RELAYs to another daemon from minted identities (and the reached one), to use up a relay's budget."""
        if self.rng.random() < 0.5:
            mb, sock = self.relayer, self.rsock
        else:
            mb, sock = self.members[self.rng.randrange(len(self.members))], self.msock
        body = mb.body(m.MsgType.RELAY, {"to": self._other(), "data": self.starve_data})
        return sock, seal_for(mb.sealer, m.MsgType.RELAY, body, self.victims[self._to])

    def _b_token_squat(self) -> tuple[socket.socket, bytes]:
        sealer, body = self.squats[self.rng.randrange(len(self.squats))]
        return self.msock, seal_for(sealer, m.MsgType.PING, body, self.victims[self._to])

    def _b_snapshot_poison(self) -> tuple[socket.socket, bytes]:
        return self._pick(self.poison_bodies, m.MsgType.STORE)

    def _b_random_token(self) -> tuple[socket.socket, bytes]:
        """A well-formed sealed control header under a random token and sequence, then random bytes: only the
        AEAD (a key derivation per new token) can refuse it, which the daemons ration (``auth_limited``)."""
        header = HEADER.pack(MAGIC, VERSION, self.rng.choice(CONTROL_TYPES), FLAG_SEALED, self.rng.getrandbits(64),
                             self.rng.getrandbits(64))
        return self.osock, header + self.rng.randbytes(self.rng.randrange(16, 1164))

    def _b_random(self) -> tuple[socket.socket, bytes]:
        size = self.rng.randrange(1, 1201)
        data = self.rng.randbytes(size)
        if self.rng.random() < 0.5 and size > 21:  # a plausible header: magic, version, a known type, sealed
            data = struct.pack("!2sBBB", b"PD", VERSION, self.rng.choice([1, 3, 5, 7, 0x10, 0x11, 0x40]), 1) + data[5:]
        return self.osock, data

    def _b_mutated(self) -> tuple[socket.socket, bytes]:
        pool = self.captured if self.captured and self.rng.random() < 0.5 else self.last_sealed.get(self._to)
        if not pool:
            return self._b_random()
        data = bytearray(pool[self.rng.randrange(len(pool))])
        for _ in range(self.rng.randrange(1, 4)):
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        if self.rng.random() < 0.2:
            data = data[: self.rng.randrange(1, len(data))]
        return self.osock, bytes(data)

    def _b_wrong_key(self) -> tuple[socket.socket, bytes]:
        mb = self.wrong[self.rng.randrange(len(self.wrong))]
        kind = self.rng.randrange(3)
        to = self.victims[self._to]
        if kind == 0:
            return self.osock, seal_for(mb.sealer, m.MsgType.PING, mb.body(m.MsgType.PING, {}), to)
        if kind == 1:
            return self.osock, seal_for(mb.sealer, m.MsgType.REPORT, self.report_bodies[0][1], to)
        body = BODY_HEADER.pack(1, 0, 8, 0, 1, 1.0) + b"\0" * 4
        return self.osock, seal_for(mb.sealer, int(BodyType.RS_DATA), body, to)

    # -- the responder: answers the daemons' requests to its identity, FIND_VALUE with 65535 pages ----------
    def _serve(self) -> None:
        opener = opener_for(self.secret, self.responder.ident.node_id)
        sel = selectors.DefaultSelector()
        for s in (self.rsock, self.msock, self.osock, self.xsock, self.csock):
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        r = self.responder
        next_ping = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_ping:  # stay in the daemons' routing tables, so their lookups ask us
                next_ping = now + 1.0
                for t, to in zip(self.targets, self.victims, strict=True):
                    self._send(self.rsock, seal_for(r.sealer, m.MsgType.PING, r.body(m.MsgType.PING, {}), to), t,
                               "find_value_pages")
            for key, _ in sel.select(0.1):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                for _ in range(256):
                    try:
                        data, source = sock.recvfrom(65535)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        break
                    if sock is self.xsock:
                        self.xanswers += 1
                        continue
                    if sock is self.csock:
                        self.reflected += 1
                        continue
                    if len(self.captured) < 512:
                        self.captured.append(data)
                    if sock is self.rsock and source in self.targets:
                        self._answer(opener, data, source)
        sel.close()

    def _answer(self, opener: Opener, data: bytes, source: Target) -> None:
        try:
            header, body, _ = opener.open(data)
            if header.type > m.CONTROL_MAX:
                return
            mtype = m.msg_type(header.type)
            fields = m.decode(mtype, body)
        except WireError:
            return
        r = self.responder
        reply: tuple[m.MsgType, dict[str, Any]] | None = None
        if mtype is m.MsgType.PING:
            reply = (m.MsgType.PONG, {})
        elif mtype is m.MsgType.FIND_NODE:
            reply = (m.MsgType.NODES, {"nodes": []})
        elif mtype is m.MsgType.STORE:
            reply = (m.MsgType.STORED, {"ok": [True] * len(fields["records"])})
        elif mtype is m.MsgType.FIND_VALUE:
            offset = fields["offset"]
            rec = r.record(fields["key"], f"pg{offset:08d}".encode(), b"x")
            reply = (m.MsgType.VALUE, {"records": [rec], "total": 65535, "nodes": [], **VALUE_EXTRA})
        elif mtype is m.MsgType.STATE_GET and fields["sha"] == self.poison_sha:  # snapshot_poison's NaN bytes
            offset = min(fields["offset"], len(self.poison))
            data = self.poison[offset: offset + min(fields["length"], 1024)]
            reply = (m.MsgType.STATE_CHUNK, {"sha": self.poison_sha, "offset": offset, "total": len(self.poison),
                                             "data": data})
        if reply is None:
            return
        out = m.encode(reply[0], {"rid": fields["rid"], "from": r.frm, **reply[1]}, check=False)
        self.answered += 1
        to = node_id_of(fields["from"]["pk"])
        self._send(self.rsock, seal_for(r.sealer, reply[0], out, to), source, "find_value_pages")

    def _send(self, sock: socket.socket, data: bytes, target: Target, cls: str) -> None:
        try:
            sock.sendto(data, target)
        except (BlockingIOError, InterruptedError):
            pass  # a full send buffer drops it, like the network would
        except OSError:
            pass
        self.sent[cls] += 1

    # -- the bounded send loop ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        n = int(self.cfg["datagrams"])
        rate = float(self.cfg.get("rate", 6000))
        burst_share = float(self.cfg.get("burst_share", 0.3))
        burst = int(n * burst_share)
        steady1 = (n - burst) * 2 // 3
        phases = [("steady", steady1), ("burst", burst), ("steady", n - burst - steady1)]
        server = threading.Thread(target=self._serve, name="soak-responder", daemon=True)
        if self.cfg.get("responder", True):  # off in the outsider-only phase: no member datagram at all
            server.start()
        parent = os.getppid()
        order = list(self.cfg.get("classes") or CLASSES)
        start = time.monotonic()
        last_report = 0.0
        burst_s = 0.0
        total = 0
        ci = ti = 0
        for name, count in phases:
            self.phase = name
            self._emit(total, start)  # at once: the bench tells the burst's PINGs apart by it
            t0 = time.monotonic()
            done = 0
            while done < count:
                chunk = min(count - done, BURST_CHUNK if name == "burst" else 32)
                for _ in range(chunk):
                    cls = order[ci]
                    ci = (ci + 1) % len(order)
                    self._to = ti
                    sock, data = self._builders[cls]()
                    self._send(sock, data, self.targets[ti], cls)
                    ti = (ti + 1) % len(self.targets)
                done += chunk
                total += chunk
                now = time.monotonic()
                if name == "steady":
                    ahead = t0 + done / rate - now
                    if ahead > 0:
                        time.sleep(ahead)
                if now - last_report >= PROGRESS_S:
                    last_report = now
                    if os.getppid() != parent:  # the bench is gone: stop
                        self.stop.set()
                        return self._summary(start, burst_s, burst)
                    self._emit(total, start)
            if name == "burst":
                burst_s = time.monotonic() - t0
        self.stop.set()
        if server.is_alive():
            server.join(timeout=2.0)
        return self._summary(start, burst_s, burst)

    def _emit(self, total: int, start: float) -> None:
        line = {"sent": total, "by_class": self.sent, "phase": self.phase, "seconds": time.monotonic() - start}
        print(json.dumps(line), flush=True)

    def _summary(self, start: float, burst_s: float, burst: int) -> dict[str, Any]:
        seconds = time.monotonic() - start
        return {"done": True, "sent": sum(self.sent.values()), "by_class": dict(self.sent), "seconds": seconds,
                "burst_datagrams": burst, "burst_seconds": burst_s,
                "burst_datagrams_per_second": burst / burst_s if burst_s > 0 else 0.0,
                "responder_answers": self.answered, "cross_receiver_answers": self.xanswers,
                "connect_reflected": self.reflected}


def _udp() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    return s


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m peerd.tools.bench.soak_attack CONFIG_JSON", file=sys.stderr)
        return 2
    attack = Attack(json.loads(argv[0]))
    print(json.dumps(attack.run()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
