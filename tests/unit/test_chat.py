"""`tokenmill chat`'s conversation, without a server: what each request sends, the commands, and a reply stopped by
Ctrl-C (kept as far as it came, its stream closed, which closes the connection)."""

from __future__ import annotations

import http.server
import io
import socket
import threading
from collections.abc import Generator
from typing import Any

import pytest

from tokenmill.chat import ChatClient, ChatError, Conversation, command, reply


class FakeClient(ChatClient):
    def __init__(self, pieces: list[str], interrupt_after: int | None = None,
                 raises: type[BaseException] | BaseException = KeyboardInterrupt) -> None:
        super().__init__("http://unused/v1")
        self.pieces, self.interrupt_after, self.raises = pieces, interrupt_after, raises
        self.bodies: list[dict[str, Any]] = []
        self.closed = False

    def stream(self, body: dict[str, Any]) -> Generator[str, None, None]:
        self.bodies.append(body)
        try:
            for i, piece in enumerate(self.pieces):
                if i == self.interrupt_after:
                    raise self.raises
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


def test_an_answer_that_breaks_off_keeps_what_came_and_one_that_never_came_is_refused() -> None:
    conversation, out = Conversation(turns=[{"role": "user", "content": "A story"}]), io.StringIO()
    reply(FakeClient(["Once", " upon"], interrupt_after=1, raises=ChatError("connection reset")), conversation,
          {"model": "m"}, out)
    assert out.getvalue() == "Once\n(the answer broke off: connection reset)\n"
    assert conversation.turns[-1] == {"role": "assistant", "content": "Once"}
    with pytest.raises(ChatError):
        reply(FakeClient(["Once"], interrupt_after=0, raises=ChatError("gone")), conversation, {"model": "m"}, out)


class DyingServer(http.server.BaseHTTPRequestHandler):
    """Starts a chunked event stream, sends one chunk, then drops the connection."""

    def do_POST(self) -> None:  # noqa: N802 - the handler's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        event = b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n'
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event) + b"ff\r\npartial")
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_stream_cut_off_mid_chunk_is_a_chat_error_not_a_traceback() -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), DyingServer)
    threading.Thread(target=server.handle_request, daemon=True).start()
    client = ChatClient(f"http://127.0.0.1:{server.server_address[1]}/v1", timeout=10)
    pieces = []
    with pytest.raises(ChatError, match="broke off"):
        for piece in client.stream({"model": "m", "messages": []}):
            pieces.append(piece)
    assert pieces == ["Hel"]
    server.server_close()
