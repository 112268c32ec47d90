"""Unit tests of peerd.wire: replay window, sealing, token binding, key files, message schemas, fuzzing.

Golden byte-for-byte encodings live in test_wire_vectors.py; this module tests behaviour.
"""

from __future__ import annotations

import base64
import os
import stat
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from peerd.wire import HEADER_SIZE, TAG_SIZE, Header, Identity, KeyFileError, Opener, Sealer, WireError, parse_header
from peerd.wire import messages as m
from peerd.wire.envelope import MAX_SEQUENCE
from peerd.wire.identity import (
    acl_open_to_others,
    load_identity,
    load_swarm_key,
    node_id_of,
    token_of,
    verify_token_binding,
    write_identity,
    write_swarm_key,
)
from peerd.wire.replay import DEFAULT_WINDOW, ReplayWindow

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
RECV = bytes(range(100, 132))  # the receiver's node id, bound into every non-PING datagram's AAD
ALICE = Identity.from_seed(bytes(range(100, 132)))
BOB = Identity.from_seed(bytes(range(200, 232)))
REASONS = {"malformed", "version", "auth", "replay", "identity", "type"}

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def from_field(ident: Identity, token: int, addr: tuple[str, int] | None = ("192.0.2.1", 7400)) -> dict:
    """A well-formed ``from`` naming ``token`` (for the decoder: its binding does not verify)."""
    sig = bytes(8) + ident.sign_token(token)
    return {"pk": ident.public_key, "sig": sig, "addr": m.pack_addr(*addr) if addr else None}


def record(ident: Identity = BOB, *, key: bytes = b"k", subkey: bytes = b"s", value: bytes = b"v") -> list:
    return [key, subkey, value, 1767225600.0, 600.0, ident.public_key, bytes(64)]


def sample_bodies(token: int = 1) -> list[tuple[m.MsgType, dict]]:
    frm = from_field(ALICE, token)
    contact = m.pack_contact(BOB.node_id, "2001:db8::1", 7400)
    return [
        (m.MsgType.PING, {"rid": 1, "from": frm}),
        (m.MsgType.PONG, {"rid": 1, "from": from_field(ALICE, token, None)}),
        (m.MsgType.FIND_NODE, {"rid": 2, "from": frm, "target": bytes(32)}),
        (m.MsgType.NODES, {"rid": 2, "from": frm, "nodes": [contact] * 3}),
        (m.MsgType.FIND_VALUE, {"rid": 3, "from": frm, "key": b"key", "offset": 5, "held": [bytes(8)]}),
        (m.MsgType.VALUE, {"rid": 3, "from": frm, "records": [record()], "total": 6, "nodes": [contact],
                           "have": b"\x01"}),
        (m.MsgType.STORE, {"rid": 2**64 - 1, "from": frm, "records": [record(), record(subkey=b"")]}),
        (m.MsgType.STORED, {"rid": 2**64 - 1, "from": frm, "ok": [True, False]}),
        (m.MsgType.ERROR, {"rid": 0, "from": frm, "code": "busy", "detail": "later"}),
    ]


def expect_drop(reason: str | set[str], fn, *args) -> WireError:
    with pytest.raises(WireError) as e:
        fn(*args)
    reasons = {reason} if isinstance(reason, str) else reason
    assert e.value.reason in reasons, e.value
    return e.value


# ---- replay window ---------------------------------------------------------------------------------------


def feed(win: ReplayWindow, seq: int) -> bool:
    if win.would_accept(seq):
        win.accept(seq)
        return True
    return False


def test_replay_in_order() -> None:
    win = ReplayWindow()
    assert all(feed(win, s) for s in range(1, 20_000))
    assert win.highest == 19_999


def test_replay_duplicates_rejected() -> None:
    win = ReplayWindow()
    for s in range(1, 100):
        assert feed(win, s)
        assert not feed(win, s)
    assert not any(feed(win, s) for s in range(1, 100))


def test_replay_reordered_within_window() -> None:
    win = ReplayWindow()
    order = list(range(1, 5000))
    order.reverse()  # the worst reordering that stays inside the window
    assert all(feed(win, s) for s in order)
    assert not any(feed(win, s) for s in order)


def test_replay_window_edge() -> None:
    w = DEFAULT_WINDOW
    win = ReplayWindow()
    assert feed(win, 10_000)
    assert feed(win, 10_000 - (w - 1))  # the oldest number still inside
    assert not feed(win, 10_000 - w)  # one more: too old
    assert not feed(win, 1)
    assert feed(win, 10_001)  # the window moves by one ...
    assert not feed(win, 10_001 - w)  # ... 10_001 - w was in the window, never seen, and is now too old


def test_replay_big_jumps() -> None:
    w = DEFAULT_WINDOW
    win = ReplayWindow()
    for s in range(1, 11):
        feed(win, s)
    assert feed(win, 10 + 5 * w)  # a jump of several windows forgets everything before it
    assert not any(feed(win, s) for s in range(1, 11))
    assert feed(win, 10 + 4 * w + 1)  # the oldest number inside the new window
    assert not feed(win, 10 + 4 * w)
    assert feed(win, 11 + 5 * w)
    assert feed(win, MAX_SEQUENCE)  # up to the top of the sequence space
    assert not feed(win, MAX_SEQUENCE)
    assert feed(win, MAX_SEQUENCE - 1)


