"""`tokenmill chat [MODEL | --url URL]`: a chat in the terminal, in the spirit of `ollama run`.

It talks to an OpenAI-compatible server over HTTP, streaming: a running one (--url), or one it starts in this process
on a free loopback port for MODEL. One client either way, the server's own chat template and sampling. Ctrl-C stops
the reply (the connection closes and the server aborts the request) and the prompt returns; Ctrl-D or /bye leaves.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from tokenmill.config import EngineConfig, ServerConfig

PROMPT = ">>> "
HELP = """Commands:
  /system TEXT   set the system prompt (/system alone shows it; /system - removes it)
  /reset         forget the conversation (the system prompt stays)
  /bye           leave (or Ctrl-D)
Ctrl-C stops a reply while it streams."""


class ChatError(Exception):
    """The server refused or could not be reached: said, and the chat goes on."""


@dataclass
class ChatClient:
    base_url: str  # ends with /v1
    api_key: str | None = None
    timeout: float = 600.0

    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url.rstrip("/") + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)  # noqa: S310 - the user's own URL
        except urllib.error.HTTPError as exc:
            raise ChatError(_error_message(exc)) from exc
        except urllib.error.URLError as exc:
            raise ChatError(f"cannot reach {self.base_url}: {exc.reason}") from exc
        except (OSError, http.client.HTTPException) as exc:  # a server gone before its answer, a timeout
            raise ChatError(f"{self.base_url}: {exc or type(exc).__name__}") from exc

    def first_model(self) -> str:
        try:
            with self._request("/models") as response:
                return json.load(response)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ChatError(f"{self.base_url}/models lists no model") from exc

    def stream(self, body: dict[str, Any]) -> Generator[str, None, None]:
        """The reply's text as it streams; closing the generator closes the connection (the server aborts)."""
        with self._request("/chat/completions", {**body, "stream": True}) as response:
            try:
                yield from _contents(response)
            except (OSError, http.client.HTTPException, ValueError) as exc:  # the server went away mid-answer
                raise ChatError(f"the answer broke off: {exc or type(exc).__name__}") from exc


def _contents(lines: Iterable[bytes]) -> Iterator[str]:
    """The text of each `data:` chunk of an OpenAI chat stream."""
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise ChatError(chunk["error"].get("message", "the server failed"))
        for choice in chunk.get("choices", []):
            text = choice.get("delta", {}).get("content")
            if text:
                yield text


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return f"{exc.code}: {json.load(exc)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{exc.code}: {exc.reason}"


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns


def command(line: str, conversation: Conversation, out: TextIO) -> bool:
    """Run a /command; False when it asks to leave."""
    name, _, rest = line.partition(" ")
    if name in ("/bye", "/exit", "/quit"):
        return False
    if name == "/reset":
        conversation.turns.clear()
        print("(conversation forgotten)", file=out)
    elif name == "/system":
        if rest.strip() == "-":
            conversation.system = None
        elif rest.strip():
            conversation.system = rest.strip()
        print(f"(system prompt: {conversation.system or 'none'})", file=out)
    else:
        print(HELP, file=out)
    return True


def reply(client: ChatClient, conversation: Conversation, options: dict[str, Any], out: TextIO) -> None:
    """Stream one answer to the conversation's last turn; Ctrl-C stops it, and what came so far is kept."""
    parts: list[str] = []
    stream = client.stream({**options, "messages": conversation.messages()})
    try:
        for text in stream:
            parts.append(text)
            out.write(text)
            out.flush()
        out.write("\n")
    except KeyboardInterrupt:
        out.write("\n(stopped)\n")
    except ChatError as exc:
        if not parts:
            raise  # nothing came: the question is taken back (repl says why)
        out.write(f"\n(the answer broke off: {exc})\n")
    finally:
        stream.close()  # the connection closes here: a stopped reply is aborted on the server
    conversation.turns.append({"role": "assistant", "content": "".join(parts)})


def repl(client: ChatClient, options: dict[str, Any], system: str | None, out: TextIO = sys.stdout) -> int:
    try:
        import readline  # noqa: F401 - line editing and history for input(), where the platform has it
    except ImportError:
        pass
    # Ctrl-C stops a reply even where this process started with SIGINT ignored (the child of a background job, which
    # Python would leave ignored): the chat is interactive whoever started it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    conversation = Conversation(system)
    print(f"Chatting with {options['model']}. /help for commands, Ctrl-D or /bye to leave.", file=out)
    while True:
        try:
            line = input(PROMPT).strip()
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /bye to leave)", file=out)
            continue
        if not line:
            continue
        if line.startswith("/"):
            if not command(line, conversation, out):
                return 0
            continue
        conversation.turns.append({"role": "user", "content": line})
        try:
            reply(client, conversation, options, out)
        except ChatError as exc:
            conversation.turns.pop()
            print(f"error: {exc}", file=out)


def local_server(engine_config: EngineConfig) -> str:
    """Start MODEL's engine and the API on a free loopback port, in this process; its base URL."""
    from tokenmill.api.server import build_server
    from tokenmill.engine.engine import Engine

    engine = Engine(engine_config)
    engine.start()
    config = ServerConfig(ui=False, responses_store="off", log_level="warning", shutdown_timeout=1)
    server = build_server(engine, config, engine_config.model, {str(engine.model_path)})
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)  # connections wait in the backlog until uvicorn, starting, accepts them
    threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True, name="tokenmill-chat").start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/v1"


def main(engine_config: EngineConfig, url: str | None, api_key: str | None, model: str | None,
         system: str | None, temperature: float | None, max_tokens: int | None) -> int:
    if url is None:
        print(f"loading {engine_config.model} ...", file=sys.stderr)
        url = local_server(engine_config)
        model = engine_config.model
    client = ChatClient(url, api_key)
    try:
        model = model or client.first_model()
    except ChatError as exc:
        print(f"tokenmill chat: {exc}", file=sys.stderr)
        return 1
    options: dict[str, Any] = {"model": model}
    if temperature is not None:
        options["temperature"] = temperature
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    return repl(client, options, system)
