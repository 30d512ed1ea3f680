from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tokenmill import backend
from tokenmill.engine import sampler as sampler_module
from tokenmill.engine.request import Sequence
from tokenmill.engine.sampler import Sampler, seeded_generator
from tokenmill.sampling import SamplingParams

VOCAB = 50
EOS = 7
KERNELS = backend.cpu_kernels(torch.device("cpu"))


@pytest.fixture(autouse=True, params=["kernels", "torch"])
def sampling_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on both ways the sampler picks: the C++ kernels (kernels/sample.cpp) where they run, and the torch
    ops that a GPU and a machine without them take."""
    if request.param == "kernels" and not KERNELS:
        pytest.skip("the C++ kernels are unavailable here")
    if request.param == "torch":
        monkeypatch.setattr(sampler_module.backend, "cpu_kernels", lambda device: False)
    return request.param


def seq(seq_id: int = 0, output: list[int] | None = None, prompt: list[int] | None = None, **params) -> Sequence:
    p = SamplingParams(**{"max_tokens": 100, **params})
    gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    return Sequence(seq_id=seq_id, prompt_ids=prompt or [1, 2, 3], params=p, detokenizer=None,
                    sink=lambda _: None, generator=gen, output_ids=list(output or []))


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def new_sampler(seed: int = 0) -> Sampler:
    return Sampler({EOS}, torch.device("cpu"), seed)


def probabilities(*head: float) -> torch.Tensor:
    """[1, VOCAB] logits whose softmax is head, then (almost) nothing."""
    return torch.log(torch.tensor([[*head] + [1e-12] * (VOCAB - len(head))]))


def draws(s: Sampler, x: torch.Tensor, seq: Sequence, n: int = 300) -> set[int]:
    return {s(x.clone(), [seq])[0][0] for _ in range(n)}


def test_greedy_is_argmax_and_top_k_1_is_greedy() -> None:
    sampler = new_sampler()
    x = logits(4)
    greedy, _ = sampler(x.clone(), [seq(i, temperature=0.0) for i in range(4)])
    assert greedy == x.argmax(-1).tolist()
    top1, _ = sampler(x.clone(), [seq(i, temperature=1.5, top_k=1) for i in range(4)])
    assert top1 == greedy


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    x = logits(1) / 3  # flat enough that twenty draws differ

    def draws(batch_of: int, n: int = 20) -> list[int]:
        """n draws of a seed-42 sequence sitting last in a batch with other, unseeded sequences."""
        sampler = new_sampler(seed=batch_of)
        mine = seq(batch_of, seed=42)
        others = [seq(i, top_p=0.5) for i in range(batch_of)]
        batch = torch.cat([logits(batch_of, seed=5), x]) if batch_of else x
        return [sampler(batch.clone(), [*others, mine])[0][-1] for _ in range(n)]

    alone = draws(0)
    assert draws(3) == alone and draws(7) == alone
    assert len(set(alone)) > 1, "a seeded stream advances: it should not repeat one token at temperature 1"


def test_sampling_follows_the_distribution() -> None:
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (VOCAB - 3)]))
    sampler = new_sampler()
    s = seq(seed=3)
    counts = torch.zeros(VOCAB)
    for _ in range(2000):
        counts[sampler(x.clone(), [s])[0][0]] += 1
    freq = counts / counts.sum()
    assert abs(freq[0] - 0.7) < 0.05 and abs(freq[1] - 0.2) < 0.05 and abs(freq[2] - 0.1) < 0.04


def test_top_p_and_min_p_cut_the_tail() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    sampler = new_sampler()
    top_p, min_p = seq(seed=1, top_p=0.75), seq(seed=1, min_p=0.5)
    seen_p = {sampler(x.clone(), [top_p])[0][0] for _ in range(300)}
    seen_min = {sampler(x.clone(), [min_p])[0][0] for _ in range(300)}
    assert seen_p == {0, 1}  # 0.5 + 0.3 reaches 0.75; 0.15 and below never drawn
    assert seen_min == {0, 1}  # min_p 0.5 keeps p >= 0.25


def test_logit_bias_penalties_and_min_tokens() -> None:
    sampler = new_sampler()
    x = torch.zeros(1, VOCAB)
    x[0, EOS] = 5.0
    assert sampler(x.clone(), [seq(temperature=0.0, logit_bias={11: 100.0})])[0] == [11]
    assert sampler(x.clone(), [seq(temperature=0.0, min_tokens=2, output=[1])])[0] != [EOS]
    assert sampler(x.clone(), [seq(temperature=0.0, min_tokens=1, output=[1])])[0] == [EOS]
    # frequency penalty: EOS seen 3 times in the output at 2.0 each -> 5 - 6 < 0, token 0 wins
    x[0, 0] = 0.5
    assert sampler(x.clone(), [seq(temperature=0.0, frequency_penalty=2.0, output=[EOS] * 3)])[0] == [0]
    assert sampler(x.clone(), [seq(temperature=0.0, presence_penalty=2.0, output=[EOS] * 3)])[0] == [EOS]
    # repetition penalty divides a positive logit of a seen token (prompt included)
    assert sampler(x.clone(), [seq(temperature=0.0, repetition_penalty=2.0, prompt=[EOS])])[0] == [EOS]  # 2.5 > 0.5
    x[0, 0] = 3.0
    assert sampler(x.clone(), [seq(temperature=0.0, repetition_penalty=2.0, prompt=[EOS])])[0] == [0]  # 2.5 < 3


def test_logprobs_are_of_the_raw_distribution() -> None:
    sampler = new_sampler()
    x = logits(2)
    tokens, lps = sampler(x.clone(), [seq(0, temperature=0.0, logprobs=3), seq(1, temperature=0.0)])
    assert lps[1] is None
    expected = x[0].log_softmax(-1)
    assert abs(lps[0].logprob - expected[tokens[0]].item()) < 1e-5
    assert [t for t, _ in lps[0].top] == expected.topk(3).indices.tolist()


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_logprobs_are_taken_before_temperature_filters_penalties_and_bias(temperature: float) -> None:
    """As vLLM and the README say: a sampled token's logprob and its top alternatives' are those of the model's own
    distribution, whatever the temperature, top-k/top-p, penalties and bias that chose it (temperature keeps the
    order of the alternatives, so their values are compared, not only their ids)."""
    x = logits(3)
    seqs = [seq(0, temperature=temperature, logprobs=4, seed=1),
            seq(1, temperature=temperature, logprobs=2, top_k=5, top_p=0.9),
            seq(2, temperature=temperature, logprobs=3, output=[4, 4], logit_bias={4: 5.0, 9: -100.0},
                presence_penalty=1.0, repetition_penalty=1.3)]
    tokens, lps = new_sampler()(x.clone(), seqs)
    expected = x.log_softmax(-1)
    for row, (token, entry) in enumerate(zip(tokens, lps, strict=True)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(expected[row, token].item(), abs=1e-5)
        best = expected[row].topk(seqs[row].params.logprobs)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=1e-5)


def test_penalties_and_bias_move_the_winner() -> None:
    s = new_sampler()
    x = torch.zeros(1, VOCAB)
    x[0, 3], x[0, 4] = 5.0, 4.0
    assert s(x.clone(), [seq(temperature=0.0, logit_bias={4: 2.0})])[0] == [4]  # 6 > 5: added, not set
    assert s(x.clone(), [seq(temperature=0.0, logit_bias={3: -2.0})])[0] == [4]
    assert s(x.clone(), [seq(temperature=0.0, presence_penalty=2.0, output=[3])])[0] == [4]  # seen once
    assert s(x.clone(), [seq(temperature=0.0, frequency_penalty=1.0, output=[3, 3])])[0] == [4]
    assert s(x.clone(), [seq(temperature=0.0, presence_penalty=2.0, output=[3, 3, 3])])[0] == [4]  # once, not 3x
    assert s(x.clone(), [seq(temperature=0.0, presence_penalty=0.5, output=[3, 3])])[0] == [3]  # 4.5 > 4
    x[0, 4] = 4.5
    assert s(x.clone(), [seq(temperature=0.0, presence_penalty=1.0, output=[3])])[0] == [4]  # 4 < 4.5
    x[0, 4] = 4.0
    # a shorter output's padding is not a token: 1, unseen in the second row, keeps its logit there
    x[0, 1] = 4.5
    batch = [seq(0, temperature=0.0, frequency_penalty=1.0, output=[3, 7, 7]),
             seq(1, temperature=0.0, frequency_penalty=1.0, output=[3])]
    assert s(x.clone().repeat(2, 1), batch)[0] == [1, 1]
    x[0, 1] = 0.0
    x[0, 0] = 6.0  # token 0 is a token like any other, not padding
    assert s(x.clone(), [seq(temperature=0.0, frequency_penalty=1.5, output=[0, 0])])[0] == [3]


def test_repetition_penalty_shrinks_small_positive_logits_and_grows_negative_ones() -> None:
    s = new_sampler()
    x = torch.full((1, VOCAB), -5.0)
    x[0, 3], x[0, 4] = 0.5, 0.4
    assert s(x.clone(), [seq(temperature=0.0, repetition_penalty=2.0, prompt=[3])])[0] == [4]  # 0.25 < 0.4
    x[0, 3], x[0, 4] = -0.5, -0.6
    assert s(x.clone(), [seq(temperature=0.0, repetition_penalty=2.0, prompt=[3])])[0] == [4]  # -1.0 < -0.6
    assert s(x.clone(), [seq(temperature=0.0, repetition_penalty=0.5, prompt=[4])])[0] == [4]  # -0.3 > -0.5


def test_top_p_keeps_the_smallest_head_that_reaches_it() -> None:
    s = new_sampler()
    x = probabilities(0.5, 0.25, 0.125, 0.125)
    assert draws(s, x, seq(seed=1, top_p=0.75)) == {0, 1}  # 0.5 + 0.25 reaches 0.75: 2 is out
    assert draws(s, x, seq(seed=1, top_p=0.76)) == {0, 1, 2}


def test_top_k_alone_and_beside_top_p() -> None:
    s = new_sampler()
    flat = torch.zeros(1, VOCAB)
    assert len(draws(s, flat, seq(seed=2, top_k=3), n=200)) == 3
    batch = [seq(0, seed=2, top_k=3), seq(1, seed=3, top_p=0.5)]
    seen = {s(flat.clone().repeat(2, 1), batch)[0][0] for _ in range(200)}
    assert len(seen) == 3
    # top_p 1 beside top_k 3, where the kept head's cumulative sum rounds to just under 1: the tail (half the mass
    # before the cut) stays cut
    head_and_tail = torch.log(torch.tensor([[0.425, 0.05, 0.025] + [0.5 / (VOCAB - 3)] * (VOCAB - 3)]))
    assert draws(s, head_and_tail, seq(seed=4, top_k=3, top_p=1.0)) == {0, 1, 2}


def test_min_p_is_relative_to_each_rows_best_token() -> None:
    s = new_sampler()
    x = torch.cat([probabilities(0.5, 0.25, 0.2, 0.05), probabilities(0.2, 0.2, 0.2, 0.2, 0.2)])
    batch = [seq(0, seed=4, min_p=0.5), seq(1, seed=5, min_p=0.5)]
    seen: list[set[int]] = [set(), set()]
    for _ in range(300):
        for row, token in enumerate(s(x.clone(), batch)[0]):
            seen[row].add(token)
    assert seen == [{0, 1}, {0, 1, 2, 3, 4}]  # 0.25 is half the best: kept


def test_the_last_token_of_the_vocabulary_can_be_drawn() -> None:
    x = torch.zeros(1, VOCAB)
    x[0, -1] = 8.0
    assert draws(new_sampler(), x, seq(seed=6), n=50) == {VOCAB - 1}


def test_unseeded_requests_draw_from_the_servers_seed() -> None:
    x = logits(1) / 3

    def sample(server_seed: int) -> list[int]:
        s = new_sampler(server_seed)
        return [s(x.clone(), [seq()])[0][0] for _ in range(20)]

    assert sample(5) == sample(5) != sample(6)


def test_a_batch_draws_what_its_rows_would_draw_one_at_a_time() -> None:
    """The unseeded rows take the shared stream's numbers in row order (one draw for them all), a seeded row its
    own stream's: steps of a batch sample what the same rows sampled one by one would."""
    x = torch.zeros(3, VOCAB)  # every token equally likely: the token shows the draw

    def rows() -> list[Sequence]:
        return [seq(0, temperature=1.0), seq(1, temperature=1.0, seed=3), seq(2, temperature=1.0)]

    batched, alone = new_sampler(5), new_sampler(5)
    batch, single = rows(), rows()
    for _ in range(10):
        assert batched(x.clone(), batch)[0] == [alone(x[:1].clone(), [row])[0][0] for row in single]


