"""The soak's client side: the mixed request kinds sent to the router, hostile requests from
hypothesis, and the tally every ended request lands in exactly once (outcome by gRPC status,
latency, hung = answered later than its deadline + 5 s, lost = never answered). Requests of
the decode workers (child processes) are tallied too: each announces its request before
sending it, so one in flight when its worker is killed ends DECODER_KILLED."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import grpc
from soak_cluster import MAX_MODEL_LEN, VOCAB  # bench/ is on sys.path
from soak_outcomes import Ended

TENANTS = 8
SYSTEM_TOKENS = 192
HUNG_AFTER_S = 5.0  # past its deadline
TICK_S = 0.1
DEFAULT_DEADLINE_S = 30.0
PREFILL = "/wavepp.prefill.v1.PrefillService/Prefill"
KINDS = {
    "tenant": 38,
    "unique": 12,
    "stream": 10,
    "deadline": 10,
    "cancel": 8,
    "abort": 4,
    "hostile": 6,
}


def system_prompt(tenant: int) -> list[int]:
    rng = random.Random(f"soak-tenant-{tenant}")
    return [rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)]


@dataclass
class Tally:
    """Every request, once: ``begin`` when sent, ``end`` when its outcome is known. Thread-
    safe (the decode drivers' reader threads report into it)."""

    outcomes: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    open: dict = field(default_factory=dict)  # id -> (kind, start, deadline, stalled)
    ended: set = field(default_factory=set)
    double_ends: int = 0
    hung: int = 0
    hung_by: Counter = field(default_factory=Counter)  # "kind:CODE" of hung requests
    worst_overrun_s: float = 0.0  # the longest answer past its deadline
    rows: list = field(default_factory=list)  # (end time, kind, code, latency, detail)
    details: Counter = field(default_factory=Counter)  # "CODE: message head" of failures
    # aborts: Abort(id) answered aborted=True for a request in flight; the ones of those that
    # did not end CANCELLED (the abort had no effect) and the ones that finished first
    aborts_landed: int = 0
    aborts_without_effect: list = field(default_factory=list)
    aborts_too_late: int = 0
    _ids: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    stall_s: float = 0.0  # how long this process's event loop has been stalled, in total
    last_tick: float = field(default_factory=time.monotonic)

    async def tick(self) -> None:
        """Measure this process's own stalls (a loaded host can stop it for seconds): a
        request is not hung for the time its client could not run."""
        while True:
            self.last_tick = time.monotonic()
            await asyncio.sleep(TICK_S)
            self.stall_s += max(0.0, time.monotonic() - self.last_tick - TICK_S)

    def _stalled(self) -> float:
        return self.stall_s + max(0.0, time.monotonic() - self.last_tick - TICK_S)

    def begin(self, kind: str, deadline_s: float, rid: str | None = None) -> str:
        with self._lock:
            if rid is None:
                self._ids += 1
                rid = f"{kind}-{self._ids}"
            self.open[rid] = (kind, time.monotonic(), deadline_s, self._stalled())
            return rid

    def end(self, rid: str, code: str, detail: str = "", answer_s: float | None = None) -> None:
        """``answer_s``: the seconds its answer took, when not the time since ``begin`` (a
        decode worker's hand-off goes on after the answer); hung is judged on it."""
        with self._lock:
            if rid in self.ended or rid not in self.open:
                self.double_ends += 1
                return
            kind, start, deadline, stalled = self.open.pop(rid)
            self.ended.add(rid)
            now = time.monotonic()
            latency = now - start
            answer = latency - (self._stalled() - stalled) if answer_s is None else answer_s
            if answer > deadline + HUNG_AFTER_S:
                self.hung += 1
                self.hung_by[f"{kind}:{code}"] += 1
                self.worst_overrun_s = max(self.worst_overrun_s, answer - deadline)
            self.outcomes[code] += 1
            self.by_kind[f"{kind}:{code}"] += 1
            self.rows.append((now, kind, code, latency, detail))
            if code != "OK":
                self.details[f"{code}: {_head(detail)}"] += 1

    def external_begin(self, row: dict) -> None:
        """A decode driver is about to send its request ``row["begin"]``."""
        self.begin(row["kind"], row["deadline_s"], row["begin"])

    def external(self, row: dict) -> None:
        """An outcome a decode driver reported (its own request, ended there)."""
        self.end(row["id"], row["code"], row.get("detail", ""), answer_s=row["prefill_s"])

    def ended_rows(self) -> list[Ended]:
        with self._lock:
            return [Ended(end - lat, end, kind, code) for end, kind, code, lat, _ in self.rows]

    def overdue(self, now: float) -> int:
        stalled = self._stalled()
        with self._lock:  # decode drivers' reader threads begin and end requests meanwhile
            return sum(
                1
                for _, start, d, s in self.open.values()
                if now - start - (stalled - s) > d + HUNG_AFTER_S
            )


def _head(detail: str) -> str:
    """A failure message without its request-specific parts (ids, numbers)."""
    import re

    return re.sub(r"\d+(\.\d+)?", "N", re.sub(r"\S*-\d+\b", "ID", detail))[:90]


def _detail(exc: BaseException) -> str:
    return (exc.details() or "") if isinstance(exc, grpc.RpcError) else ""


# grpc.aio gives a stream call this status of its own (never the server's) when a request
# write fails in the library because the connection went away under it: the server's status
# (UNAVAILABLE, with the router killed) is then never read. Counted apart, and allowed only
# right after a router kill (soak_report.unexplained_writes_lost).
WRITE_LOST_DETAILS = "Internal error from Core"
WRITE_LOST = "STREAM_WRITE_LOST"


def _code(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        if exc.code() == grpc.StatusCode.INTERNAL and exc.details() == WRITE_LOST_DETAILS:
            return WRITE_LOST
        return exc.code().name
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    return f"CLIENT_{type(exc).__name__}"


class Workload:
    """Sends one request of a random kind per ``step`` on ``client`` (AsyncPrefillClient)."""

    def __init__(self, client, channel: grpc.aio.Channel, tally: Tally, seed: str) -> None:
        self.client, self.tally = client, tally
        self.raw = channel.unary_unary(PREFILL)  # bytes in, bytes out: hostile payloads
        self.rng = random.Random(seed)
        self.systems = [system_prompt(t) for t in range(TENANTS)]
        self._payloads = hostile_requests(seed)
        self._kinds = {
            "tenant": self._tenant,
            "unique": self._unique,
            "stream": self._stream,
            "deadline": self._deadline,
            "cancel": self._cancel,
            "abort": self._abort,
            "hostile": self._hostile,
        }

    async def step(self) -> None:
        kind = self.rng.choices(list(KINDS), list(KINDS.values()))[0]
        await self._kinds[kind]()

    def _suffix(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(lo, hi))]

    async def _unary(
        self,
        kind: str,
        prompt: list[int],
        salt: str = "",
        deadline_s: float = DEFAULT_DEADLINE_S,
        cancel_after: float | None = None,
        rid: str | None = None,
    ) -> str:
        """Send one request and tally its outcome (``rid``: already begun); the code."""
        rid = rid or self.tally.begin(kind, deadline_s)
        call = self.client.prefill_call(
            prompt,
            request_id=rid,
            cache_salt=salt,
            timeout_s=deadline_s,
            deadline_s=deadline_s + HUNG_AFTER_S + 10,
        )
        loop = asyncio.get_running_loop()
        timer = None if cancel_after is None else loop.call_later(cancel_after, call.cancel)
        try:
            await call
            code, detail = "OK", ""
        except (Exception, asyncio.CancelledError) as exc:  # every outcome is tallied
            code, detail = _code(exc), _detail(exc)
        finally:
            if timer is not None:
                timer.cancel()
        self.tally.end(rid, code, detail)
        return code

    async def _tenant(self) -> None:
        t = min(int(self.rng.paretovariate(1.2)) - 1, TENANTS - 1)
        await self._unary("tenant", self.systems[t] + self._suffix(4, 200), salt=f"tenant-{t}")

    async def _unique(self) -> None:
        await self._unary("unique", self._suffix(16, 400))

    async def _deadline(self) -> None:
        t = self.rng.randrange(TENANTS)
        await self._unary(
            "deadline",
            self.systems[t] + self._suffix(100, 500),
            salt=f"tenant-{t}",
            deadline_s=self.rng.uniform(0.02, 0.5),
        )

    async def _cancel(self) -> None:
        await self._unary("cancel", self._suffix(100, 600), cancel_after=self.rng.uniform(0.0, 0.4))

    async def _abort(self) -> None:
        """A request, and Abort RPCs for its id (through the router) from a moment later
        until one lands (the router has it in flight) or the request ends first. One that
        landed must end the request CANCELLED (its blocks are freed: checked once load
        stops, as every request's)."""
        rid = self.tally.begin("abort", DEFAULT_DEADLINE_S)
        task = asyncio.ensure_future(self._unary("abort", self._suffix(100, 600), rid=rid))
        await asyncio.sleep(self.rng.uniform(0.0, 0.3))
        landed = False
        while not task.done() and not landed:
            with contextlib.suppress(grpc.RpcError):
                landed = await self.client.abort(rid)
            if not landed:
                await asyncio.wait([task], timeout=0.02)
        code = await task
        if landed:
            self.tally.aborts_landed += 1
            if code != "CANCELLED":
                self.tally.aborts_without_effect.append(f"{rid}: {code}")
        else:
            self.tally.aborts_too_late += 1

    async def _stream(self) -> None:
        from prefill_node.client.prefill_client import build_request

        n = self.rng.randint(2, 5)
        cancel_after = self.rng.uniform(0.0, 0.5) if self.rng.random() < 0.2 else None
        kind = "stream" if cancel_after is None else "stream-cancel"  # its client cancels
        ids = [self.tally.begin(kind, DEFAULT_DEADLINE_S) for _ in range(n)]
        reqs = []
        for rid in ids:
            t = self.rng.randrange(TENANTS)
            prompt = self.systems[t] + self._suffix(4, 100)
            reqs.append(
                build_request(
                    prompt, request_id=rid, cache_salt=f"tenant-{t}", timeout_s=DEFAULT_DEADLINE_S
                )
            )
        call = self.client._stub.PrefillStream(
            iter(reqs), timeout=DEFAULT_DEADLINE_S + HUNG_AFTER_S + 10
        )
        timer = (
            None
            if cancel_after is None
            else asyncio.get_running_loop().call_later(cancel_after, call.cancel)
        )
        try:
            async for item in call:
                code = (
                    "OK"
                    if item.HasField("response")
                    else grpc.StatusCode(_status(item.error.code)).name
                )
                self.tally.end(item.request_id, code, item.error.message)
        except (Exception, asyncio.CancelledError) as exc:
            for rid in ids:
                if rid in self.tally.open:
                    self.tally.end(rid, _code(exc), _detail(exc))
        if timer is not None:
            timer.cancel()
        for rid in ids:  # the stream ended without an entry for it
            if rid in self.tally.open:
                self.tally.end(rid, "CANCELLED" if call.cancelled() else "STREAM_MISSING")

    async def _hostile(self) -> None:
        payload = next(self._payloads)
        rid = self.tally.begin("hostile", DEFAULT_DEADLINE_S)
        try:
            await self.raw(payload, timeout=DEFAULT_DEADLINE_S + HUNG_AFTER_S)
            self.tally.end(rid, "OK")
        except (Exception, asyncio.CancelledError) as exc:
            self.tally.end(rid, _code(exc), _detail(exc))

    async def pressure(self, n: int) -> list[str]:
        """A burst of long unique prompts (every stage must evict to fit them); their codes."""
        return await asyncio.gather(
            *(
                self._unary("pressure", self._suffix(MAX_MODEL_LEN - 200, MAX_MODEL_LEN - 1))
                for _ in range(n)
            )
        )


def _status(number: int) -> tuple:
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code.value
    return grpc.StatusCode.UNKNOWN.value


def hostile_requests(seed: str):
    """Serialized PrefillRequests with random fields and values (hypothesis), unknown fields
    appended, oversize messages (over the router's 1 MiB limit) and unknown destinations."""
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st

    from prefill_node.client.prefill_client import build_request

    warnings.filterwarnings("ignore", module="hypothesis")
    settings.register_profile("soak", suppress_health_check=list(HealthCheck))
    u32 = st.integers(0, 2**32 - 1)
    text = st.text(max_size=40)
    push = st.builds(
        lambda a, e, t, b: _push(a, e, t, b), text, text, text, st.lists(u32, max_size=8)
    )
    request = st.builds(
        lambda rid, ids, salt, top, dest, secs, nanos, extra: _request(
            rid, ids, salt, top, dest, secs, nanos, extra
        ),
        text,
        st.lists(st.one_of(st.integers(0, VOCAB + 10), u32), max_size=300),
        text,
        st.none() | u32,
        st.none() | push | st.just("pull"),
        st.integers(-10, 10**6),
        st.integers(-(10**9), 10**9),
        st.lists(st.tuples(st.integers(16, 5000), u32), max_size=3),
    )
    rng = random.Random(seed)
    while True:
        pick = rng.random()
        if pick < 0.1:  # oversize: more than the router accepts
            yield build_request([1] * 600_000).SerializeToString()
        elif pick < 0.2:  # a destination nobody serves
            dest = _push("no-such-agent", "127.0.0.1:1", "t", [1, 2, 3]).kv_destination
            req = build_request([rng.randrange(VOCAB) for _ in range(40)])
            req.kv_destination.CopyFrom(dest)
            yield req.SerializeToString()
        else:
            yield request.example()


def _push(agent: str, endpoint: str, transfer: str, blocks: list[int]):
    from wavepp_proto.prefill.v1 import prefill_pb2

    req = prefill_pb2.PrefillRequest()
    push = req.kv_destination.push
    push.agent_name, push.transfer_id = agent, transfer
    push.block_ids.extend(blocks)
    if endpoint:
        push.metadata_endpoint = endpoint
    return req


def _request(rid, ids, salt, top, dest, secs, nanos, extra) -> bytes:
    from wavepp_proto.prefill.v1 import prefill_pb2

    req = prefill_pb2.PrefillRequest(request_id=rid, cache_salt=salt)
    req.token_ids.ids.extend(ids)
    if top is not None:
        req.top_logprobs = top
    if dest == "pull":
        req.kv_destination.pull.SetInParent()
    elif dest is not None:
        req.kv_destination.CopyFrom(dest.kv_destination)
    if secs >= 0 and nanos >= 0:
        req.timeout.seconds, req.timeout.nanos = secs, nanos % 10**9
    wire = req.SerializeToString()
    for number, value in extra:  # unknown varint fields
        wire += _varint(number << 3) + _varint(value)
    return wire


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
