"""Tenants as pure logic: the keys file (its mistakes named by line), the per-minute windows and limits at their
value and one past it, and the usage ledger across a restart."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tokenmill.errors import ConfigError, RateLimitError
from tokenmill.tenants.keys import KeyRing, Tenant, add_key, hash_key, parse_keys
from tokenmill.tenants.limits import SPAN, TenantLimits, Window, duration
from tokenmill.tenants.tenancy import Tenancy
from tokenmill.tenants.usage import Usage, UsageLedger

GOOD = f"""
[tenants.alice]
role = "user"
requests_per_minute = 3
tokens_per_minute = 100
max_concurrent_requests = 2
max_tokens = 16
models = ["tiny"]
weight = 2.5
cache_group = "team"

[tenants.root]
role = "admin"

[[keys]]
tenant = "alice"
sha256 = "{hash_key('alice-key')}"

[[keys]]
tenant = "root"
sha256 = "{hash_key('root-key')}"
"""


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_keys_file_names_tenants_their_limits_and_whose_each_key_is(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(GOOD)
    ring = KeyRing.of(path, admin_keys=("flag-key",))
    alice = ring.authenticate("alice-key")
    assert alice == Tenant("alice", "user", 3, 100, 2, 16, ("tiny",), 2.5, "team")
    assert alice.cache_namespace == "team" and not alice.admin and alice.may_use("tiny") and not alice.may_use("x")
    assert ring.authenticate("root-key").admin and ring.authenticate("root-key").may_use("anything")
    assert ring.authenticate("flag-key").name == "admin" and ring.authenticate("flag-key").admin
    assert ring.authenticate("alice-key ") is None and ring.authenticate("") is None
    assert ring.tenants["root"].cache_namespace == "root"


@pytest.mark.parametrize(("text", "line", "words"), [
    ("[tenants.a]\nrole = 'user'\nweight = 0\n", 3, "tenants.a.weight"),
    ("[tenants.a]\nrequests_per_minute = 0\n", 2, "at least 1"),
    ("[tenants.a]\ntokens_per_minute = 1.5\n", 2, "tokens_per_minute"),
    ("[tenants.a]\nmax_tokens = true\n", 2, "max_tokens"),
    ("[tenants.a]\nrole = 'root'\n", 2, "user or admin"),
    ("[tenants.a]\n\nspeed = 3\n", 3, "unknown setting"),
    ("[tenants.a]\nmodels = 'tiny'\n", 2, "a list of model names"),
    ("[tenants.'a b']\n", 1, "a tenant's name"),
    ("[tenants.a]\n\n[[keys]]\ntenant = 'b'\nsha256 = '" + "0" * 64 + "'\n", 3, "has no [tenants.b]"),
    ("[tenants.a]\n\n[[keys]]\ntenant = 'a'\nsha256 = 'xyz'\n", 3, "64 lowercase hex"),
    ("[tenants.a]\n[tenants.b]\n[[keys]]\ntenant='a'\nsha256='" + "1" * 64 + "'\n[[keys]]\ntenant='b'\nsha256='"
     + "1" * 64 + "'\n", 6, "also a's"),
    ("[tenants.a]\nrole = \n", 2, "not TOML"),
    ("[tenant.a]\n", 1, "unknown table"),
])
def test_a_mistake_in_the_keys_file_is_named_with_its_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_keys(text, tmp_path / "keys.toml")
    message = str(raised.value)
    assert words in message and f"line {line}" in message, message


def test_keys_add_prints_a_new_key_once_and_writes_only_its_hash(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "keys.toml"
    first = add_key(path, "bob")
    second = add_key(path, "bob")
    other = add_key(path, "carol", role="admin")
    text = path.read_text()
    assert first != second and first.startswith("tm-") and len(first) >= 40
    assert first not in text and hash_key(first) in text and text.count("[tenants.bob]") == 1
    ring = KeyRing.of(path)
    assert ring.authenticate(first).name == ring.authenticate(second).name == "bob"
    assert ring.authenticate(other).admin and not ring.authenticate(first).admin
    with pytest.raises(ConfigError, match="--api-key's tenant"):
        add_key(path, "admin")
    with pytest.raises(ConfigError, match="name"):
        add_key(path, "no spaces")
    assert KeyRing.of(path).owners == ring.owners  # a refused add writes nothing


def test_a_broken_file_at_reload_keeps_the_old_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys.toml"
    key = add_key(path, "bob")
    tenancy = Tenancy(path)
    assert tenancy.keyed and tenancy.authenticate(key).name == "bob"
    newer = add_key(path, "dan")
    tenancy.reload_if_changed()
    assert tenancy.authenticate(newer).name == "dan"
    path.write_text(path.read_text() + "\n[tenants.eve]\nweight = -1\n")
    tenancy.reload_if_changed()
    assert tenancy.authenticate(newer).name == "dan" and tenancy.authenticate(key).name == "bob"
    assert "not reloaded" in caplog.text and "tenants.eve.weight" in caplog.text
    assert key not in caplog.text and newer not in caplog.text
    with pytest.raises(ConfigError, match="line"):  # at start the same mistake stops the server
        Tenancy(path)


def test_a_window_forgets_what_was_used_a_minute_ago() -> None:
    window = Window()
    window.add(5, 100.2)
    window.add(3, 130.7)
    assert window.used(130.9) == 8
    assert window.wait_for(4, 10, 131.0) == pytest.approx(29.0)  # the 5 of second 100 free room at 160
    assert window.wait_for(2, 10, 131.0) == 0.0
    assert window.wait_for(11, 10, 131.0) == math.inf
    assert window.reset_in(131.0) == pytest.approx(130 + SPAN - 131.0)
    assert window.used(159.9) == 8 and window.used(160.0) == 3  # 100.2 counted in the second [100, 101)
    assert window.used(190.0) == 0 and window.reset_in(190.0) == 0.0


def test_durations_read_as_openai_writes_them() -> None:
    assert [duration(s) for s in (0.02, 1.0, 1.54, 59.99, 60.0, 360.0)] == ["20ms", "1s", "1.6s", "60s", "1m0s",
                                                                             "6m0s"]


def test_requests_per_minute_hold_at_their_value_and_refuse_one_past_it() -> None:
    clock = Clock()
    limits = TenantLimits(Tenant("a", requests_per_minute=3), clock)
    for _ in range(3):
        limits.admit()
        limits.done()
    with pytest.raises(RateLimitError) as raised:
        limits.admit()
    assert raised.value.kind == "requests" and 59 <= raised.value.retry_after <= 60
    assert limits.headers() == {"x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "0",
                                "x-ratelimit-reset-requests": "1m0s"}
    clock.now += SPAN
    limits.admit()


def test_concurrent_requests_hold_at_their_value() -> None:
    limits = TenantLimits(Tenant("a", max_concurrent_requests=2), Clock())
    limits.admit()
    limits.admit()
    with pytest.raises(RateLimitError, match="concurrent"):
        limits.admit()
    limits.done()
    limits.admit()


def test_tokens_per_minute_count_prompts_at_admission_and_completions_as_made() -> None:
    clock = Clock()
    limits = TenantLimits(Tenant("a", tokens_per_minute=30), clock)
    limits.charge_prompt(20, generates=True)
    assert all(limits.take(1) for _ in range(10))  # 30: at the limit
    assert not limits.take(1)  # one past it
    with pytest.raises(RateLimitError) as raised:
        limits.charge_prompt(1, generates=False)
    assert raised.value.kind == "tokens" and "Used 30" in str(raised.value)
    with pytest.raises(RateLimitError) as too_big:
        limits.charge_prompt(31, generates=False)
    assert too_big.value.retry_after == math.inf
    assert limits.headers()["x-ratelimit-remaining-tokens"] == "0"
    clock.now += SPAN
    limits.charge_prompt(29, generates=True)  # 29 + the one token it will generate: fits
    with pytest.raises(RateLimitError):
        limits.charge_prompt(1, generates=True)
    assert TenantLimits(Tenant("free"), clock).take(10**9)


def test_usage_survives_a_restart_and_is_bucketed_by_time(tmp_path: Path) -> None:
    clock = Clock(1_800_000_000.0)
    path = tmp_path / "store.sqlite3"
    ledger = UsageLedger(path, clock)
    ledger.record("a", "m", Usage(10, 5, 2, 1))
    ledger.record("a", "m", Usage(3, 1, 0, 1))
    clock.now += 3600
    ledger.record("b", "m", Usage(7, 7, 0, 1))
    ledger.close()
    again = UsageLedger(path, clock)
    assert again.totals() == {("a", "m"): Usage(13, 6, 2, 2), ("b", "m"): Usage(7, 7, 0, 1)}
    start = 1_800_000_000 - 1_800_000_000 % 3600
    buckets = again.buckets(start, start + 2 * 3600, 3600)
    assert [(at, [(t, u.prompt_tokens) for t, _, u in rows]) for at, rows in buckets] == [
        (start, [("a", 13)]), (start + 3600, [("b", 7)])]
    assert again.buckets(start, start + 2 * 3600, 3600, tenant="b")[0][1] == []
    again.record("a", "m", Usage(1, 1, 1, 1))
    assert again.totals()[("a", "m")] == Usage(14, 7, 3, 3)
    again.close()
    assert UsageLedger(path, clock).totals()[("a", "m")] == Usage(14, 7, 3, 3)


def test_usage_without_a_file_is_kept_in_memory() -> None:
    clock = Clock(1_800_000_000.0)
    ledger = UsageLedger(None, clock)
    ledger.record("a", "m", Usage(1, 2, 0, 1))
    ledger.flush()
    assert ledger.buckets(1_799_999_940, 1_800_000_060, 60)[1][1][0][2] == Usage(1, 2, 0, 1)
