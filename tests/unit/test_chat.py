"""`tokenmill chat`'s conversation, without a server: what each request sends, the commands, and a reply stopped by
Ctrl-C (kept as far as it came, its stream closed, which closes the connection)."""

from __future__ import annotations

import io
from collections.abc import Generator
from typing import Any

from tokenmill.chat import ChatClient, Conversation, command, reply


class FakeClient(ChatClient):
    def __init__(self, pieces: list[str], interrupt_after: int | None = None) -> None:
        super().__init__("http://unused/v1")
        self.pieces, self.interrupt_after = pieces, interrupt_after
        self.bodies: list[dict[str, Any]] = []
        self.closed = False

    def stream(self, body: dict[str, Any]) -> Generator[str, None, None]:
        self.bodies.append(body)
        try:
            for i, piece in enumerate(self.pieces):
                if i == self.interrupt_after:
                    raise KeyboardInterrupt
                yield piece
        finally:
            self.closed = True


def test_each_request_sends_the_system_prompt_and_the_whole_conversation() -> None:
    conversation, out = Conversation(system="Be brief."), io.StringIO()
    client = FakeClient(["Hel", "lo"])
    conversation.turns.append({"role": "user", "content": "Hi"})
    reply(client, conversation, {"model": "m", "temperature": 0.5}, out)
    conversation.turns.append({"role": "user", "content": "Again"})
    reply(client, conversation, {"model": "m"}, out)
    assert out.getvalue() == "Hello\nHello\n"
    assert client.bodies[1] == {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]}
    assert client.bodies[0]["temperature"] == 0.5 and client.closed


def test_ctrl_c_keeps_what_came_and_closes_the_stream() -> None:
    conversation, out = Conversation(), io.StringIO()
    client = FakeClient(["Once", " upon", " a time"], interrupt_after=2)
    conversation.turns.append({"role": "user", "content": "A story"})
    reply(client, conversation, {"model": "m"}, out)
    assert out.getvalue() == "Once upon\n(stopped)\n"
    assert conversation.turns[-1] == {"role": "assistant", "content": "Once upon"} and client.closed


def test_commands() -> None:
    conversation, out = Conversation(turns=[{"role": "user", "content": "x"}]), io.StringIO()
    assert command("/system Talk like a pirate.", conversation, out)
    assert conversation.system == "Talk like a pirate." and conversation.messages()[0]["role"] == "system"
    assert command("/reset", conversation, out) and conversation.turns == []
    assert conversation.system == "Talk like a pirate."  # a reset keeps the system prompt
    assert command("/system -", conversation, out) and conversation.system is None
    assert command("/help", conversation, out) and "/reset" in out.getvalue()
    assert not command("/bye", conversation, out) and not command("/exit", conversation, out)
