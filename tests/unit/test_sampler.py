from __future__ import annotations

import torch

from tokenmill.engine.request import Sequence
from tokenmill.engine.sampler import Sampler
from tokenmill.sampling import SamplingParams

VOCAB = 50
EOS = 7


def seq(seq_id: int = 0, output: list[int] | None = None, prompt: list[int] | None = None, **params) -> Sequence:
    p = SamplingParams(**params)
    gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    return Sequence(seq_id=seq_id, prompt_ids=prompt or [1, 2, 3], params=p, max_tokens=100, detokenizer=None,
                    sink=lambda _: None, generator=gen, output_ids=list(output or []))


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_top_k_1_is_greedy() -> None:
    sampler = Sampler({EOS}, torch.device("cpu"))
    x = logits(4)
    greedy, _ = sampler(x.clone(), [seq(i, temperature=0.0) for i in range(4)])
    assert greedy == x.argmax(-1).tolist()
    top1, _ = sampler(x.clone(), [seq(i, temperature=1.5, top_k=1) for i in range(4)])
    assert top1 == greedy


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    x = logits(1) / 3  # flat enough that twenty draws differ

    def draws(batch_of: int, n: int = 20) -> list[int]:
        """n draws of a seed-42 sequence sitting last in a batch with other, unseeded sequences."""
        sampler = Sampler({EOS}, torch.device("cpu"), seed=batch_of)
        mine = seq(batch_of, seed=42)
        others = [seq(i, top_p=0.5) for i in range(batch_of)]
        batch = torch.cat([logits(batch_of, seed=5), x]) if batch_of else x
        return [sampler(batch.clone(), [*others, mine])[0][-1] for _ in range(n)]

    alone = draws(0)
    assert draws(3) == alone and draws(7) == alone
    assert len(set(alone)) > 1, "a seeded stream advances: it should not repeat one token at temperature 1"


def test_sampling_follows_the_distribution() -> None:
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (VOCAB - 3)]))
    sampler = Sampler({EOS}, torch.device("cpu"))
    s = seq(seed=3)
    counts = torch.zeros(VOCAB)
    for _ in range(2000):
        counts[sampler(x.clone(), [s])[0][0]] += 1
    freq = counts / counts.sum()
    assert abs(freq[0] - 0.7) < 0.05 and abs(freq[1] - 0.2) < 0.05 and abs(freq[2] - 0.1) < 0.04


def test_top_p_and_min_p_cut_the_tail() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    sampler = Sampler({EOS}, torch.device("cpu"))
    top_p, min_p = seq(seed=1, top_p=0.75), seq(seed=1, min_p=0.5)
    seen_p = {sampler(x.clone(), [top_p])[0][0] for _ in range(300)}
    seen_min = {sampler(x.clone(), [min_p])[0][0] for _ in range(300)}
    assert seen_p == {0, 1}  # 0.5 + 0.3 reaches 0.75; 0.15 and below never drawn
    assert seen_min == {0, 1}  # min_p 0.5 keeps p >= 0.25


def test_logit_bias_penalties_and_min_tokens() -> None:
    sampler = Sampler({EOS}, torch.device("cpu"))
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
    sampler = Sampler({EOS}, torch.device("cpu"))
    x = logits(2)
    tokens, lps = sampler(x.clone(), [seq(0, temperature=0.0, logprobs=3), seq(1, temperature=0.0)])
    assert lps[1] is None
    expected = x[0].log_softmax(-1)
    assert abs(lps[0].logprob - expected[tokens[0]].item()) < 1e-5
    assert [t for t, _ in lps[0].top] == expected.topk(3).indices.tolist()
