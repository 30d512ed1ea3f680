"""`tokenmill chat` in a pseudo-terminal (pexpect), as a person types: against the live server (--url) a question
streams its answer, Ctrl-C stops it on the server and the prompt returns; in-process on a model file it answers
and Ctrl-D leaves. The conversation's bookkeeping as pure logic: tests/unit/test_chat.py."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import ServerThread

pexpect = pytest.importorskip("pexpect")
TOKENMILL = [sys.executable, "-m", "tokenmill"]


def spawn(*args: str, timeout: float = 60) -> pexpect.spawn:
    child = pexpect.spawn(TOKENMILL[0], [*TOKENMILL[1:], "chat", *args], encoding="utf-8", timeout=timeout,
                          dimensions=(40, 200))
    child.expect_exact(">>> ")
    return child


def read_pieces(child: pexpect.spawn, seconds: float) -> list[tuple[float, str]]:
    """What the terminal shows, piece by piece with its arrival time, for up to `seconds` or until the prompt."""
    pieces: list[tuple[float, str]] = []
    deadline = time.time() + seconds
    while time.time() < deadline and not "".join(p for _, p in pieces).endswith(">>> "):
        try:
            pieces.append((time.time(), child.read_nonblocking(4096, timeout=0.2)))
        except pexpect.TIMEOUT:
            pass
    return pieces


def test_a_reply_streams_and_ctrl_c_stops_it_on_the_server(server: ServerThread) -> None:
    child = spawn("--url", server.base_url, "--max-tokens", "1500")
    child.sendline("Write a long story about a dragon who learns to cook. Make it at least ten paragraphs.")
    pieces = read_pieces(child, 1.0)
    answer = "".join(p for _, p in pieces)
    assert len([p for _, p in pieces if p.strip()]) >= 3, pieces  # streamed: several pieces over time
    assert not answer.endswith(">>> ")  # still answering after a second
    assert httpx.get(server.root_url + "/stats").json()["running"] == 1
    child.sendintr()  # Ctrl-C
    child.expect_exact("(stopped)")
    child.expect_exact(">>> ")
    deadline = time.time() + 10
    while (stats := httpx.get(server.root_url + "/stats").json())["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert stats["running"] == 0 and stats["kv"]["blocks_used"] == 0  # aborted, its KV back in the pool
    child.sendline("/system You answer in one word.")  # the chat goes on after a stop
    child.expect_exact("(system prompt: You answer in one word.)")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_in_process_chat_answers_and_leaves_on_ctrl_d(tiny_gguf: Path) -> None:
    child = spawn(str(tiny_gguf), "--max-tokens", "24", "--kv-cache-memory", "16MiB")
    child.sendline("Hello there")
    child.expect_exact(">>> ")
    answer = child.before.split("Hello there", 1)[1].strip()
    assert answer and "error" not in answer  # the tiny random model's 24 tokens, whatever they say
    child.sendline("/reset")
    child.expect_exact("(conversation forgotten)")
    child.sendintr()  # Ctrl-C at the prompt does not leave
    child.expect_exact("(Ctrl-D or /bye to leave)")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
