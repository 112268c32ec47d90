"""State sync's snapshot choice as a sans-I/O core (peerd.statesync.choice.SnapshotChoice): adverts and download
outcomes go in with ``now``, downloads to try come out. No network: each test is a handful of calls."""

from __future__ import annotations

from peerd.statesync.advert import Advert
from peerd.statesync.choice import MAX_SOLO, Download, Finished, SnapshotChoice

KEY, LAYOUT = "run/0123456789abcdef", "l" * 64
ME = b"\xee" * 32


def ad(i: int, step: int, sha: bytes, size: int = 100, *, layout: str = LAYOUT, key: str = KEY) -> Advert:
    return Advert(bytes([i]) * 32, key, layout, step, size, sha, ("127.0.0.1", 1000 + i))


def choice(**kw) -> SnapshotChoice:
    return SnapshotChoice(ME, KEY, layout=LAYOUT, max_size=1000, deadline=60.0, **kw)


def test_nothing_usable_is_none_and_strangers_are_counted() -> None:
    c = choice()
    c.receive_adverts([ad(1, 5, b"a" * 32, layout="x" * 64), ad(2, 5, b"b" * 32, size=10**9),
                       Advert(ME, KEY, LAYOUT, 9, 100, b"c" * 32, None), ad(3, -1, bytes(32), size=0)], set(), 0.0)
    assert c.take_actions() == [Finished(False, none=True)]
    stats = c.statistics()
    assert (stats.ignored_layout, stats.ignored_size, stats.candidates) == (1, 1, 0)


def test_the_best_snapshot_from_all_its_donors_then_each_alone_after_a_mismatch() -> None:
    good = b"g" * 32
    c = choice()
    c.receive_adverts([ad(1, 10, good), ad(2, 10, good), ad(3, 9, b"o" * 32)], set(), 0.0)
    (first,) = c.take_actions()
    assert isinstance(first, Download) and first.candidate.sha == good and len(first.donors) == 2
    c.receive_download(False, "does not match", True, 1.0)  # some donor served other bytes
    solo = c.take_actions()
    assert [len(d.donors) for d in solo] == [1]
    c.receive_download(False, "does not match", True, 2.0)
    (second_solo,) = c.take_actions()
    assert second_solo.candidate.sha == good and second_solo.donors != solo[0].donors
    c.receive_download(True, "", False, 3.0)
    assert c.take_actions() == [Finished(True)] and c.done


def test_a_snapshot_nobody_completes_moves_on_to_the_next_without_solo_tries() -> None:
    c = choice()
    c.receive_adverts([ad(1, 10, b"g" * 32), ad(2, 10, b"g" * 32), ad(3, 9, b"o" * 32)], set(), 0.0)
    c.take_actions()
    c.receive_download(False, "no donor delivered the bytes", False, 1.0)
    (nxt,) = c.take_actions()
    assert nxt.candidate.sha == b"o" * 32
    c.receive_download(False, "gone", False, 2.0)
    (end,) = c.take_actions()
    assert isinstance(end, Finished) and not end.found and "gone" in end.error


def test_solo_tries_are_bounded_hostile() -> None:
    sha = b"g" * 32
    c = choice()
    c.receive_adverts([ad(i, 10, sha) for i in range(1, 30)], set(), 0.0)
    tries = 0
    while not c.done:
        for a in c.take_actions():
            if isinstance(a, Download):
                tries += 1
                c.receive_download(False, "does not match", True, float(tries))
    assert tries == 1 + MAX_SOLO


def test_a_lone_donor_claiming_a_high_step_does_not_win_and_a_known_donor_does_hostile() -> None:
    agreed, lone = b"a" * 32, b"z" * 32
    ads = [ad(1, 100, agreed), ad(2, 100, agreed), ad(9, 10**9, lone)]
    c = choice()
    c.receive_adverts(ads, set(), 0.0)
    (first,) = c.take_actions()
    assert first.candidate.sha == agreed  # far ahead of the median, and alone
    known = choice()
    known.receive_adverts(ads, {(bytes([9]) * 32).hex()}, 0.0)
    (first,) = known.take_actions()
    assert first.candidate.sha == lone  # a donor this node averaged with ranks first


def test_excluded_snapshots_are_skipped_and_the_deadline_ends_the_choice() -> None:
    c = choice(exclude=(b"g" * 32,))
    c.receive_adverts([ad(1, 10, b"g" * 32), ad(2, 9, b"o" * 32)], set(), 0.0)
    (first,) = c.take_actions()
    assert first.candidate.sha == b"o" * 32
    assert c.get_timer() == 60.0
    c.handle_timer(60.0)
    (end,) = c.take_actions()
    assert isinstance(end, Finished) and "did not finish within" in end.error and c.get_timer() is None
    c.receive_download(True, "", False, 61.0)  # too late: nothing changes
    assert c.take_actions() == []


def test_a_founder_takes_the_lowest_initial_hash_below_its_own() -> None:
    low, mid, mine = b"\x01" * 32, b"\x05" * 32, b"\x09" * 32
    c = choice(below=mine)
    c.receive_adverts([ad(1, 0, mid), ad(2, 0, low), ad(3, 0, b"\x0a" * 32)], set(), 0.0)
    (first,) = c.take_actions()
    assert first.candidate.sha == low
