"""The fair share between tenants, measured over HTTP on servers this command starts, with and without it (and with
--shared-step-ms, a third server with the fair share and steps kept that short while tenants share it):

- burst: tenant A keeps --streams streams in flight (from a process of its own, as another client) while tenant B
  sends one request at a time; B's time to first token (p50, p90) against its value with the server to itself;
- backlog: two tenants each keep --backlog streams in flight (more than the server runs at once) for --seconds;
  each one's share of the tokens generated in that time, against the share its weight asks for (weights 1:1 and
  1:W, --weight).

The defaults are issue 52's measure: a minute a phase, and B's answers short enough (16 tokens) that each p90 at
--shared-step-ms 25 is of more than 100 requests on a 2-core machine (of 6 to 30, it moved by half between runs).
--shared-step-ms 0 leaves that server out. About 16 minutes in all.

    python -m tokenmill.bench.tenants MODEL [--streams 48] [--backlog 64] [--seconds 60] [--weight 3] \
        [--max-tokens 16] [--shared-step-ms 25] [-- FLAGS]

FLAGS go to `tokenmill serve` as they are (e.g. --dtype float32). Prints one table; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.client import sse_lines
from tokenmill.bench.workloads import synthetic_text
from tokenmill.tenants.keys import hash_key

TENANTS = {"a": 1.0, "b": 1.0, "c": None}  # c's weight is --weight


def _keys_file(folder: Path, weight: float) -> Path:
    path = folder / "keys.toml"
    text = ""
    for name, w in TENANTS.items():
        text += f"[tenants.{name}]\nweight = {w if w is not None else weight}\n\n"
        text += f'[[keys]]\ntenant = "{name}"\nsha256 = "{hash_key("bench-" + name)}"\n\n'
    path.write_text(text)
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server:
    def __init__(self, model: str, keys: Path, policy: list[str], flags: list[str], folder: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "tokenmill", "serve", model, "--port", str(self.port), "--api-keys",
                   str(keys), *policy, "--responses-store", "off", "--log-level", "warning", *flags]
        self.log = (folder / f"server-{'-'.join(policy).strip('-')}.log").open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> _Server:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server stopped at start: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not start within 300 s")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(60)
        self.log.close()


class _Load:
    """Requests of one tenant, their first-token times and the tokens each second brought."""

    def __init__(self, url: str, tenant: str, model: str, prompt: str, max_tokens: int, spread: bool = False) -> None:
        """spread: answers of max_tokens/2 to 3*max_tokens/2 tokens at random, so that streams started together
        do not end (and send their next prompts) together."""
        self.url, self.tenant, self.model = url, tenant, model
        self.prompt, self.max_tokens, self.spread = prompt, max_tokens, spread
        self.random = random.Random(tenant)
        self.ttft: list[float] = []
        self.tokens: list[tuple[float, int]] = []  # (when, tokens that chunk brought)
        self.errors = 0

    async def one(self, client: httpx.AsyncClient) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": self.random.randint(self.max_tokens // 2, self.max_tokens * 3 // 2) if self.spread
                else self.max_tokens, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        start, seen, first = time.perf_counter(), 0, True
        try:
            async with client.stream("POST", self.url + "/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer bench-{self.tenant}"}) as response:
                if response.status_code != 200:
                    self.errors += 1
                    await response.aread()
                    return
                async for line in sse_lines(response):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or {}
                    done = usage.get("completion_tokens", seen)
                    if done > seen:
                        now = time.perf_counter()
                        if first:
                            self.ttft.append(now - start)
                            first = False
                        self.tokens.append((now, done - seen))
                        seen = done
        except httpx.HTTPError:
            self.errors += 1

    async def keep(self, client: httpx.AsyncClient, streams: int, until: float) -> None:
        async def loop() -> None:
            while time.perf_counter() < until:
                await self.one(client)
        await asyncio.gather(*(loop() for _ in range(streams)))

    def between(self, start: float, end: float) -> int:
        return sum(n for when, n in self.tokens if start <= when < end)


def _burst(url: str, model: str, prompt: str, streams: int, seconds: float, news: Any) -> None:
    """Tenant A's streams for `seconds`, in a process of their own (a client of its own, as a tenant is: B's first
    tokens are not read late behind A's in one event loop). Puts into `news` when the streams are steady and when
    they end (perf_counter is the system's monotonic clock, the same in both processes), then A's tokens a second
    between the two and its errors."""
    async def run() -> tuple[float, int]:
        burst = _Load(url, "a", model, prompt, 128, spread=True)
        start = time.perf_counter()
        steady, end = start + min(5.0, seconds / 4), start + seconds  # A's streams reach their steady state
        news.put((steady, end))
        limits = httpx.Limits(max_connections=2 * streams + 8)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            await burst.keep(client, streams, end)
        return burst.between(steady, end) / (end - steady), burst.errors
    news.put(asyncio.run(run()))


def _p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else (values[0] if values else float("nan"))


async def _measure(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    prompt = synthetic_text(random.Random(1), args.prompt_tokens)
    limits = httpx.Limits(max_connections=4 * max(args.streams, args.backlog) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        alone = _Load(url, "b", model, prompt, args.max_tokens)
        until = time.perf_counter() + args.seconds / 2
        await alone.one(client)  # warm-up, not counted
        alone.ttft.clear()
        while time.perf_counter() < until:
            await alone.one(client)
        single = _Load(url, "b", model, prompt, args.max_tokens)
        spawn = multiprocessing.get_context("spawn")
        news = spawn.SimpleQueue()
        crowd = spawn.Process(target=_burst, args=(url, model, prompt, args.streams, args.seconds, news))
        crowd.start()
        steady, end = await asyncio.to_thread(news.get)
        await asyncio.sleep(max(0.0, steady - time.perf_counter()))
        while time.perf_counter() < end:
            await single.one(client)
        a_rate, a_errors = await asyncio.to_thread(news.get)
        crowd.join()
        shares = {}
        for other in ("b", "c"):
            loads = {name: _Load(url, name, model, prompt, 64, spread=True) for name in ("a", other)}
            start = time.perf_counter()
            end = start + args.seconds + 5
            await asyncio.gather(*(load.keep(client, args.backlog, end) for load in loads.values()))
            counted = {name: load.between(start + 5, end) for name, load in loads.items()}
            shares[other] = counted[other] / max(1, sum(counted.values()))
    return {"alone_ttft_p50": statistics.median(alone.ttft), "alone_ttft_p90": _p(alone.ttft, 90),
            "burst_ttft_p50": statistics.median(single.ttft), "burst_ttft_p90": _p(single.ttft, 90),
            "alone_requests": len(alone.ttft), "burst_requests": len(single.ttft), "a_tokens_per_s": a_rate,
            "share_b_weight_1": shares["b"], "share_c_weight_w": shares["c"],
            "errors": alone.errors + single.errors + a_errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--streams", type=int, default=48, help="tenant A's streams in the burst (default: 48)")
    parser.add_argument("--backlog", type=int, default=64, help="streams each tenant keeps in flight in the "
                        "backlog (default: 64)")
    parser.add_argument("--seconds", type=float, default=60.0, help="each phase's length (default: 60)")
    parser.add_argument("--weight", type=float, default=3.0, help="tenant C's weight against A's 1 (default: 3)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="about this many (default: 64)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tenant B's answers (default: 16)")
    parser.add_argument("--shared-step-ms", type=float, default=25.0, help="also a server with the fair share and "
                        "--shared-step-ms this (default: 25; 0: none)")
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("flags", nargs="*", help="after --: flags for `tokenmill serve`")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="tokenmill-tenants-") as folder:
        keys = _keys_file(Path(folder), args.weight)
        policies = {"fair share": ["--fair-share"]}
        if args.shared_step_ms:
            ms = f"{args.shared_step_ms:g}"
            policies[f"fair, {ms} ms"] = ["--fair-share", "--shared-step-ms", ms]
        policies["first come"] = ["--no-fair-share"]
        for name, policy in policies.items():
            with _Server(args.model, keys, policy, args.flags, Path(folder)) as server:
                model = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer bench-a"}
                                  ).json()["data"][0]["id"]
                results[name] = asyncio.run(_measure(server.url, model, args))
    w = args.weight
    print(f"tenants on {os.cpu_count()} CPUs: B alone, then beside A's {args.streams} streams; backlogs of "
          f"{args.backlog} streams each for {args.seconds:g} s")
    print(f"{'':14} {'B alone p50/p90':>17} {'B in burst p50/p90':>20} {'p90 ratio':>9} {'share 1:1':>10} "
          f"{'share 1:' + format(w, 'g'):>10}")
    for name, r in results.items():
        print(f"{name:14} {r['alone_ttft_p50'] * 1000:7.0f}/{r['alone_ttft_p90'] * 1000:<6.0f}ms "
              f"{r['burst_ttft_p50'] * 1000:9.0f}/{r['burst_ttft_p90'] * 1000:<6.0f}ms "
              f"{r['burst_ttft_p90'] / r['alone_ttft_p90']:8.2f}x {r['share_b_weight_1']:9.1%} "
              f"{r['share_c_weight_w']:9.1%}")
    print(f"asked by the weights: 50.0% and {w / (1 + w):.1%}; A's tokens/s in the burst: "
          + ", ".join(f"{name} {r['a_tokens_per_s']:.0f}" for name, r in results.items()))
    print("B's requests timed (a p90 of few moves between runs), alone and beside A: "
          + ", ".join(f"{name} {r['alone_requests']} and {r['burst_requests']}" for name, r in results.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