def test_replay_first_number_is_arbitrary() -> None:
    """A window that starts late still accepts the in-window numbers before its first one."""
    win = ReplayWindow(64)
    assert feed(win, 1000)
    assert feed(win, 1000 - 63) and not feed(win, 1000 - 64)


def test_replay_window_size_one() -> None:
    win = ReplayWindow(1)
    assert feed(win, 5) and not feed(win, 5) and not feed(win, 4) and feed(win, 6)


@FAST
@given(st.data(), st.sampled_from([1, 2, 3, 8, 63, 64, 65, 200]))
def test_replay_matches_model(data, size: int) -> None:
    """Against a model: accept iff never seen and newer than (highest - size); never twice."""
    stream = data.draw(st.lists(st.integers(0, 3 * size + 10), max_size=300))
    win = ReplayWindow(size)
    seen: set[int] = set()
    highest = -1
    for s in stream:
        expected = s not in seen and s > highest - size
        assert feed(win, s) == expected, (s, highest)
        if expected:
            seen.add(s)
            highest = max(highest, s)


@FAST
@given(st.data(), st.sampled_from([1, 8, 64]))
def test_replay_block_matches_model(data, size: int) -> None:
    """A block (one GRO receive) is judged against the window as it was before the block: accepted iff
    never seen, newer than (highest before the block - size), and its first copy in the block; whatever
    the mix of blocks and single datagrams, no sequence is ever accepted twice."""
    win = ReplayWindow(size)
    seen: set[int] = set()
    highest = -1
    for _ in range(data.draw(st.integers(1, 30))):
        block = data.draw(st.lists(st.integers(0, 4 * size + 10), min_size=1, max_size=20))
        if len(block) == 1 and data.draw(st.booleans()):
            s = block[0]
            expected = s not in seen and s > highest - size
            assert feed(win, s) == expected
            if expected:
                seen.add(s)
                highest = max(highest, s)
            continue
        seqs = np.array(block, dtype=np.uint64)
        ok = win.would_accept_block(seqs)
        firsts = {s: block.index(s) for s in block}
        want = [s not in seen and s > highest - size and firsts[s] == i for i, s in enumerate(block)]
        assert ok.tolist() == want, (block, highest)
        win.accept_block(seqs[ok])
        seen.update(s for s, w in zip(block, want, strict=True) if w)
        highest = max([highest, *block])