class PlacedOn(TorchFunctionMode):
    """Fails a tensor factory called without device=the logits' device: on a GPU, that tensor would be on the host
    (a CPU-only machine cannot tell otherwise)."""

    FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.rand,
                 torch.randn, torch.randint}

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES:
            assert kwargs.get("device") == self.device, f"torch.{func.__name__} without device={self.device}"
        return func(*args, **kwargs)


def test_every_tensor_is_made_on_the_logits_device() -> None:
    def batch() -> list[Sequence]:
        return [seq(0, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=1, logit_bias={4: 1.0}, min_tokens=3,
                    frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.2, logprobs=2, output=[1, 2]),
                seq(1, temperature=1.0, logprobs=0), seq(2, temperature=0.0)]

    def unseeded() -> list[Sequence]:  # their draws in one call
        return [seq(0, temperature=0.7), seq(1, temperature=1.0)]

    x = logits(3)
    for rows in (batch, unseeded):
        with PlacedOn(x.device):
            placed = new_sampler()(x[:len(rows())].clone(), rows())
        assert placed == new_sampler()(x[:len(rows())].clone(), rows())


def test_a_draw_at_either_end_lands_on_a_token_that_can_be_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    x = probabilities(0.0, 0.5, 0.5, 0.0)
    x[0, 0] = x[0, 3] = float("-inf")  # 0 and 3 (and all after) cannot be drawn
    x[0, 4:] = float("-inf")
    for draw, token in ((0.0, 1), (1 - 2**-24, 2)):
        monkeypatch.setattr(torch, "rand", lambda *a, value=draw, **k: torch.full((1,), value))
        assert new_sampler()(x.clone(), [seq(temperature=1.0)])[0] == [token]


