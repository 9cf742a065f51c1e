"""The cross-request suffix store (serving/decoding/suffix.py): what it proposes, when it declines, and
its bounded memory."""
import threading

import pytest

from serving.decoding.suffix import SEP, SuffixStore


def test_proposes_what_followed_an_earlier_answer():
    s = SuffixStore()
    s.add([1, 2], [10, 11, 12, 13, 14])
    assert s.propose([7, 10, 11], 3) == [12, 13, 14]
    assert s.propose([7, 10, 11], 2) == [12, 13]
    assert s.propose([1, 2], 2) == [10, 11]            # the prompt's tail leads into the answer's opening
    assert s.propose([5, 6], 3) == []                   # never seen
    assert s.propose([11], 3) == []                     # shorter than the key
    assert s.propose([10, 11], 0) == []


def test_stops_at_the_end_of_an_answer():
    s = SuffixStore()
    s.add([], [3, 4, 5])
    assert s.propose([3, 4], 5) == [5]                  # then SEP: nothing beyond the answer
    assert SEP not in s.propose([4, 5], 5)


def test_majority_vote_and_min_support():
    s = SuffixStore(min_support=0.5)
    for _ in range(3):
        s.add([], [1, 2, 3, 4])
    s.add([], [1, 2, 9, 9])
    assert s.propose([1, 2], 2) == [3, 4]               # 3 of 4 continue with 3
    tie = SuffixStore(min_support=0.6)
    tie.add([], [1, 2, 3])
    tie.add([], [1, 2, 7])
    assert tie.propose([1, 2], 2) == []                 # 1 of 2 is below 0.6: decline


def test_longest_match_wins_over_the_majority():
    s = SuffixStore()
    for _ in range(3):
        s.add([], [8, 1, 2, 3])
    s.add([], [9, 5, 1, 2, 7])
    # the context's last three tokens (5, 1, 2) match only the last answer: its continuation wins
    assert s.propose([0, 5, 1, 2], 1) == [7]
    assert s.propose([0, 8, 1, 2], 1) == [3]


def test_capacity_is_bounded_and_keeps_the_newest():
    s = SuffixStore(capacity=16 * 12, max_match=12)
    for i in range(200):
        s.add([], [1000 + i, 1, 2, 2000 + i])
    assert len(s) <= s.capacity
    assert s.propose([1199, 1, 2], 1) == [2199]          # the newest survives
    assert s.propose([1000, 1, 2], 1) != [2000]          # the oldest was evicted
    assert all(len(s.positions(divmod(k, 1 << 24))) <= 2 * s.per_key for k in s.index)
    assert s.tokens[-1] == SEP and (s.tokens[0] != SEP)


def test_per_key_keeps_the_newest_candidates():
    s = SuffixStore(per_key=4)
    for i in range(20):
        s.add([], [1, 2, 100 + i])
    assert len(s.positions((1, 2))) <= 8
    assert s.propose([1, 2], 1) == []                    # the 4 newest disagree (one vote each)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        SuffixStore(key_len=0)
    with pytest.raises(ValueError):
        SuffixStore(min_support=0)
    with pytest.raises(ValueError):
        SuffixStore(capacity=10)


def test_concurrent_adds_and_proposals():
    s = SuffixStore(capacity=4096)
    errors = []

    def writer(base):
        try:
            for i in range(300):
                s.add([base], [base, i % 7, (i + 1) % 7, (i + 2) % 7])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader():
        try:
            for i in range(2000):
                out = s.propose([i % 7, (i + 1) % 7], 2)
                assert all(t >= 0 for t in out)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(b,)) for b in (100, 200)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(s) <= s.capacity


def test_the_rebuild_runs_off_the_lock_and_keeps_answers_added_meanwhile():
    s = SuffixStore(capacity=16 * 12, max_match=12)
    rebuild = s._index_all
    seen = {}

    def slow_rebuild(index, toks, start=0):
        if toks is not s.tokens and start == 0 and not seen:
            # another replica thread, while this one rebuilds: it must neither wait nor be lost
            newest = s.answers - 1                           # the answer whose add triggered the rebuild

            def other():
                seen["proposal"] = (s.propose([1000 + newest, 1, 2], 1), [2000 + newest])
                seen["added"] = s.add([], [7777, 5, 6, 8888])
            t = threading.Thread(target=other)
            t.start()
            t.join(timeout=10)
            seen["waited"] = t.is_alive()
        rebuild(index, toks, start)

    s._index_all = slow_rebuild
    i = 0
    while s.compactions == 0:
        s.add([], [1000 + i, 1, 2, 2000 + i])
        i += 1
    assert s.compactions == 1 and seen["waited"] is False    # the other thread finished during the rebuild
    assert seen["proposal"][0] == seen["proposal"][1] and seen["added"] is True
    assert s.propose([7777, 5, 6], 1) == [8888]              # the answer added meanwhile survived the swap
    assert len(s) <= s.capacity and s.tokens[-1] == SEP
    # the index after the swap matches one built from scratch over the same tokens
    fresh = {}
    rebuild(fresh, s.tokens)
    assert fresh == s.index


def test_the_index_is_invisible_to_the_garbage_collector():
    """Int keys and bytearray buckets: the index dict stays untracked, so a full store adds nothing to the walk
    of a replica's full collections (a replica tracks about 560,000 objects; a full collection took 0.5 s)."""
    import gc

    s = SuffixStore(capacity=4096)
    for i in range(300):
        s.add([i], [i, (i * 7) % 50, (i * 11) % 50, 3, 4])
    assert len(s.index) > 100
    assert not gc.is_tracked(s.index) and not any(gc.is_tracked(b) for b in s.index.values())
    assert s.positions((3, 4)) and all(s.tokens[p] == SEP for p in s.positions((3, 4)))   # each answer ends 3, 4


def test_an_answer_longer_than_the_store_is_not_kept():
    s = SuffixStore(capacity=16 * 12, max_match=12)
    s.add([], [1, 2, 3])
    s.add([], list(range(100, 100 + 400)))
    assert len(s) <= s.capacity
    assert s.propose([100, 101], 1) == []