@FAST
@given(st.lists(st.integers(1, 20_000), max_size=400), st.randoms(use_true_random=False))
def test_replay_each_in_window_number_exactly_once(nums: list[int], rnd) -> None:
    """Delivering a shuffled stream with duplicates: every number is accepted at most once, and each
    that is inside the default window when it arrives is accepted exactly once."""
    stream = nums + nums[: len(nums) // 2]
    rnd.shuffle(stream)
    win = ReplayWindow()
    accepted: list[int] = []
    for s in stream:
        inside = s > win.highest - DEFAULT_WINDOW
        fresh = s not in accepted
        ok = feed(win, s)
        assert ok == (inside and fresh)
        if ok:
            accepted.append(s)
    assert len(accepted) == len(set(accepted))


# ---- sealing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [SECRET, None], ids=["sealed", "insecure"])
def test_seal_round_trip(secret: bytes | None) -> None:
    sealer, opener = Sealer(secret), Opener(secret, RECV)
    assert sealer.sealed == (secret is not None)
    assert sealer.overhead == HEADER_SIZE + (TAG_SIZE if secret else 0) == (37 if secret else 21)
    for i, body in enumerate([b"", b"x", bytes(range(256)) * 4, b"\0" * 1163], start=1):
        datagram = sealer.seal(0x05, body, RECV)
        assert len(datagram) == sealer.overhead + len(body)
        header, plain, state = opener.open(datagram)
        assert header == Header(0x05, 1 if secret else 0, sealer.token, i)
        assert plain == body
        assert state is opener.token_state(sealer.token)
    if secret is not None:  # the body is encrypted, not just authenticated
        assert b"secret body" not in sealer.seal(0x01, b"secret body")


def test_seal_memoryview_input() -> None:
    sealer, opener = Sealer(SECRET), Opener(SECRET)
    datagram = sealer.seal(0x01, memoryview(b"abc"))
    assert opener.open(memoryview(datagram))[1] == b"abc"


def test_sealer_tokens_are_random_and_nonzero() -> None:
    tokens = {Sealer(SECRET).token for _ in range(64)}
    assert len(tokens) == 64 and 0 not in tokens
    assert all(0 < t < 2**64 for t in tokens)


def test_sealer_rejects_bad_secret() -> None:
    for bad in (b"", bytes(31), bytes(33)):
        with pytest.raises(ValueError):
            Sealer(bad)


def test_sealer_never_wraps() -> None:
    sealer = Sealer(SECRET)
    sealer._seq = MAX_SEQUENCE - 1  # white box: reaching the end by sealing 2**64 datagrams takes too long
    assert parse_header(sealer.seal(0x01, b"")).seq == MAX_SEQUENCE
    with pytest.raises(RuntimeError):
        sealer.seal(0x01, b"")


def test_wrong_key_is_auth() -> None:
    datagram = Sealer(OTHER).seal(0x01, b"hello")
    expect_drop("auth", Opener(SECRET).open, datagram)


def test_sealed_insecure_mismatch_is_auth() -> None:
    expect_drop("auth", Opener(None).open, Sealer(SECRET).seal(0x01, b"hello"))
    expect_drop("auth", Opener(SECRET).open, Sealer(None).seal(0x01, b"hello" * 10))


def test_every_tampered_byte_is_dropped() -> None:
    sealer, opener = Sealer(SECRET), Opener(SECRET, RECV)
    datagram = sealer.seal(0x03, b"a body of some length", RECV)
    for i in range(len(datagram)):
        for bit in (0x01, 0x80):
            bad = datagram[:i] + bytes([datagram[i] ^ bit]) + datagram[i + 1 :]
            expect_drop({"auth", "malformed", "version"}, opener.open, bad)
    assert opener.open(datagram)[1] == b"a body of some length"  # failures never touched the window


def test_truncated_and_extended_datagrams() -> None:
    sealer, opener = Sealer(SECRET), Opener(SECRET)
    datagram = sealer.seal(0x01, b"body")
    for n in range(len(datagram)):
        expect_drop({"auth", "malformed"}, opener.open, datagram[:n])
    expect_drop("auth", opener.open, datagram + b"\0")
    assert opener.open(datagram)[1] == b"body"


def test_replayed_datagram_is_dropped() -> None:
    sealer, opener = Sealer(SECRET), Opener(SECRET)
    first, second = sealer.seal(0x01, b"1"), sealer.seal(0x01, b"2")
    opener.open(second)
    opener.open(first)  # reordered: fine
    expect_drop("replay", opener.open, first)
    expect_drop("replay", opener.open, second)


def test_window_updated_only_after_authentication() -> None:
    sealer, opener = Sealer(SECRET), Opener(SECRET)
    good = [sealer.seal(0x01, bytes([i])) for i in range(3)]
    opener.open(good[0])
    # a forgery that reuses the token and the next sequence number (the body does not authenticate)
    forged = good[1][:HEADER_SIZE] + bytes(len(good[1]) - HEADER_SIZE)
    expect_drop("auth", opener.open, forged)
    assert opener.token_state(sealer.token).window.highest == 1
    assert opener.open(good[1])[1] == b"\x01"
    # a forgery far ahead must not move the window either
    far = Header(0x01, 1, sealer.token, 10**9).pack() + bytes(32)
    expect_drop("auth", opener.open, far)
    assert opener.open(good[2])[1] == b"\x02"


def test_failed_datagrams_do_not_admit_tokens() -> None:
    """An outsider cannot fill (and so evict from) the opener's token table."""
    sealer, opener = Sealer(SECRET), Opener(SECRET, max_tokens=2)
    opener.open(sealer.seal(0x01, b""))
    for token in range(1, 50):
        forged = Header(0x01, 1, token, 1).pack() + bytes(20)
        expect_drop("auth", opener.open, forged)
        assert opener.token_state(token) is None
    assert opener.token_state(sealer.token) is not None


def test_token_table_is_lru() -> None:
    opener = Opener(SECRET, max_tokens=3)
    sealers = [Sealer(SECRET) for _ in range(4)]
    for s in sealers[:3]:
        opener.open(s.seal(0x01, b""))
    opener.open(sealers[0].seal(0x01, b""))  # sealer 0 is now the most recently used
    opener.open(sealers[3].seal(0x01, b""))  # evicts sealer 1, the least recently used
    assert opener.token_state(sealers[1].token) is None
    for i in (0, 2, 3):
        assert opener.token_state(sealers[i].token) is not None


def test_evicting_a_token_with_fresh_tokens_does_not_reopen_its_window_hostile() -> None:
    """A member captures a datagram, pushes its token out of the table with fresh tokens of its own (all of them
    authenticate: it holds the swarm secret), and sends the capture again. The evicted token's tombstone keeps
    its replay floor: the capture stays a replay, and the token's newer datagrams still open."""
    victim = Sealer(SECRET)
    opener = Opener(SECRET, max_tokens=4)
    captured = [victim.seal(0x01, b"old%d" % i) for i in range(3)]
    for d in captured:
        opener.open(d)
    for _ in range(4 * 3):  # a flood of fresh tokens, three times the table
        opener.open(Sealer(SECRET).seal(0x01, b""))
    assert opener.token_state(victim.token) is None
    for d in captured:
        expect_drop("replay", opener.open, d)
    assert opener.open(victim.seal(0x01, b"new"))[1] == b"new"  # the token comes back above its floor
    expect_drop("replay", opener.open, captured[0])
    # its next block opens too (the restored window is the one the native block path reads)
    block = victim.seal_block(0x40, np.zeros((5, 30), np.uint8), RECV)
    opened = Opener(SECRET, RECV).open_block(block)
    assert opened is None  # (a fresh opener does not know the token: row by row)
    r = Opener(SECRET, RECV, max_tokens=1)
    r.open(victim.seal(0x02, b"", RECV))
    r.open(Sealer(SECRET).seal(0x02, b"", RECV))  # evicts the victim's token
    r.open(victim.seal(0x02, b"", RECV))  # back, from its floor
    got = r.open_block(victim.seal_block(0x40, np.zeros((5, 30), np.uint8), RECV))
    assert got is not None and len(got.bodies) == 5 and got.replays == 0


def test_tombstones_are_bounded_and_the_oldest_goes_first() -> None:
    """The documented bound: past ``max_tombstones`` evictions the oldest token's floor is forgotten, and an old
    datagram of it opens again (PROTOCOL.md 5.3 says how many fresh tokens that takes)."""
    a = Sealer(SECRET)
    opener = Opener(SECRET, max_tokens=1, max_tombstones=3)
    old = a.seal(0x01, b"old")
    opener.open(old)
    opener.open(Sealer(SECRET).seal(0x01, b""))  # evicts a (tombstone 1)
    expect_drop("replay", opener.open, old)
    for _ in range(2):
        opener.open(Sealer(SECRET).seal(0x01, b""))  # tombstones 2, 3: a's is still there
    expect_drop("replay", opener.open, old)
    opener.open(Sealer(SECRET).seal(0x01, b""))  # tombstone 4 pushes out a's, the oldest
    assert len(opener._tombstones) == 3
    assert opener.open(old)[1] == b"old"


def test_tokens_have_independent_windows_and_keys() -> None:
    a, b = Sealer(SECRET, token=1), Sealer(SECRET, token=2)
    opener = Opener(SECRET)
    da, db = a.seal(0x01, b"same"), b.seal(0x01, b"same")
    assert da[HEADER_SIZE:] != db[HEADER_SIZE:]  # same secret, sequence and body: different keys
    opener.open(da)
    opener.open(db)  # sequence 1 again, but under another token
    # moving a datagram to another token's header does not authenticate
    moved = db[:HEADER_SIZE] + da[HEADER_SIZE:]
    expect_drop("auth", Opener(SECRET).open, moved)


# ---- envelope ----------------------------------------------------------------------------------------------


def test_header_layout() -> None:
    raw = Header(0x06, 1, 0x0102030405060708, 0x1112131415161718).pack()
    assert raw == b"PD\x02\x06\x01" + bytes(range(1, 9)) + bytes(range(0x11, 0x19))
    assert len(raw) == HEADER_SIZE == 21


def test_header_does_not_judge_the_type() -> None:
    """Type ranges are the dispatcher's business: the envelope parses any type byte."""
    for t in (0x00, 0x3F, 0x40, 0x7F, 0x80, 0xFF):
        assert parse_header(Header(t, 0, 1, 1).pack()).type == t
    expect_drop("type", m.decode, 0x00, b"\x80")
    expect_drop("type", m.decode, 0x40, b"\x80")


# ---- token binding and identities -----------------------------------------------------------------------


def test_token_binding() -> None:
    b = ALICE.bind_token(nonce=bytes(range(8)))
    token, nonce, sig, proof = b.token, b.nonce, b.sig, b.proof
    assert token == token_of(ALICE.public_key, nonce) and b.sender()["sig"] == proof == nonce + sig
    assert len(sig) == 64 and sig == ALICE.sign_token(token)  # Ed25519 is deterministic
    verify_token_binding(ALICE.public_key, token, proof)
    expect_drop("identity", verify_token_binding, BOB.public_key, token, proof)  # someone else's key
    expect_drop("identity", verify_token_binding, ALICE.public_key, token + 1, proof)  # another token
    expect_drop("identity", verify_token_binding, ALICE.public_key, token, bytes(8) + sig)  # another nonce
    expect_drop("identity", verify_token_binding, ALICE.public_key, token, sig)  # no nonce
    expect_drop("identity", verify_token_binding, ALICE.public_key, token, nonce + BOB.sign_token(token))
    expect_drop("identity", verify_token_binding, ALICE.public_key, token, proof[:-1] + bytes([proof[-1] ^ 1]))
    expect_drop("identity", verify_token_binding, ALICE.public_key, token, b"")
    expect_drop("identity", verify_token_binding, ALICE.public_key[:31], token, proof)
    expect_drop("identity", verify_token_binding, b"\xff" * 32, token, proof)
    # a plain signature over the bare token (no domain) is not a binding
    expect_drop("identity", verify_token_binding, ALICE.public_key, token, nonce + ALICE.sign(token.to_bytes(8, "big")))
    # random nonces: distinct tokens, never 0
    tokens = {ALICE.bind_token().token for _ in range(64)}
    assert len(tokens) == 64 and 0 not in tokens
    with pytest.raises(ValueError):
        ALICE.bind_token(nonce=bytes(7))


def test_a_member_cannot_bind_another_members_token_hostile() -> None:
    """Squatting: Bob signs Alice's token (seen in every header of hers) with his own key and presents it first.
    The token is derived from Alice's key, so no nonce of Bob's gives it: the binding is refused."""
    alice = ALICE.bind_token()
    squat = alice.nonce + BOB.sign_token(alice.token)
    expect_drop("identity", verify_token_binding, BOB.public_key, alice.token, squat)
    verify_token_binding(ALICE.public_key, alice.token, alice.proof)


def test_identity_ids() -> None:
    assert ALICE.node_id == node_id_of(ALICE.public_key) and len(ALICE.node_id) == 32
    assert Identity.from_seed(bytes(range(100, 132))).public_key == ALICE.public_key
    assert Identity.generate().public_key != Identity.generate().public_key


# ---- key files -------------------------------------------------------------------------------------------


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def under_open_umask(write: Callable[[str], Any], path: str) -> Any:
    """``write(path)`` under umask 0: the file's mode is then the writer's own choice."""
    old = os.umask(0)
    try:
        return write(path)
    finally:
        os.umask(old)


def key_file(directory: Any, name: str, content: bytes) -> str:
    """A key file in ``directory`` holding ``content`` that only its owner may read (as keygen writes them)."""
    path = directory / name
    path.write_bytes(content)
    path.chmod(0o600)
    return str(path)


def test_identity_file_round_trip(tmp_path) -> None:
    path = str(tmp_path / "id.pem")
    ident = under_open_umask(write_identity, path)
    assert mode(path) == 0o600
    assert load_identity(path).public_key == ident.public_key
    with pytest.raises(FileExistsError):  # never overwrites an identity
        write_identity(path)
    assert load_identity(path).public_key == ident.public_key


def test_swarm_key_file_round_trip(tmp_path) -> None:
    path = str(tmp_path / "swarm.key")
    secret = under_open_umask(write_swarm_key, path)
    assert mode(path) == 0o600 and len(secret) == 32
    assert (tmp_path / "swarm.key").read_bytes() == base64.b64encode(secret) + b"\n"
    assert load_swarm_key(path) == secret
    with pytest.raises(FileExistsError):
        write_swarm_key(path)
    spaced = tmp_path / "spaced.key"
    spaced.write_bytes(b"  " + base64.b64encode(secret) + b"\r\n\n")
    spaced.chmod(0o600)
    assert load_swarm_key(str(spaced)) == secret


def test_missing_key_files(tmp_path) -> None:
    for load in (load_identity, load_swarm_key):
        with pytest.raises(KeyFileError) as e:
            load(str(tmp_path / "nope"))
        assert "peerd keygen" in str(e.value)
        with pytest.raises(KeyFileError) as e:
            load(str(tmp_path))  # a directory
        assert "peerd keygen" in str(e.value)


@pytest.mark.parametrize(
    "content",
    [b"", b"not a key\n", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", bytes(range(256))],
)
def test_bad_identity_file(tmp_path, content: bytes) -> None:
    path = key_file(tmp_path, "id.pem", content)
    with pytest.raises(KeyFileError) as e:
        load_identity(path)
    assert "peerd keygen" in str(e.value)


def test_identity_file_of_another_key_type(tmp_path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    path = key_file(tmp_path, "ec.pem", key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    with pytest.raises(KeyFileError) as e:
        load_identity(path)
    assert "Ed25519" in str(e.value) and "peerd keygen" in str(e.value)


def test_identity_file_of_an_unknown_algorithm(tmp_path) -> None:
    """A PKCS#8 PEM whose algorithm OID cryptography does not know must still give KeyFileError."""
    der = ALICE.private_key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    der = der.replace(bytes.fromhex("06032b6570"), bytes.fromhex("06032b6563"))  # OID 1.3.101.112 -> .99
    path = key_file(tmp_path, "odd.pem",
                    b"-----BEGIN PRIVATE KEY-----\n" + base64.encodebytes(der) + b"-----END PRIVATE KEY-----\n")
    with pytest.raises(KeyFileError):
        load_identity(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"!!!!\n", base64.b64encode(bytes(31)), base64.b64encode(bytes(33)), base64.b64encode(bytes(32))[:-1]],
)
def test_bad_swarm_key_file(tmp_path, content: bytes) -> None:
    path = key_file(tmp_path, "swarm.key", content)
    with pytest.raises(KeyFileError) as e:
        load_swarm_key(path)
    assert "peerd keygen --swarm-key" in str(e.value)


# ---- messages --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mtype,body", sample_bodies(), ids=[t.name for t, _ in sample_bodies()])
def test_message_round_trip(mtype: m.MsgType, body: dict) -> None:
    data = m.encode(mtype, body)
    decoded = m.decode(int(mtype), data)
    assert list(decoded) == list(m.SCHEMAS[mtype])  # canonical key order
    assert decoded["rid"] == body["rid"]
    assert decoded["from"]["pk"] == ALICE.public_key
    # the encoding is canonical: key order of the input does not matter
    assert m.encode(mtype, dict(reversed(list(body.items())))) == data


def test_decoded_views() -> None:
    frm = from_field(ALICE, 1, ("2001:0db8:0000::0001", 1))
    contact = m.pack_contact(BOB.node_id, "10.0.0.1", 65535)
    d = m.decode(m.MsgType.NODES, m.encode(m.MsgType.NODES, {"rid": 9, "from": frm, "nodes": [contact]}))
    assert d["from"]["addr"] == ("2001:db8::1", 1)
    assert d["nodes"] == [(BOB.node_id, "10.0.0.1", 65535)]
    assert len(frm["addr"][0]) == 16 and len(contact[1]) == 4
    rec = record()
    rec[3], rec[4] = 5, 7  # integers are accepted for expires/ttl and come back as floats
    d = m.decode(m.MsgType.STORE, msgpack.packb({"rid": 1, "from": frm, "records": [rec]}, use_bin_type=True))
    assert d["records"][0][3:5] == (5.0, 7.0) and type(d["records"][0][3]) is float


def test_encode_rejects_wrong_key_sets() -> None:
    frm = from_field(ALICE, 1)
    with pytest.raises(ValueError):
        m.encode(m.MsgType.PING, {"rid": 1})
    with pytest.raises(ValueError):
        m.encode(m.MsgType.PING, {"rid": 1, "from": frm, "extra": 1})


def test_limits_at_the_boundary() -> None:
    frm = from_field(ALICE, 1)
    contact = m.pack_contact(BOB.node_id, "192.0.2.1", 1)

    def ok(mtype: m.MsgType, body: dict) -> None:
        m.decode(mtype, m.encode(mtype, {"rid": 1, "from": frm, **body}))

    def bad(mtype: m.MsgType, body: dict) -> None:
        full = {"rid": 1, "from": frm, **body}
        expect_drop("malformed", m.decode, mtype, m.encode(mtype, full, check=False))
        expect_drop("malformed", m.encode, mtype, full)  # what a peer would drop, a node never sends

    ok(m.MsgType.NODES, {"nodes": [contact] * 20})
    bad(m.MsgType.NODES, {"nodes": [contact] * 21})
    ok(m.MsgType.FIND_VALUE, {"key": b"k" * 128, "offset": 65535, "held": [bytes(8)] * 64})
    bad(m.MsgType.FIND_VALUE, {"key": b"k" * 129, "offset": 0, "held": []})
    bad(m.MsgType.FIND_VALUE, {"key": b"k", "offset": 65536, "held": []})
    bad(m.MsgType.FIND_VALUE, {"key": b"k", "offset": 0, "held": [bytes(8)] * 65})
    bad(m.MsgType.FIND_VALUE, {"key": b"k", "offset": 0, "held": [bytes(7)]})
    bad(m.MsgType.VALUE, {"records": [], "total": 0, "nodes": [], "have": bytes(9)})
    ok(m.MsgType.STORE, {"records": [record(key=b"k" * 128, subkey=b"s" * 64, value=b"v" * 640)] * 16})
    bad(m.MsgType.STORE, {"records": [record()] * 17})
    bad(m.MsgType.STORE, {"records": [record(value=b"v" * 641)]})
    bad(m.MsgType.STORE, {"records": [record(subkey=b"s" * 65)]})
    bad(m.MsgType.STORE, {"records": [record(key=b"")]})
    for ttl, good in [(0.0, True), (86400.0, True), (86400.01, False), (-0.5, False), (float("inf"), False)]:
        rec = record()
        rec[4] = ttl
        (ok if good else bad)(m.MsgType.STORE, {"records": [rec]})
    ok(m.MsgType.STORED, {"ok": [True] * 16})
    bad(m.MsgType.STORED, {"ok": [True] * 17})
    ok(m.MsgType.ERROR, {"code": "c" * 32, "detail": "é" * 200})
    bad(m.MsgType.ERROR, {"code": "c" * 33, "detail": ""})
    bad(m.MsgType.ERROR, {"code": "", "detail": "d" * 201})


def test_encode_fitting_trims_the_tail_and_checks_what_goes_out_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A VALUE of 20 contacts over its budget loses its last contacts (nearest first stay), is the exact encoding
    of the trimmed body, and is validated once (a check is a full decode); what a peer would drop is refused."""
    frm = from_field(ALICE, 1, ("2001:db8::1", 7400))
    nodes = [m.pack_contact(bytes([i]) * 32, "192.0.2.1", 7400 + i) for i in range(20)]
    body = {"rid": 9, "from": frm, "records": [record()], "total": 1, "nodes": nodes, "have": b""}
    whole = len(m.encode(m.MsgType.VALUE, body))
    checks = []
    real = m._check_fields
    monkeypatch.setattr(m, "_check_fields", lambda *a: checks.append(a[0]) or real(*a))
    budget = whole - 100  # about three contacts too many
    data = m.encode_fitting(m.MsgType.VALUE, body, budget)
    kept = len(m.decode(m.MsgType.VALUE, data)["nodes"])
    assert len(checks) == 1  # the one check inside encode_fitting, on what goes out
    assert len(data) <= budget and 0 < kept < 20
    assert data == m.encode(m.MsgType.VALUE, {**body, "nodes": nodes[:kept]})
    assert len(m.encode(m.MsgType.VALUE, {**body, "nodes": nodes[: kept + 1]})) > budget  # no more than needed
    assert m.encode_fitting(m.MsgType.VALUE, body, whole) == m.encode(m.MsgType.VALUE, body)
    bad_nodes = [m.pack_contact(bytes(32), "0.0.0.0", 7400), *nodes]  # an unusable address stays (nearest)
    expect_drop("malformed", m.encode_fitting, m.MsgType.VALUE, {**body, "nodes": bad_nodes}, budget)
    with pytest.raises(ValueError, match="does not fit"):
        m.encode_fitting(m.MsgType.VALUE, body, 100)


def test_largest_record_fits_the_default_mtu() -> None:
    """One record of the maximum sizes, IPv6 addr, largest rid: a sealed STORE still fits 1200 bytes."""
    frm = from_field(ALICE, 1, ("2001:db8::1", 65535))
    rec = record(key=b"k" * 128, subkey=b"s" * 64, value=b"v" * 640)
    rec[6] = bytes(64)
    for mtype, extra in [
        (m.MsgType.STORE, {"records": [rec]}),
        (m.MsgType.VALUE, {"records": [rec], "total": 65535, "nodes": [], "have": bytes(8)}),
        (m.MsgType.FIND_VALUE, {"key": b"k" * 128, "offset": 65535, "held": [bytes(8)] * 64}),
    ]:
        body = m.encode(mtype, {"rid": 2**64 - 1, "from": frm, **extra})
        assert len(Sealer(SECRET).seal(mtype, body, RECV)) <= 1200


_ANY_SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.binary(max_size=40), st.text(max_size=40),
)
_ANY = st.recursive(_ANY_SCALAR, lambda inner: st.lists(inner, max_size=4), max_leaves=12)


@st.composite
def edited_bodies(draw) -> tuple[m.MsgType, dict]:
    """A valid sample body with some fields replaced: by another sample's field, by a list of its own items
    (repeated, longer than allowed), or by anything msgpack can (or cannot) pack."""
    mtype, body = draw(st.sampled_from(sample_bodies()))
    body = dict(body)
    for name in draw(st.sets(st.sampled_from(list(body)))):
        value = body[name]
        body[name] = draw(st.one_of(
            _ANY,
            st.just([value] * draw(st.integers(0, 30))),
            st.just(from_field(BOB, draw(st.integers(0, 5)), None)),
            st.just([m.pack_contact(BOB.node_id, draw(st.sampled_from(["0.0.0.0", "10.0.0.1", "ff02::1"])), 1)]),
            st.just([record(value=b"v" * draw(st.integers(600, 700)))]),
        ))
    return mtype, body


@FAST
@given(edited_bodies())
def test_send_check_refuses_exactly_what_a_decoder_drops(case: tuple[m.MsgType, dict]) -> None:
    """encode packs field by field to the bytes msgpack packs the whole map to, and its check (field by field,
    with the cache of fields that passed) refuses exactly the bodies a peer's decode drops: the first time and
    again from the cache."""
    mtype, body = case
    try:
        whole = msgpack.packb({k: body[k] for k in m.SCHEMAS[mtype]}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        expect_drop("malformed", lambda: m.encode(mtype, body, check=False))
        return
    assert m.encode(mtype, body, check=False) == whole
    try:
        m.decode(mtype, whole)
        dropped = False
    except WireError:
        dropped = True
    for _ in range(2):
        if dropped:
            expect_drop("malformed", m.encode, mtype, body)
        else:
            assert m.encode(mtype, body) == whole


def test_send_check_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(m, "_SENDABLE", {})
    monkeypatch.setattr(m, "_SENDABLE_MAX", 8)
    for i in range(50):
        m.encode(m.MsgType.FIND_NODE, {"rid": i, "from": from_field(ALICE, i), "target": bytes([i]) * 32})
        assert len(m._SENDABLE) <= 8


def test_body_size_limit() -> None:
    expect_drop("malformed", m.decode, m.MsgType.PING, b"\xc0" * (m.MAX_BODY + 1))


def test_duplicate_map_keys_are_malformed() -> None:
    frm = from_field(ALICE, 1)
    raw = b"\x83" + b"".join(msgpack.packb(x, use_bin_type=True) for x in ("rid", 1, "rid", 2, "from", frm))
    expect_drop("malformed", m.decode, m.MsgType.PING, raw)


# ---- fuzzing: nothing but WireError ever escapes ---------------------------------------------------------

_SEALER = Sealer(SECRET, token=7)
_PLAIN = Sealer(None, token=8)
VALID_DATAGRAMS = [_SEALER.seal(t, m.encode(t, b), RECV) for t, b in sample_bodies(7)]
VALID_PLAIN = [_PLAIN.seal(t, m.encode(t, b), RECV) for t, b in sample_bodies(8)]
VALID_BODIES = [(t, m.encode(t, b)) for t, b in sample_bodies()]


def open_and_decode(opener: Opener, datagram: bytes) -> None:
    """What the daemon does with a datagram: only WireError may come out."""
    try:
        header, body, _ = opener.open(datagram)
        if header.type <= m.CONTROL_MAX:
            m.decode(header.type, body)
    except WireError as e:
        assert e.reason in REASONS, e


@st.composite
def mutated(draw, seeds: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "extend"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[i : i + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[i:]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


@FAST
@given(st.binary(max_size=200) | st.binary(max_size=200).map(lambda b: b"PD\x02" + b))
def test_fuzz_open_random_bytes(data: bytes) -> None:
    open_and_decode(Opener(SECRET, RECV), data)
    open_and_decode(Opener(None, RECV), data)


@FAST
@given(mutated(VALID_DATAGRAMS))
def test_fuzz_open_mutated_sealed(data: bytes) -> None:
    open_and_decode(Opener(SECRET, RECV), data)


@FAST
@given(mutated(VALID_PLAIN))
def test_fuzz_open_mutated_insecure(data: bytes) -> None:
    """In --insecure mode the mutated body reaches the msgpack decoder."""
    open_and_decode(Opener(None, RECV), data)


@FAST
@given(st.integers(0, 255), st.binary(max_size=300))
def test_fuzz_decode_random_bytes(mtype: int, data: bytes) -> None:
    try:
        m.decode(mtype, data)
    except WireError as e:
        assert e.reason in {"malformed", "type"}


@FAST
@given(st.data())
def test_fuzz_decode_mutated_bodies(data) -> None:
    i = data.draw(st.integers(0, len(VALID_BODIES) - 1))
    mtype, _ = VALID_BODIES[i]
    body = data.draw(mutated([VALID_BODIES[i][1]]))
    try:
        m.decode(mtype, body)
    except WireError as e:
        assert e.reason == "malformed"


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=70),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


def _paths(v: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place inside a body where a value sits."""
    out = [prefix] if prefix else []
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*prefix, k))
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            out += _paths(x, (*prefix, i))
    return out


def _replace(v: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(v, dict):
        return {**v, head: _replace(v[head], rest, new)}
    items = list(v)
    items[head] = _replace(items[head], rest, new)
    return items


@FAST
@given(st.data(), msgpack_values)
def test_fuzz_decode_wrong_types(data, new: Any) -> None:
    """Any field (at any depth) replaced by an arbitrary msgpack value: valid, or WireError('malformed')."""
    mtype, body = data.draw(st.sampled_from(sample_bodies()))
    path = data.draw(st.sampled_from(_paths(body)))
    raw = msgpack.packb(_replace(body, path, new), use_bin_type=True)
    assume(len(raw) <= m.MAX_BODY)
    try:
        m.decode(mtype, raw)
    except WireError as e:
        assert e.reason == "malformed"


@FAST
@given(st.data(), st.text(max_size=10), msgpack_values)
def test_fuzz_decode_extra_or_missing_keys(data, name: str, new: Any) -> None:
    mtype, body = data.draw(st.sampled_from(sample_bodies()))
    if data.draw(st.booleans()):
        assume(name not in body)
        changed = {**body, name: new}
    else:
        gone = data.draw(st.sampled_from(list(body)))
        changed = {k: v for k, v in body.items() if k != gone}
    expect_drop("malformed", m.decode, mtype, msgpack.packb(changed, use_bin_type=True))


@pytest.mark.parametrize("open_mode", [0o640, 0o604, 0o660, 0o644])
def test_key_files_open_to_others_are_refused_hostile(tmp_path, open_mode: int) -> None:
    """A key file that group or others can read is no secret: it is refused with the one fix that helps."""
    ident, key = str(tmp_path / "id.pem"), str(tmp_path / "swarm.key")
    write_identity(ident)
    write_swarm_key(key)
    for path, load in ((ident, load_identity), (key, load_swarm_key)):
        os.chmod(path, open_mode)
        with pytest.raises(KeyFileError) as e:
            load(path)
        message = str(e.value)
        assert f"chmod 600 {path}" in message and "\n" not in message and f"{open_mode:04o}" in message
        os.chmod(path, 0o600)  # the normal flow: keygen's 0600 loads
        load(path)


def _acl(*entries: tuple[int, int, int]) -> bytes:
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, who) for tag, perm, who in entries)