def test_logprobs_for_every_row_with_k_of_zero() -> None:
    x = logits(2)
    tokens, lps = new_sampler()(x.clone(), [seq(0, temperature=0.0, logprobs=0), seq(1, seed=3, logprobs=1)])
    expected = x.log_softmax(-1)
    for row in range(2):
        assert lps[row].token_id == tokens[row]
        assert abs(lps[row].logprob - expected[row, tokens[row]].item()) < 1e-5
    assert lps[0].top == [] and [t for t, _ in lps[1].top] == [expected[1].argmax().item()]


def test_verify_keeps_proposals_while_each_sample_equals_them() -> None:
    """A speculative step: position j is sampled as plain decoding would sample it after the tokens accepted before
    it (here a presence penalty on them flips the last position's winner), and the run stops at the first sample
    that differs from the proposal, which is kept in its place."""
    x = torch.zeros(4 + 3, 8)
    x[0, 5], x[1, 6], x[2, 5], x[3, 7] = 3.0, 3.0, 3.0, 3.0  # a: proposals 5, 6, then its own pick
    x[2, 1] = 2.5  # ... where 5 wins by 0.5 unless its earlier acceptance counts: presence penalty 1
    x[4, 2], x[5, 4], x[6, 3] = 3.0, 3.0, 3.0  # b: proposals 2, 9: the second misses
    a, b = seq(0, output=[0], presence_penalty=1.0, temperature=0.0), seq(1, output=[0], temperature=0.0)
    tokens, logprobs = new_sampler().verify(x, [a, b], [[5, 6, 5], [2, 9]])
    assert tokens == [[5, 6, 1], [2, 4]] and [len(lp) for lp in logprobs] == [3, 2]
    assert a.output_ids == [0] and b.output_ids == [0]  # the scheduler appends them, not the sampler


