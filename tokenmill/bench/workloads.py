"""Named, seeded workloads: what each benchmark sends and when.

Every workload is a list of conversations. A conversation is one or more user turns, sent one after another (the
next turn carries every earlier turn and the assistant's actual replies); conversations run concurrently. All
single-turn workloads are conversations of one turn.

Prompts are synthetic English-like text: words drawn from a fixed list with a generator seeded by the seed and the
workload's name, so a run is reproducible without downloading a dataset. Lengths are asked for in tokens and written
as 0.92 words per token (within 2% on SmolLM2's tokenizer; other tokenizers differ a little), so they are
approximate: the report counts the prompt tokens the server says it read.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenmill.config import option  # one --flag per field, as for the server's config

WORKLOADS = ("baseline", "burst", "staggered", "long-prompt", "shared-prefix", "multi-turn", "rewrite", "repeated",
             "tenants")
WORDS_PER_TOKEN = 0.92

_WORDS = """
the of and to in is was for on that with as by at from his her their its this which have had has were are be been
not but they one all would there what when who will more no if out so said about up time into than them could
only other new some these two may first then do any like my now over such our man me even most made after also did
many before must through back years where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between both life being under never day
same another know while last might us great old year off come since against go came right used take three states
himself few house use during without again place around however home small found thought went say part once
general high upon school every number river mountain garden letter window morning evening summer winter bridge
city village road market harbor island forest valley station library kitchen engine signal story question answer
reason problem system method result figure table light water stone paper music color family friend teacher doctor
farmer sailor driver writer painter builder keeper traveler stranger children animals birds trees flowers clouds
quiet bright early late slowly quickly carefully together almost always often never nearly rather across toward
behind beyond within along among near open close carry follow remember decide explain wonder listen watch build
write read speak begin finish return travel wait change grow learn teach
""".split()


@dataclass
class Conversation:
    """One user's session: the turns it sends in order, behind an optional system prompt, from `arrival` on."""

    index: int
    turns: list[str]
    system: str | None = None
    arrival: float = 0.0  # seconds after the start of the run
    long: bool = False  # one of long-prompt's long prompts


@dataclass
class WorkloadParams:
    name: str
    num_requests: int = option(16, "requests to send (multi-turn: conversations)")
    prompt_len: int = option(128, "approximate tokens of each prompt (of each turn; long-prompt's short prompts)")
    output_len: int = option(128, "max_tokens of each request")
    long_prompt_len: int = option(4000, "approximate tokens of long-prompt's long prompts")
    long_fraction: float = option(0.75, "share of long prompts in long-prompt")
    long_prompt_delay: float = option(0.0, "seconds into the run at which long-prompt's long prompts arrive, so the "
                                           "short ones are already decoding (0: with the rest)")
    prefix_len: int = option(1000, "approximate tokens of shared-prefix's common system prompt (tenants': of each)")
    system_prompts: int = option(6, "tenants: the system prompts the requests share, each request one of them in "
                                    "seeded order (replicas behind a cache-aware gateway keep each on one replica)")
    turns: int = option(4, "turns of each multi-turn conversation")
    request_rate: float | None = option(None, "Poisson arrivals per second; None: all at once (staggered: 1.0)")
    seed: int = option(0, "seed of prompts, arrivals and sampling")

    @property
    def rate(self) -> float | None:
        if self.request_rate is None and self.name == "staggered":
            return 1.0
        return self.request_rate

    @property
    def total_requests(self) -> int:
        return self.num_requests * (self.turns if self.name == "multi-turn" else 1)


def synthetic_text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of sentences of common words."""
    words = max(1, round(tokens * WORDS_PER_TOKEN))
    sentences = []
    while words > 0:
        n = min(words, rng.randint(6, 16))
        sentence = rng.choices(_WORDS, k=n)
        sentences.append(" ".join([sentence[0].capitalize(), *sentence[1:]]) + ".")
        words -= n
    return " ".join(sentences)


def rewrite_prompt(rng: random.Random, tokens: int) -> str:
    """Code of about `tokens` tokens (one-line functions named from the word list) and a request to rewrite it
    with one name changed: an answer that copies its prompt, as edits of code and documents do."""
    functions: list[str] = []
    names: list[str] = []
    while len(functions) * 14 < tokens:
        name, a, b = rng.sample(_WORDS, 3)
        names.append(name)
        functions.append(f"def {name}_{len(functions)}({a}, {b}):\n    return {a} * {len(functions) + 2} + {b}\n")
    old, new = names[0], rng.choice(_WORDS)
    return (f"Rewrite this code with the function {old}_0 renamed to {new}_0. Answer with the whole code only.\n\n"
            + "\n".join(functions))


def _arrivals(params: WorkloadParams, n: int) -> list[float]:
    """Poisson arrivals at params.rate (exponential gaps), seeded apart from the text so both stay reproducible."""
    if params.rate is None:
        return [0.0] * n
    rng = random.Random(f"{params.seed}-arrivals")
    at, times = 0.0, []
    for _ in range(n):
        times.append(at)
        at += rng.expovariate(params.rate)
    return times


def build(params: WorkloadParams) -> list[Conversation]:
    if params.name not in WORKLOADS:
        raise ValueError(f"unknown workload {params.name!r}; choose from {', '.join(WORKLOADS)}")
    # The name is in the seed so that, against one server, a workload does not find another's prompts cached.
    rng = random.Random(f"{params.seed}-{params.name}")
    n = params.num_requests
    system = synthetic_text(rng, params.prefix_len) if params.name == "shared-prefix" else None
    tenants = [synthetic_text(rng, params.prefix_len) for _ in range(params.system_prompts)] \
        if params.name == "tenants" else []
    if params.name == "long-prompt":
        # A fixed share of long prompts, in seeded order, so even a small run has both kinds.
        n_long = round(n * params.long_fraction)
        lengths = [params.long_prompt_len] * n_long + [params.prompt_len] * (n - n_long)
        rng.shuffle(lengths)
    else:
        lengths = [params.prompt_len] * n
    turns = params.turns if params.name == "multi-turn" else 1
    long = [params.name == "long-prompt" and length == params.long_prompt_len for length in lengths]
    arrivals = [max(at, params.long_prompt_delay) if is_long else at
                for at, is_long in zip(_arrivals(params, n), long, strict=True)]
    text = rewrite_prompt if params.name == "rewrite" else synthetic_text
    conversations = [Conversation(i, [text(rng, lengths[i]) for _ in range(turns)], system, arrival, long[i])
                     for i, arrival in enumerate(arrivals)]
    for c in conversations if tenants else ():
        c.system = rng.choice(tenants)
    if params.name == "repeated":  # each of n / 4 prompts sent four times, in turn: an agent's or extractor's calls
        for c in conversations:
            c.turns = conversations[c.index % max(1, n // 4)].turns
    return conversations
