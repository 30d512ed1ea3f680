"""Drive any OpenAI-compatible server over HTTP with a workload, timing every streamed response on the client.

One asyncio task per conversation; a semaphore caps how many run at once (--concurrency). Every request streams
(`stream: true`, `stream_options.include_usage`), and its times are taken as the chunks arrive:
- TTFT: from sending the request to the first chunk with non-empty content;
- ITL: the gaps between successive content chunks;
- e2e: from sending the request to the end of the stream;
- TPOT: (e2e - TTFT) / (completion tokens - 1).
Token counts are the server's, from the final usage chunk; for a server that sends none, the content chunks are
counted instead and the report says so. A request that fails in any way (refused connection, HTTP error, error event
mid-stream, timeout) becomes a record with its error message, never an exception out of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from tqdm import tqdm

from tokenmill import __version__
from tokenmill.bench import report
from tokenmill.bench.report import RequestRecord
from tokenmill.bench.workloads import Conversation, WorkloadParams, build, synthetic_text


@dataclass
class ClientConfig:
    url: str  # the server's OpenAI base URL; /v1 is added when missing
    model: str | None = None  # None: the first id of /v1/models
    endpoint: str = "chat"  # chat (messages) or completions (one prompt string)
    concurrency: int | None = None  # None: 1 for baseline, every conversation at once otherwise
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0  # sent where below 1
    timeout: float = 600.0  # seconds per request, the whole stream included
    warmup: int = 1  # untimed requests sent first, so no server is timed on its first-request setup
    api_key: str | None = None  # sent as a Bearer token

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"


class _ServerError(Exception):
    """The server answered, with an error."""


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:200]


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """A stream's lines as SSE ends them, at \n (a \r before it dropped): not httpx's aiter_lines, which also
    breaks at U+2028 and the like, which servers may send raw inside their JSON."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], record: RequestRecord, t0: float,
                  text: list[str]) -> None:
    usage, chat = None, path == "/chat/completions"
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise _ServerError(f"HTTP {response.status_code}: {_error_message(await response.aread())}")
        async for line in sse_lines(response):
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("error"):
                raise _ServerError(f"error event: {_error_message(data.encode())}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if piece:
                    record.chunk_times.append(time.perf_counter() - t0)
                    text.append(piece)
        else:  # no [DONE]: the server closed the stream early
            raise _ServerError("the stream ended without data: [DONE]")
    if usage:
        record.prompt_tokens, record.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        record.usage_from_server = True
    else:
        record.completion_tokens = len(record.chunk_times)


async def _request(client: httpx.AsyncClient, cfg: ClientConfig, body: dict[str, Any], record: RequestRecord,
                   t0: float) -> str:
    """Send one streamed request, filling in `record`; returns the text received."""
    text: list[str] = []
    path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"
    try:
        async with asyncio.timeout(cfg.timeout):
            await _stream(client, path, body, record, t0, text)
    except TimeoutError:
        record.error = f"timeout after {cfg.timeout:g} s"
    except _ServerError as exc:
        record.error = str(exc)
    except Exception as exc:  # whatever goes wrong with one request is that request's failure, not the run's
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter() - t0
    return "".join(text)


def _body(cfg: ClientConfig, model: str | None, messages: list[dict[str, str]], max_tokens: int,
          seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
                            "temperature": cfg.temperature, "seed": seed}
    if cfg.top_p < 1:
        body["top_p"] = cfg.top_p
    if model is not None:
        body["model"] = model
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = messages
    else:  # the completions API takes one string: the turns, one paragraph each
        body["prompt"] = "\n\n".join(m["content"] for m in messages)
    return body


@dataclass
class _Run:
    """One workload's run: the client, its settings and model, the semaphore that holds concurrency, its start,
    the records and the progress bar every conversation adds to."""

    client: httpx.AsyncClient
    cfg: ClientConfig
    model: str | None
    params: WorkloadParams
    slots: asyncio.Semaphore
    t0: float
    records: list[RequestRecord]
    bar: tqdm


async def _conversation(run: _Run, conv: Conversation) -> None:
    await asyncio.sleep(conv.arrival - (time.perf_counter() - run.t0))
    async with run.slots:
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        for turn, user in enumerate(conv.turns, 1):
            messages.append({"role": "user", "content": user})
            # several models (comma-separated: LoRA adapters, a server's models): conversations take them in turn
            models = run.model.split(",") if run.model else [None]
            body = _body(run.cfg, models[conv.index % len(models)], messages, run.params.output_len,
                         run.params.seed + conv.index)
            record = RequestRecord(conv.index, turn, time.perf_counter() - run.t0)
            run.records.append(record)
            reply = await _request(run.client, run.cfg, body, record, run.t0)
            run.bar.update()
            if not record.ok:
                run.bar.set_postfix(failed=sum(not r.ok for r in run.records))
                run.bar.update(len(conv.turns) - turn)  # the rest of this conversation is not sent
                return
            messages.append({"role": "assistant", "content": reply})


async def _first_model(client: httpx.AsyncClient) -> str | None:
    try:
        response = await client.get("/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except Exception as exc:  # a server that is down fails every request below, which the report shows
        print(f"tokenmill bench: no model from {client.base_url}models ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


async def run(cfg: ClientConfig, params: WorkloadParams, progress: bool = True) -> dict[str, Any]:
    """Run the workload against the server; returns the report (see report.build)."""
    conversations = build(params)
    concurrency = cfg.concurrency or (1 if params.name == "baseline" else len(conversations))
    # Straight to the server: no proxy from the environment, and no pool limit below the concurrency.
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=None, trust_env=False, headers=headers,
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = cfg.model or await _first_model(client)
        warmup = [{"role": "user", "content": synthetic_text(random.Random("warmup"), 16)}]
        for _ in range(cfg.warmup):
            for each in (model.split(",") if model else [None]):
                await _request(client, cfg, _body(cfg, each, warmup, 8, params.seed), RequestRecord(-1, 0, 0.0), 0.0)
        slots = asyncio.Semaphore(concurrency)
        records: list[RequestRecord] = []
        with tqdm(total=params.total_requests, desc=params.name, unit="req", file=sys.stderr,
                  disable=not progress) as bar:
            t0 = time.perf_counter()
            state = _Run(client, cfg, model, params, slots, t0, records, bar)
            await asyncio.gather(*(_conversation(state, conv) for conv in conversations))
            duration = time.perf_counter() - t0
    config = {"url": cfg.base_url, "model": model, "endpoint": cfg.endpoint, "workload": params.name,
              "params": dataclasses.asdict(params), "request_rate": params.rate, "concurrency": concurrency,
              "ignore_eos": cfg.ignore_eos, "temperature": cfg.temperature, "top_p": cfg.top_p, "warmup": cfg.warmup,
              "timeout": cfg.timeout, "seed": params.seed, "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "tokenmill_version": __version__}
    return report.build(config, sorted(records, key=lambda r: r.start), duration)


def main(args: argparse.Namespace) -> int:
    """`tokenmill bench`: 0 when any request completed (or on --compare), 1 when all failed, 2 on bad arguments."""
    if args.compare:
        print(report.compare(*(report.load(path) for path in args.compare)))
        return 0
    if args.workload is None:
        print("tokenmill bench: give --workload (or --compare A.json B.json)", file=sys.stderr)
        return 2
    if args.workload == "baseline" and args.concurrency not in (None, 1):
        print("tokenmill bench: baseline sends one request at a time; use burst for concurrency", file=sys.stderr)
        return 2
    params = WorkloadParams(name=args.workload, **{f.name: getattr(args, f.name)
                                                   for f in dataclasses.fields(WorkloadParams) if f.name != "name"})
    cfg = ClientConfig(url=args.url, model=args.model, endpoint=args.endpoint, concurrency=args.concurrency,
                       ignore_eos=args.ignore_eos, temperature=args.temperature, top_p=args.top_p, timeout=args.timeout,
                       warmup=args.warmup, api_key=args.api_key)
    result = asyncio.run(run(cfg, params))
    print(report.table(result))
    if args.json:
        report.save(result, args.json)
    if args.plot:
        report.plot(result, args.plot)
    return 0 if result["summary"]["completed"] else 1