def chi_square(counts: Counter[int], expected: list[float], n: int) -> float:
    return sum((counts[token] - n * p) ** 2 / (n * p) for token, p in enumerate(expected))


CHI2_3DF_P001 = 16.27  # the chi-square distribution's 0.999 quantile at 3 degrees of freedom (any table)


def test_verify_samples_every_position_from_the_plain_distribution() -> None:
    """Lossless in distribution, not only under a seed: with proposals [0, 1], the first token of 4,000 sequences
    follows row 0's distribution (what plain decoding draws from) whatever was proposed, the second, drawn where the
    first equalled its proposal, row 1's, and a third follows only where both matched. Chi-square at p = 0.001 with
    a fixed seed; a verify that kept proposals more often than its samples matched them fails it."""
    n, p0, p1 = 4000, [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]
    x = torch.cat([probabilities(*p0), probabilities(*p1), probabilities(0.25, 0.25, 0.25, 0.25)]).repeat(n, 1)
    plain, _ = new_sampler(seed=1)(x[0::3].clone(), [seq(i, temperature=1.0) for i in range(n)])
    tokens, _ = new_sampler(seed=0).verify(x, [seq(i, temperature=1.0) for i in range(n)], [[0, 1]] * n)
    assert chi_square(Counter(plain), p0, n) < CHI2_3DF_P001  # the plain draw itself, for reference
    assert chi_square(Counter(t[0] for t in tokens), p0, n) < CHI2_3DF_P001
    seconds = [t[1] for t in tokens if t[0] == 0]
    assert chi_square(Counter(seconds), p1, len(seconds)) < CHI2_3DF_P001
    assert all(len(t) == 1 + (t[0] == 0) + (t[0] == 0 and t[1] == 1) for t in tokens)


