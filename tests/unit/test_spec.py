"""Speculative decoding's proposer and its gate, as pure logic (the engine's use of them: tests/model/)."""

from __future__ import annotations

import pytest

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


def test_a_gate_pauses_below_low_and_resets_its_pause_from_high_on() -> None:
    """A rate at exactly `low` is not below it; one at exactly `high` ends the doubling of pauses (the rate is the
    share of proposals accepted: 1 of 8 is below 0.2, whatever the count)."""
    gate = AcceptanceGate(low=0.5, high=0.75, weight=1.0)
    seq = make(0)
    gate.record(seq, 2, 1)  # rate 0.5
    assert gate.allows(seq) and seq.speculation.skip == 0
    gate.record(seq, 4, 1)  # rate 0.25: paused
    assert not gate.allows(seq) and seq.speculation.cooldown == 8
    gate.record(seq, 4, 3)  # rate 0.75, exactly high
    assert seq.speculation.cooldown == 0
    few = make(1)
    default = AcceptanceGate()
    for _ in range(7):
        default.record(few, 8, 1)
    assert few.speculation.skip == 8  # 1 in 8 accepted, 0.125: paused after 7 (the average from 1.0)


def test_prompt_lookup_n_grams_range_from_min_n_to_max_n() -> None:
    """n-grams of one token alone are allowed; a match shorter than min_n proposes nothing."""
    assert NgramProposer(1, 1).lookup([5, 6, 7, 5], 2) == [6, 7]
    assert NgramProposer(2, 2).lookup([5, 6, 7, 5, 6], 2) == [7, 5]
    assert NgramProposer(2, 3).lookup([5, 6, 7, 5], 2) == []  # only "5" repeats


def test_a_lookup_proposes_up_to_k_tokens_and_none_for_k_of_zero_or_less() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    for proposer in (NgramProposer(1, 2), SuffixCacheProposer(1, 2)):
        assert proposer.lookup(tokens, 1) == [2]
        assert proposer.lookup(tokens, 0) == [] and proposer.lookup(tokens, -2) == []
    cache = SuffixCacheProposer(2, 3)
    cache.learn([1, 2, 3, 4])
    assert cache.lookup([9, 2, 3], 1) == [4] and cache.lookup([9, 2, 3], 0) == []


def test_the_suffix_cache_indexes_the_n_grams_of_min_n_to_max_n_tokens() -> None:
    proposer = SuffixCacheProposer(2, 3)
    proposer.learn([1, 2, 3, 4, 5, 6])
    assert sorted(proposer.index) == [(1, 2), (1, 2, 3), (2, 3), (2, 3, 4), (3, 4), (3, 4, 5), (4, 5)]


def test_the_suffix_cache_holds_200_000_n_grams_by_default() -> None:
    proposer = SuffixCacheProposer(1, 1)
    proposer.learn(list(range(200_002)))  # 200,001 one-token n-grams followed by a token
    assert len(proposer.index) == 200_000 and (0,) not in proposer.index and (1,) in proposer.index


def test_proposals_look_up_each_sequence_s_prompt_and_output() -> None:
    """propose() looks in each sequence's whole token list, k[i] tokens for the i-th."""
    a = Sequence(seq_id=0, prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=8), detokenizer=None,
                 sink=lambda _: None, output_ids=[5, 6])
    b = Sequence(seq_id=1, prompt_ids=[1, 2, 3, 1, 2], params=SamplingParams(max_tokens=8), detokenizer=None,
                 sink=lambda _: None)
    assert NgramProposer(2, 3).propose([a, b], [2, 1]) == [[7, 5], [3]]
    with pytest.raises(ValueError):  # one k per sequence, not fewer
        NgramProposer(2, 3).propose([a, b], [2])


def test_a_finished_sequence_teaches_the_suffix_cache_unless_it_failed_or_was_an_embedding() -> None:
    proposer = SuffixCacheProposer(2, 2)
    taught = Sequence(seq_id=0, prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=8), detokenizer=None,
                      sink=lambda _: None, output_ids=[4], finish_reason="stop")
    proposer.finish(taught)
    assert proposer.lookup([9, 1, 2], 3) == [3, 4]  # from its first token to its last
    for reason, pooling in (("error", None), ("stop", "mean")):
        other = Sequence(seq_id=1, prompt_ids=[7, 8, 9], params=SamplingParams(max_tokens=8), detokenizer=None,
                         sink=lambda _: None, finish_reason=reason, pooling=pooling)
        proposer.finish(other)
        assert proposer.lookup([0, 7, 8], 1) == []


def test_a_lookup_with_no_room_to_propose_leaves_the_cache_s_order_alone() -> None:
    """A sequence with one token left asks for none: the n-gram it ends with is not refreshed by that, so the least
    recently learned one is still the first evicted."""
    proposer = SuffixCacheProposer(1, 1, capacity=2)
    proposer.learn([1, 2])
    proposer.learn([3, 4])
    assert proposer.lookup([1], 0) == []
    proposer.learn([5, 6])
    assert proposer.lookup([1], 1) == [] and proposer.lookup([3], 1) == [4]
