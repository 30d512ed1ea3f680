"""Tenants as pure logic: the keys file (its mistakes named by line), the per-minute windows and limits at their
value and one past it, and the usage ledger across a restart."""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
from pathlib import Path

import pytest

from tokenmill.errors import ConfigError, RateLimitError
from tokenmill.tenants.keys import KeyRing, Tenant, add_key, hash_key, parse_keys
from tokenmill.tenants.limits import SPAN, Limiter, TenantLimits, Window, duration
from tokenmill.tenants.tenancy import Tenancy
from tokenmill.tenants.usage import KEPT_IN_MEMORY, Usage, UsageLedger

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


LIMIT = "a whole number, at least 1 (leave it out for no limit)"
NAME_RULE = "1 to 64 letters, digits, '_', '.' or '-'"
HASH = "'" + "0" * 64 + "'"


@pytest.mark.parametrize(("text", "message"), [
    ("[tenants.a]\nrole = 'user'\nweight = 0\n", "line 3: tenants.a.weight: a number above 0, at most 1000"),
    ("[tenants.a]\nweight = 1000.5\n", "line 2: tenants.a.weight: a number above 0, at most 1000"),
    ("[tenants.a]\nweight = true\n", "line 2: tenants.a.weight: a number above 0, at most 1000"),
    ("[tenants.a]\nrequests_per_minute = 0\n", f"line 2: tenants.a.requests_per_minute: {LIMIT}"),
    ("[tenants.a]\ntokens_per_minute = 1.5\n", f"line 2: tenants.a.tokens_per_minute: {LIMIT}"),
    ("[tenants.a]\nmax_tokens = true\n", f"line 2: tenants.a.max_tokens: {LIMIT}"),
    ("[tenants.a]\nrole = 'root'\n", "line 2: tenants.a.role: 'root': user or admin"),
    ("[tenants.a]\n\nspeed = 3\n", "line 3: tenants.a.speed: unknown setting (known: cache_group, "
     "max_concurrent_requests, max_tokens, models, requests_per_minute, role, tokens_per_minute, weight)"),
    ("[tenants.a]\nmodels = 'tiny'\n", "line 2: tenants.a.models: a list of model names"),
    ("[tenants.a]\nmodels = ['tiny', 3]\n", "line 2: tenants.a.models: a list of model names"),
    ("[tenants.a]\ncache_group = 'a b'\n", f"line 2: tenants.a.cache_group: {NAME_RULE}"),
    ("[tenants.a]\ncache_group = 7\n", f"line 2: tenants.a.cache_group: {NAME_RULE}"),
    ("[tenants.'a b']\n", f"line 1: tenants.a b: a tenant's name is {NAME_RULE}"),
    ("[tenants]\nb = 1\na = 3\n", "line 2: tenants.b: a table, [tenants.b]"),
    ("tenants = 3\n", "line 1: tenants: a table of tables, [tenants.NAME]"),
    ("keys = 3\n", "line 1: keys: an array of tables, [[keys]]"),
    ("# keys\nkeys = [1]\n", "line 2: keys entry 1: a table"),
    (f"[tenants.a]\n\n[[keys]]\ntenant = 'a'\nsha256 = {HASH}\nowner = 'x'\n",
     "line 3: keys entry 1: unknown field 'owner' (tenant, sha256, created, label)"),
    (f"[tenants.a]\n\n[[keys]]\ntenant = 'b'\nsha256 = {HASH}\n", "line 3: keys entry 1: tenant 'b' has no "
     "[tenants.b] table"),
    ("[tenants.a]\n\n[[keys]]\ntenant = 'a'\nsha256 = 'xyz'\n", "line 3: keys entry 1: sha256: the key's SHA-256 "
     "as 64 lowercase hex digits (tokenmill keys add writes it)"),
    ("[tenants.a]\n[tenants.b]\n[[keys]]\ntenant='a'\nsha256='" + "1" * 64 + "'\n[[ keys ]]\ntenant='b'\n"
     "sha256='" + "1" * 64 + "'\n", "line 6: keys entry 2: the same key hash is also a's"),
    ("[tenant.a]\n", "line 1: unknown table or key 'tenant': the file holds [tenants.NAME] tables and [[keys]]"),
    ("[tenants.a]\nrole = 'user'\n[tenants.a.limits]\nx = 1\n[tenants.b]\nlimits = 2\n", "line 1: tenants.a.limits: "
     "unknown setting (known: cache_group, max_concurrent_requests, max_tokens, models, requests_per_minute, role, "
     "tokens_per_minute, weight)"),
])
def test_a_mistake_in_the_keys_file_is_named_with_its_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys.toml"
    with pytest.raises(ConfigError) as raised:
        parse_keys(text, path)
    assert str(raised.value) == f"{path}, {message}"