def test_a_seeds_64_bits_all_count_and_small_seeds_keep_their_streams() -> None:
    """torch's CPU generator keeps a seed's low 32 bits: seeds that differ above them drew the same numbers. Folded
    in, they differ; a seed below 2**32 draws what torch's own seeding of it draws (seeded answers stay as they
    were), and a negative seed what its two's complement does."""
    cpu = torch.device("cpu")

    def draws(seed: int) -> list[float]:
        return torch.rand(4, generator=seeded_generator(seed, cpu)).tolist()

    assert len({tuple(draws(s)) for s in (0, -1, 5, 5 + 2**32, 5 + 2**40, 5 + 2**63)}) == 6
    for seed in (0, 7, 2**32 - 1):
        assert draws(seed) == torch.rand(4, generator=torch.Generator().manual_seed(seed)).tolist()
    assert draws(-3) == draws(2**64 - 3)


def reference_draw(x: torch.Tensor, top_k: int, top_p: float, min_p: float, u: float) -> tuple[int, bool]:
    """One row's draw in float64 by the sampler's definition, the vocabulary sorted whole: the top k (larger logit,
    then smaller token, first), then the smallest head whose mass reaches top_p, then the tokens within min_p of the
    best, then the first token whose cumulative mass in vocabulary order passes u times the total. Also whether the
    draw is clear of rounding: u and each cut at least 1e-6 from a boundary."""
    x = x.double()
    vocab, m = x.numel(), x.max().item()
    order = sorted(range(vocab), key=lambda j: (-x[j].item(), j))
    kept = order[:top_k] if 0 < top_k < vocab else order
    clear = True
    if top_p < 1:
        p = torch.exp(x[kept] - m)
        p /= p.sum()
        before = torch.cumsum(p, 0) - p
        n = next((i for i in range(1, len(kept)) if before[i] >= top_p), len(kept))
        clear &= bool((before - top_p).abs().min() > 1e-6)
        kept = kept[:n]
    if min_p > 0:
        gaps = x[kept] - m - math.log(min_p)
        clear &= bool(gaps.abs().min() > 1e-6)
        kept = [j for j, gap in zip(kept, gaps.tolist(), strict=True) if gap >= 0]
    weights = torch.zeros(vocab, dtype=torch.float64)
    weights[kept] = torch.exp(x[kept] - m)
    cdf = torch.cumsum(weights, 0) / weights.sum()
    token = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True).item())
    clear &= bool((cdf[kept] - u).abs().min() > 1e-6)
    return token, clear


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [
    (0, 1.0, 0.0), (5, 1.0, 0.0), (1, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.3, 0.0), (40, 0.8, 0.0), (0, 1.0, 0.05),
    (0, 0.95, 0.1), (2000, 0.5, 0.0), (3, 0.99, 0.2),
])
def test_draws_are_the_definitions_draws(top_k: int, top_p: float, min_p: float) -> None:
    """64 rows of 1,000 logits at temperature 0.7, each with its own seed, drawn in one batch: every row's token is
    the float64 definition's (reference_draw), where the draw and the cuts are clear of rounding."""
    rows, vocab, temperature = 64, 1000, 0.7
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(top_k + int(100 * top_p))) * 2.5
    batch = [seq(i, seed=1000 + i, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
             for i in range(rows)]
    got, _ = new_sampler()(x.clone(), batch)
    scaled = x / torch.tensor([temperature])[:, None]
    compared = 0
    for i in range(rows):
        u = torch.rand(1, generator=torch.Generator().manual_seed(1000 + i)).item()
        want, clear = reference_draw(scaled[i], top_k, top_p, min_p, u)
        if clear:
            compared += 1
            assert got[i] == want, f"row {i}"
    assert compared >= rows * 3 // 4


@pytest.mark.skipif(not KERNELS, reason="the C++ kernels are unavailable here")
def test_the_greedy_kernel_picks_as_argmax_does() -> None:
    """Ties go to the first index, a NaN wins (the first of them), a row of -inf picks 0; one long row is cut into
    parts for the threads, which must merge in order."""
    x = torch.randn(6, 100_003, generator=torch.Generator().manual_seed(0))
    x[0, [10, 70_000]] = 9.0  # a tie, in two parts of a row cut for two threads
    x[1, [5_000, 90_000]] = float("nan")
    x[2] = float("-inf")
    x[3, -1] = 9.0  # the very last token
    x[4] = 0.0  # all tied
    x[5, [99_000, 3]] = float("inf")
    for rows in (x, x[:1], x[1:2], x[3:4]):
        assert torch.equal(torch.ops.tokenmill.argmax_rows(rows), rows.argmax(dim=-1))
    wide = torch.randn(32, 5_000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.ops.tokenmill.argmax_rows(wide), wide.argmax(dim=-1))


def test_the_edges_of_each_parameter_draw_the_best_token_or_any() -> None:
    """What the API lets through at its limits: top_p just above 0, min_p 1 and a temperature of 1e-6 keep only the
    best token; top_k past the vocabulary (up to 2**31 - 1) and one under it cut nothing a draw could notice; banned
    (-inf) tokens are never drawn."""
    x = logits(4, seed=9)
    best = x.argmax(dim=-1).tolist()
    s = new_sampler()
    for params in ({"top_p": 1e-9}, {"min_p": 1.0}, {"temperature": 1e-6}, {"top_k": 1, "top_p": 1e-9}):
        assert s(x.clone(), [seq(i, seed=i, **params) for i in range(4)])[0] == best
    for top_k in (2**31 - 1, VOCAB, VOCAB - 1):
        drawn = {t for _ in range(40) for t in s(x.clone(), [seq(i, top_k=top_k) for i in range(4)])[0]}
        assert drawn <= set(range(VOCAB)) and len(drawn) > 4
    banned = x.clone()
    banned[:, ::2] = float("-inf")
    assert all(t % 2 == 1 for _ in range(40) for t in s(banned.clone(), [seq(i) for i in range(4)])[0])
