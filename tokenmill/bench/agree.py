"""Greedy agreement of two OpenAI-compatible servers on the same GGUF: where their answers first part.

    python -m tokenmill.bench.agree GGUF --url http://127.0.0.1:8000 --url http://127.0.0.1:8090 [--max-tokens 64]

Each of eight fixed prompts goes to /v1/completions on both servers, greedy (temperature 0), as a raw prompt (no
chat template, so the two servers' templating cannot differ). The answers are compared as tokens of the GGUF's own
tokenizer: the first position where they differ, or "same". Quantized kernels round differently (llama.cpp's and
tokenmill's both round activations to 8 bits, each in its own order), so two correct servers agree for a while and
then part at a close choice; a wrong one parts at once.
"""

from __future__ import annotations

import argparse
import statistics

import httpx

from tokenmill.loader.gguf import GGUFFile
from tokenmill.loader.tokenizer import Tokenizer

PROMPTS = (
    "The capital of France is",
    "Here is a short story about a lighthouse keeper. Once upon a time,",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Photosynthesis is the process by which",
    "A list of five fruits:\n1.",
    "The most important thing to remember when learning a new language is",
)


def complete(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> str:
    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    model = client.get(f"{base}/models").raise_for_status().json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return client.post(f"{base}/completions", json=body).raise_for_status().json()["choices"][0]["text"]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (the shorter one's end counts), or None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", help="the GGUF both servers serve (its tokenizer counts the positions)")
    parser.add_argument("--url", action="append", required=True, help="two servers' base URLs")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    if len(args.url) != 2:
        parser.error("give --url twice")
    tokenizer = Tokenizer.from_gguf(GGUFFile(args.gguf).metadata)
    parted = []
    print(f"A = {args.url[0]}, B = {args.url[1]}, greedy, {args.max_tokens} tokens at most")
    print(f"{'prompt':<8} {'A tokens':>8} {'B tokens':>8} {'first difference':>16}")
    with httpx.Client(timeout=600) as client:
        for i, prompt in enumerate(PROMPTS):
            a, b = (tokenizer.encode(complete(client, url, prompt, args.max_tokens)) for url in args.url)
            at = first_difference(a, b)
            parted.append(args.max_tokens if at is None else at)
            print(f"{i:<8} {len(a):>8} {len(b):>8} {'same' if at is None else at:>16}")
    same = sum(p == args.max_tokens for p in parted)
    print(f"same answers: {same} of {len(PROMPTS)}; median first difference {statistics.median(parted)}")


if __name__ == "__main__":
    main()