def test_a_mistake_the_file_gives_no_line_of_is_named_without_one(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    with pytest.raises(ConfigError) as raised:
        parse_keys("[tenants]\na = { weight = 0 }\n", path)  # an inline table: no line of its own
    assert str(raised.value) == f"{path}: tenants.a.weight: a number above 0, at most 1000"


def test_a_keys_file_that_cannot_be_read_or_takes_the_admin_s_name_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "none.toml"
    with pytest.raises(ConfigError) as raised:
        KeyRing.of(missing)
    assert str(raised.value) == f"--api-keys {missing}: cannot read it: No such file or directory"
    taken = tmp_path / "keys.toml"
    taken.write_text("[tenants.admin]\n")
    with pytest.raises(ConfigError) as named:
        KeyRing.of(taken, admin_keys=("k",))
    assert str(named.value) == f"{taken}: tenants.admin is the name of --api-key's tenant; choose another"
    assert KeyRing.of(taken).tenants == {"admin": Tenant("admin")}  # the name is free without --api-key
    taken.write_text("[tenants.a]\nweight = 0\n")
    with pytest.raises(ConfigError) as mistaken:
        KeyRing.of(taken)
    assert str(mistaken.value) == f"{taken}, line 2: tenants.a.weight: a number above 0, at most 1000"
    alone = KeyRing.of(None, admin_keys=("k",))  # --api-key without a file
    assert alone.tenants == {"admin": Tenant("admin", role="admin")} and alone.authenticate("k").admin


def test_a_keys_file_that_is_no_toml_is_refused_with_the_parser_s_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"keys.toml: not TOML: .*\(at line 2, column 8\)$"):
        parse_keys("[tenants.a]\nrole = \n", tmp_path / "keys.toml")


def test_limits_and_weights_at_their_bounds_are_accepted(tmp_path: Path) -> None:
    tenants, _ = parse_keys("[tenants.a]\nrequests_per_minute = 1\ntokens_per_minute = 1\n"
                            "max_concurrent_requests = 1\nmax_tokens = 1\nweight = 1000\ncache_group = 'x'\n"
                            "[tenants.b]\nweight = 0.001\n[tenants.c]\n", tmp_path / "keys.toml")
    assert tenants["a"] == Tenant("a", "user", 1, 1, 1, 1, None, 1000.0, "x")
    assert tenants["b"].weight == 0.001 and tenants["c"] == Tenant("c")  # leaving a setting out: the default
    assert parse_keys("", tmp_path / "keys.toml") == ({}, {})  # no tenants yet, no keys yet
    labelled = f"[tenants.a]\n[[keys]]\ntenant = 'a'\nsha256 = {HASH}\nlabel = 'laptop'\ncreated = '2026-12-07'\n"
    assert parse_keys(labelled, tmp_path / "keys.toml")[1] == {"0" * 64: "a"}


