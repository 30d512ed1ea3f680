"""What each tenant may still spend this minute: requests, tokens (prompt at admission, completion as the engine
makes it), requests in flight; and OpenAI's x-ratelimit-* headers that tell the client so.

The windows slide: what was used more than a minute ago no longer counts, in one-second steps. The engine thread
takes completion tokens while the event loop admits requests, hence one lock per tenant."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from tokenmill.errors import RateLimitError
from tokenmill.tenants.keys import Tenant

SPAN = 60.0  # seconds a use counts against a per-minute limit


class Window:
    """Amounts used over the last SPAN seconds, summed per whole second of the clock."""

    def __init__(self) -> None:
        self._buckets: deque[list[float]] = deque()  # [second, amount], oldest first
        self._total = 0.0

    def used(self, now: float) -> int:
        while self._buckets and self._buckets[0][0] <= now - SPAN:
            self._total -= self._buckets.popleft()[1]
        return round(self._total)

    def add(self, amount: int, now: float) -> None:
        second = math.floor(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += amount
        else:
            self._buckets.append([second, amount])
        self._total += amount

    def wait_for(self, amount: int, limit: int, now: float) -> float:
        """Seconds until `amount` more fits under `limit` (inf: never, it is more than the limit)."""
        if amount > limit:
            return math.inf
        excess = float(self.used(now) + amount - limit)
        for second, used in self._buckets:  # the oldest expire first
            if excess <= 0:
                break
            excess -= used
            if excess <= 0:
                return max(0.0, second + SPAN - now)
        return 0.0

    def reset_in(self, now: float) -> float:
        """Seconds until nothing used now counts any longer."""
        self.used(now)
        return max(0.0, self._buckets[-1][0] + SPAN - now) if self._buckets else 0.0


def duration(seconds: float) -> str:
    """As OpenAI writes x-ratelimit-reset-*: 20ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


class TenantLimits:
    """One tenant's windows and requests in flight; `tenant` is replaced on a reload, the windows stay."""

    def __init__(self, tenant: Tenant, clock: Callable[[], float] = time.monotonic) -> None:
        self.tenant = tenant
        self.clock = clock
        self.requests = Window()
        self.tokens = Window()
        self.in_flight = 0
        self._lock = threading.Lock()

    def admit(self) -> None:
        """Count a request in (and in flight until done()), or RateLimitError."""
        t = self.tenant
        with self._lock:
            now = self.clock()
            if t.max_concurrent_requests is not None and self.in_flight >= t.max_concurrent_requests:
                raise RateLimitError(f"Rate limit reached for {t.name} on concurrent requests: Limit "
                                     f"{t.max_concurrent_requests}, In flight {self.in_flight}. Please try again "
                                     "when one has finished.", "requests", 1.0)
            if t.requests_per_minute is not None:
                used = self.requests.used(now)
                if used + 1 > t.requests_per_minute:
                    wait = self.requests.wait_for(1, t.requests_per_minute, now)
                    raise RateLimitError(f"Rate limit reached for {t.name} on requests per min (RPM): Limit "
                                         f"{t.requests_per_minute}, Used {used}, Requested 1. Please try again in "
                                         f"{duration(wait)}.", "requests", wait)
                self.requests.add(1, now)
            self.in_flight += 1

    def done(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def charge_prompt(self, tokens: int, generates: bool) -> None:
        """Count a prompt's tokens, or RateLimitError where they (and, for a request that generates, one token of
        its answer) do not fit in what is left of the minute."""
        limit = self.tenant.tokens_per_minute
        if limit is None:
            return
        with self._lock:
            now = self.clock()
            used, needed = self.tokens.used(now), tokens + int(generates)
            if used + needed > limit:
                wait = self.tokens.wait_for(needed, limit, now)
                later = "" if math.isinf(wait) else f" Please try again in {duration(wait)}."
                raise RateLimitError(f"Rate limit reached for {self.tenant.name} on tokens per min (TPM): Limit "
                                     f"{limit}, Used {used}, Requested {needed}.{later}", "tokens", wait)
            self.tokens.add(tokens, now)

    def take(self, tokens: int) -> bool:
        """Count completion tokens the engine made (on its thread); False, counting nothing, where they do not fit."""
        limit = self.tenant.tokens_per_minute
        if limit is None:
            return True
        with self._lock:
            now = self.clock()
            if self.tokens.used(now) + tokens > limit:
                return False
            self.tokens.add(tokens, now)
            return True

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limits this tenant has."""
        t, headers = self.tenant, {}
        with self._lock:
            now = self.clock()
            for kind, limit, window in (("requests", t.requests_per_minute, self.requests),
                                        ("tokens", t.tokens_per_minute, self.tokens)):
                if limit is not None:
                    headers[f"x-ratelimit-limit-{kind}"] = str(limit)
                    headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit - window.used(now)))
                    headers[f"x-ratelimit-reset-{kind}"] = duration(window.reset_in(now))
        return headers


class Limiter:
    """Every tenant's limits by name, kept across reloads of the keys file."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._tenants: dict[str, TenantLimits] = {}
        self._lock = threading.Lock()

    def of(self, tenant: Tenant) -> TenantLimits:
        with self._lock:
            limits = self._tenants.get(tenant.name)
            if limits is None:
                limits = self._tenants[tenant.name] = TenantLimits(tenant, self.clock)
            else:
                limits.tenant = tenant  # the settings of the newest read of the file
            return limits
