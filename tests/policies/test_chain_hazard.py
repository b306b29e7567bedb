"""ChainHazard (pure): continuation rates by chain age, learned from the past; coldest-first ranking."""

from __future__ import annotations

from kvtier.policies.chain_hazard import ChainHazard


def test_learns_continuation_ages_from_the_past_and_holds_the_likeliest_chains() -> None:
    h = ChainHazard(bin_requests=4, max_age=40)
    # request 0 opens chain [0, 1, 2]; request 8 continues it (shares chunks beyond the first) at age 8
    h.observe(0, [0, 1, 2])
    for i in range(1, 8):
        h.observe(i, [0, 100 + i])  # prompts sharing only the first chunk: no continuation
    assert h.rate(1, 9) == 0.0  # nothing continued yet: causal, no label from the future
    h.observe(8, [0, 1, 2, 3])
    assert h.cont[1, 2] == 1 and 0 not in h.live and 8 in h.live  # the continued chain is replaced
    assert h.rate(1, 9) > 0.0 and h.rate(5, 9) == 0.0  # age 8 has a continuation, age 4 none
    # two requests later the chains aged 8-11 rank first; the budget (chunks) bounds the held set
    h.observe(9, [0, 200])
    h.observe(10, [0, 201])
    assert h.hold(10, budget=2) == {0, 102}  # request 2 (age 8): the youngest chain of the best bin
    assert h.hold(10, budget=3) == {0, 101, 102}  # then request 1 (age 9); shared chunks count once
    assert h.hold(10, budget=0) == set()


def test_by_turn_keeps_one_rate_per_turn() -> None:
    h = ChainHazard(bin_requests=4, max_age=40, by_turn=True)
    h.observe(0, [0, 1])
    h.observe(4, [0, 1, 2])  # turn 2, continuing a first turn at age 4
    h.observe(8, [0, 1, 2, 3])  # turn 3, continuing a second turn at age 4
    assert h.cont[1, 1] == 1 and h.cont[2, 1] == 1 and h.turn[8] == 3


def test_continues_extends_the_request_without_learning_a_continuation() -> None:
    h = ChainHazard(bin_requests=4, max_age=40)
    h.observe(0, [0, 1])
    h.observe(0, [2, 3], continues=True)  # the same prompt's prefill in pieces
    assert h.live[0] == [0, 1, 2, 3] and h.last_user[3] == 0
    assert sum(h.cont.values()) == 0 and list(h.live) == [0]


def test_coldest_takes_dead_chains_first_then_the_lowest_rate_never_the_latest_request() -> None:
    h = ChainHazard(bin_requests=4, max_age=12)
    h.observe(0, [0, 1, 2])
    for i in range(1, 8):
        h.observe(i, [0, 100 + i])
    h.observe(8, [0, 1, 2, 3])  # continues request 0 at age 8: ages 8-11 have a rate, 0-7 none
    for i in range(9, 17):
        h.observe(i, [0, 200 + i])
    # at request 16: request 4 (age 12, chunk 104) still live; requests 1-3 (chunks 101-103) aged out
    assert 101 not in [b for j in h.live.values() for b in j] and 4 in h.live
    resident = [101, 104, 105, 108, 1, 209, 213, 216, 0]  # oldest first, as an LRU holds them
    assert h.rate(8, 16) > 0.0 and h.rate(13, 16) == 0.0  # request 8 is at age 8: the learned peak
    out = h.coldest(resident, 4)
    assert out[0] == 101  # a chain no longer live goes first, in LRU order
    assert 1 not in out and 216 not in out and 0 not in out  # the peak-age chain; the latest request
    assert h.coldest(resident, 20, keep={101}) == [b for b in h.coldest(resident, 20) if b != 101]
    assert h.coldest(resident, 0) == []


def test_last_users_are_bounded() -> None:
    h = ChainHazard(max_keys=5)
    for i in range(10):
        h.observe(i, [1000 + i])
    assert len(h.last_user) == 5 and 1009 in h.last_user and 1000 not in h.last_user
