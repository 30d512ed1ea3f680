"""Speculative decoding's proposer and its gate, as pure logic (the engine's use of them: tests/model/)."""

from __future__ import annotations

from tokenmill.engine.request import Sequence
from tokenmill.engine.spec import AcceptanceGate, NgramProposer, SuffixCacheProposer
from tokenmill.sampling import SamplingParams


def make(seq_id: int) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=8), detokenizer=None,
                    sink=lambda _: None)


def test_ngram_lookup_takes_the_longest_latest_match() -> None:
    proposer = NgramProposer(2, 3)
    assert proposer.lookup([1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 2, 3], 2) == [7, 7]  # "2 3": the latest occurrence
    assert proposer.lookup([1, 2, 3, 5, 2, 3, 6, 1, 2, 3], 3) == [5, 2, 3]  # "1 2 3" beats the later "2 3"
    assert proposer.lookup([1, 2, 3, 4], 2) == [] and proposer.lookup([5, 5], 4) == []
    assert proposer.lookup([4, 4, 4], 4) == [4]  # the suffix itself is not a match; what follows is cut at the end


def test_proposals_that_keep_failing_pause_longer_and_longer_and_good_ones_never() -> None:
    gate = AcceptanceGate()
    bad, good = make(0), make(1)
    asked = []
    for _ in range(200):
        if gate.allows(bad):
            asked.append(True)
            gate.record(bad, 4, 0)
        else:
            asked.append(False)
        assert gate.allows(good)
        gate.record(good, 4, 2)  # half accepted: above the threshold
    runs = "".join("x" if a else "." for a in asked)
    # The average falls below 0.2 after 5 misses from 1.0, then after 2 from 0.4; pauses 8, 16, 32, 64, 128 steps.
    assert runs.startswith("xxxxx" + "." * 8 + "xx" + "." * 16 + "xx" + "." * 32 + "xx" + "." * 64 + "xx")
    assert asked.count(True) == 5 + 2 * 4  # the fifth pause, of 128 steps, runs past the 200th
    gate.record(bad, 4, 4)
    gate.record(bad, 4, 4)  # a good stretch: the next pause starts short again
    assert bad.speculation.cooldown == 0


def test_the_suffix_cache_proposes_what_followed_in_earlier_requests() -> None:
    proposer = SuffixCacheProposer(2, 3, capacity=100)
    assert proposer.lookup([7, 8, 9], 2) == []
    proposer.learn([1, 2, 3, 4, 5, 6])
    assert proposer.lookup([9, 2, 3], 2) == [4, 5]  # "2 3" last led to 4 5
    assert proposer.lookup([9, 1, 2, 3], 4) == [4, 5, 6]  # the longest match, cut at the end of what was learned
    proposer.learn([0, 2, 3, 7])
    assert proposer.lookup([2, 3], 2) == [7]  # the latest request wins
    assert proposer.lookup([2, 3, 9, 2, 3], 2) == [9, 2]  # the sequence's own tokens come first
    proposer.learn(list(range(100, 200)))  # 2 x 98 n-grams: the earliest are evicted
    assert len(proposer.index) == 100 and proposer.lookup([1, 2, 3], 2) == []