def test_keys_add_prints_a_new_key_once_and_writes_only_its_hash(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "tenants" / "keys.toml"
    first = add_key(path, "bob")
    second = add_key(path, "bob")
    other = add_key(path, "carol", role="admin")
    text = path.read_text()
    assert first != second and first.startswith("tm-") and len(first) == 3 + 43  # 32 random bytes, base64
    assert first not in text and hash_key(first) in text and text.count("[tenants.bob]") == 1
    ring = KeyRing.of(path)
    assert ring.authenticate(first).name == ring.authenticate(second).name == "bob"
    assert ring.authenticate(other).admin and not ring.authenticate(first).admin
    with pytest.raises(ConfigError, match="--api-key's tenant"):
        add_key(path, "admin")
    with pytest.raises(ConfigError, match="name"):
        add_key(path, "no spaces")
    with pytest.raises(ConfigError, match=f"^{path}, line .*: tenants.dan.role: 'root': user or admin$"):
        add_key(path, "dan", role="root")  # what it would write is read back first
    assert KeyRing.of(path).owners == ring.owners  # a refused add writes nothing


def test_keys_add_appends_to_a_file_whose_last_line_has_no_newline(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text("[tenants.amy]\nweight = 2.0")
    key = add_key(path, "amy")
    other = add_key(path, "bo")
    ring = KeyRing.of(path)
    assert ring.authenticate(key) == Tenant("amy", weight=2.0) and ring.authenticate(other) == Tenant("bo")


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


def test_a_window_makes_room_at_the_limit_exactly_and_not_before() -> None:
    window = Window()
    window.add(5, 100.2)
    window.add(3, 130.7)  # 8 used at 131
    assert window.wait_for(7, 10, 131.0) == pytest.approx(29.0)  # 15: the 5 of second 100 leave exactly 10
    assert window.wait_for(3, 10, 131.0) == pytest.approx(29.0)  # 11: one past the limit waits too
    assert window.wait_for(10, 10, 131.0) == pytest.approx(59.0)  # the whole limit: once both are gone
    assert window.wait_for(8, 10, 131.0) == pytest.approx(59.0)  # one short after the first: the second too
    assert Window().wait_for(10, 10, 131.0) == 0.0
    assert window.wait_for(3, 10, 159.5) == pytest.approx(0.5)  # under a second is not rounded up
    assert window.reset_in(189.5) == pytest.approx(0.5)


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


def test_a_request_past_the_minute_s_limit_waits_for_the_oldest_to_expire() -> None:
    clock = Clock()
    limits = TenantLimits(Tenant("a", requests_per_minute=3), clock)
    for _ in range(3):
        limits.admit()
        limits.done()
        clock.now += 10
    with pytest.raises(RateLimitError, match=r"requests per min \(RPM\): Limit 3, Used 3") as raised:
        limits.admit()
    assert raised.value.retry_after == pytest.approx(30.0)  # the first, of second 1000, counts until 1060


def test_concurrent_requests_hold_at_their_value() -> None:
    limits = TenantLimits(Tenant("a", max_concurrent_requests=2), Clock())
    limits.admit()
    limits.admit()
    with pytest.raises(RateLimitError, match="concurrent requests: Limit 2, In flight 2. Please try again when one "
                       "has finished.$") as raised:
        limits.admit()
    assert raised.value.kind == "requests" and raised.value.retry_after == 1.0
    limits.done()
    limits.admit()


def test_a_tenant_s_windows_run_on_the_limiter_s_clock_and_outlast_a_reload() -> None:
    clock = Clock()
    limiter = Limiter(clock)
    limits = limiter.of(Tenant("a", requests_per_minute=1))
    limits.admit()
    reloaded = limiter.of(Tenant("a", requests_per_minute=2))  # the file re-read with a higher limit
    assert reloaded is limits and limits.tenant.requests_per_minute == 2
    limits.admit()
    with pytest.raises(RateLimitError):
        limits.admit()
    clock.now += SPAN
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
    assert str(raised.value).endswith("Please try again in 1m0s.")
    with pytest.raises(RateLimitError) as too_big:
        limits.charge_prompt(31, generates=False)
    assert too_big.value.retry_after == math.inf and str(too_big.value).endswith("Requested 31.")
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


def test_usage_buckets_hold_each_minute_in_the_bucket_it_falls_in(tmp_path: Path) -> None:
    start = 1_800_000_000  # a whole hour
    clock = Clock(start + 30 * 60 + 5)
    for path in (tmp_path / "store.sqlite3", None):
        ledger = UsageLedger(path, clock)
        ledger.record("a", "m", Usage(1, 0, 0, 1))  # half past: the first hour's bucket
        clock.now = start + 2 * 3600  # the end of the second bucket: counted in neither
        ledger.record("b", "n", Usage(2, 0, 0, 1))
        assert ledger.buckets(start, start + 2 * 3600, 3600) == [
            (start, [("a", "m", Usage(1, 0, 0, 1))]), (start + 3600, [])], path
        assert ledger.buckets(start + 2 * 3600, start + 3 * 3600, 3600) == [
            (start + 2 * 3600, [("b", "n", Usage(2, 0, 0, 1))])], path
        clock.now = start + 30 * 60 + 5
        ledger.close()
        ledger.close()  # a second close is a no-op


def test_usage_without_a_file_keeps_a_month(tmp_path: Path) -> None:
    clock = Clock(1_800_000_000.0)
    ledger = UsageLedger(None, clock)
    ledger.record("a", "m", Usage(1, 0, 0, 1))
    clock.now += KEPT_IN_MEMORY
    ledger.flush()
    assert ledger.buckets(1_800_000_000, 1_800_000_060, 60)[0][1] == [("a", "m", Usage(1, 0, 0, 1))]
    clock.now += 60
    ledger.flush()
    assert ledger.buckets(1_800_000_000, 1_800_000_060, 60)[0][1] == []
    assert ledger.totals() == {("a", "m"): Usage(1, 0, 0, 1)}  # what /metrics counts keeps counting


def test_usage_a_flush_could_not_write_is_kept_and_written_by_the_next(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "store.sqlite3"
    clock = Clock(1_800_000_000.0)
    ledger = UsageLedger(path, clock)
    ledger.record("a", "m", Usage(3, 4, 0, 1))
    with sqlite3.connect(path) as db:  # every write fails, as on a full disk
        db.execute("CREATE TRIGGER full BEFORE INSERT ON usage BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    ledger.flush()
    assert [r.getMessage() for r in caplog.records] == ["usage not written (disk full): kept in memory, tried again "
                                                        "next time"]
    with sqlite3.connect(path) as db:
        db.execute("DROP TRIGGER full")
    ledger.record("a", "m", Usage(1, 1, 0, 1))
    ledger.close()
    again = UsageLedger(path, clock)
    assert again.buckets(1_800_000_000, 1_800_000_060, 60)[0][1] == [("a", "m", Usage(4, 5, 0, 2))]


def test_usage_is_written_from_another_thread(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    ledger = UsageLedger(path, Clock(1_800_000_000.0))
    ledger.record("a", "m", Usage(1, 0, 0, 1))
    writer = threading.Thread(target=ledger.flush)
    writer.start()
    writer.join()
    assert UsageLedger(path).totals() == {("a", "m"): Usage(1, 0, 0, 1)}  # written before close


def test_a_usage_store_that_cannot_be_opened_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        UsageLedger(tmp_path)  # a folder
    assert str(raised.value).startswith(f"--responses-store {tmp_path}: cannot keep usage in it: ")


def test_a_reload_keeps_the_api_key_s_admin_and_says_what_it_read(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenmill.tenants.tenancy")
    path = tmp_path / "keys.toml"
    path.write_text(GOOD)
    tenancy = Tenancy(path, admin_keys=("flag-key",))
    tenancy.reload_if_changed()
    assert caplog.records == []  # nothing changed: nothing read
    assert tenancy.reload() is True
    tenancy.reload_if_changed()  # the reload saw the file as it is now
    assert [r.getMessage() for r in caplog.records] == [f"keys reloaded from {path}: 3 tenants, 3 keys"]
    assert tenancy.authenticate("flag-key").admin and tenancy.authenticate("alice-key").name == "alice"
    caplog.clear()
    broken = GOOD + "\n[tenants.eve]\nweight = -1\n"
    path.write_text(broken)
    assert tenancy.reload() is False
    line = broken.splitlines().index("weight = -1") + 1
    assert [r.getMessage() for r in caplog.records] == [
        f"the keys file was not reloaded, the keys read before stay in force: {path}, line {line}: tenants.eve.weight: "
        "a number above 0, at most 1000"]
    assert tenancy.authenticate("flag-key").admin
    assert Tenancy(None).ledger.totals() == {}  # usage kept in memory where no store is given