ANY = 0xFFFFFFFF


def test_a_key_file_shared_through_an_acl_is_refused_and_a_systemd_credential_is_not_hostile(tmp_path) -> None:
    """systemd hands a service (User=peerd) its LoadCredential as a root-owned 0400 file with one ACL entry for
    that user: the mode reads 0440 (the group bits show the ACL mask), and it loads. An ACL that gives the owning
    group, a named group or another user read access is refused like mode 0640."""
    me = os.geteuid()
    service = _acl((1, 4, ANY), (2, 4, me), (4, 0, ANY), (0x10, 4, ANY), (0x20, 0, ANY))
    assert not acl_open_to_others(service, me)
    for shared in (_acl((1, 6, ANY), (2, 4, me + 1), (4, 0, ANY), (0x10, 4, ANY), (0x20, 0, ANY)),  # another user
                   _acl((1, 6, ANY), (4, 4, ANY), (0x10, 4, ANY), (0x20, 0, ANY)),  # the owning group
                   _acl((1, 6, ANY), (4, 0, ANY), (8, 4, 1234), (0x10, 7, ANY), (0x20, 0, ANY)),  # a named group
                   b"\x02\x00\x00\x00\x01"):  # not an ACL: as open as it may be
        assert acl_open_to_others(shared, me)
    assert not acl_open_to_others(_acl((1, 6, ANY), (2, 4, me + 1), (4, 4, ANY), (0x10, 0, ANY), (0x20, 0, ANY)), me)
    key = str(tmp_path / "swarm.key")
    secret = write_swarm_key(key)
    os.chmod(key, 0o400)
    try:
        os.setxattr(key, "system.posix_acl_access", service)
    except OSError:
        return  # (a filesystem without ACLs: the parser above is the test)
    assert mode(key) == 0o440 and load_swarm_key(key) == secret
    os.setxattr(key, "system.posix_acl_access", _acl((1, 4, ANY), (4, 4, ANY), (0x10, 4, ANY), (0x20, 0, ANY)))
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_swarm_key(key)
