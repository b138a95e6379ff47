"""The soak's verdicts on outcomes (sans-IO): which statuses each request kind may end with,
which a fault explains, the availability invariant, and the reconciliation of the client's
tally with the router's Prometheus counters.

An ended request is one ``Ended`` row. Its outcome is EXPECTED when its kind may end that
way on a healthy tier (a hostile request's INVALID_ARGUMENT, a cancel's CANCELLED, a short
deadline's DEADLINE_EXCEEDED, overload's RESOURCE_EXHAUSTED); EXPLAINED when a fault window
(``Window``: a component down, from injection until the harness saw it whole again) overlaps
the request's lifetime and the status is one a fault causes (UNAVAILABLE, a deadline missed,
a KV hand-off failure, a stream write lost); otherwise a BREACH: an invariant broken.
STREAM_MISSING (a stream ended without an entry for a request), CLIENT_* (the client library
raised something other than a gRPC status) and INTERNAL / UNKNOWN are never expected.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

# what a healthy tier may answer, per kind (besides OK)
_SHED = frozenset({"RESOURCE_EXHAUSTED"})  # overload control: "busy, retry"
EXPECTED: dict[str, frozenset[str]] = {
    "tenant": _SHED,
    "unique": _SHED,
    "stream": _SHED,
    "stream-cancel": _SHED | {"CANCELLED"},  # a stream its client cancels
    "pressure": _SHED,
    "deadline": _SHED | {"DEADLINE_EXCEEDED"},
    "cancel": _SHED | {"CANCELLED"},
    "abort": _SHED | {"CANCELLED"},
    "hostile": _SHED | {"INVALID_ARGUMENT", "DEADLINE_EXCEEDED"},  # bad input; a 0 timeout
    "push": _SHED,
    "pull": _SHED,
    "push-deadline": _SHED | {"DEADLINE_EXCEEDED"},
    "pull-deadline": _SHED | {"DEADLINE_EXCEEDED"},
    "push-cancel": _SHED | {"CANCELLED"},
    "pull-cancel": _SHED | {"CANCELLED"},
}
# what a fault overlapping a request may cause on top (a KV hand-off's decode-side failure
# is KV_<error>; a request in flight on a killed decode worker ends DECODER_KILLED)
FAULT_CAUSED = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "STREAM_WRITE_LOST",
                          "DECODER_KILLED", "CANCELLED"})  # fmt: skip
# kinds whose requests are well formed, carry a deadline of at least 10 s and are not
# cancelled by their client: the availability invariant's population
AVAILABILITY_KINDS = frozenset({"tenant", "unique", "stream", "pressure", "push", "pull"})
AVAILABILITY_GOAL = 0.99


class Verdict(Enum):
    OK = "ok"
    EXPECTED = "expected"
    EXPLAINED = "explained"
    BREACH = "breach"


@dataclass(frozen=True, slots=True)
class Ended:
    """One ended request: monotonic start and end, its kind and outcome code."""

    start: float
    end: float
    kind: str
    code: str


@dataclass(frozen=True, slots=True)
class Window:
    """A fault's span on one component (``pipeline-0``, ``decode-1``, ``router``, ``all``
    for a burst on every stage), from injection until the harness saw the tier whole."""

    start: float
    end: float
    component: str
    fault: str

    def overlaps(self, row: Ended) -> bool:
        return row.start <= self.end and row.end >= self.start


def verdict(row: Ended, windows: Sequence[Window]) -> Verdict:
    """See the module contract."""
    if row.code == "OK":
        return Verdict.OK
    if row.code in EXPECTED.get(row.kind, ()):
        return Verdict.EXPECTED
    fault_caused = row.code in FAULT_CAUSED or row.code.startswith("KV_")
    if fault_caused and any(w.overlaps(row) for w in windows):
        return Verdict.EXPLAINED
    return Verdict.BREACH


def breaches(rows: Iterable[Ended], windows: Sequence[Window]) -> Counter[str]:
    """ "kind:CODE" of every ended request whose outcome is a breach."""
    return Counter(f"{r.kind}:{r.code}" for r in rows if verdict(r, windows) is Verdict.BREACH)


@dataclass(frozen=True, slots=True)
class Availability:
    """Over the availability population outside windows where more than one component was
    faulted or the router itself was (``judged``): the share that ended OK, and how many of
    the rest no fault explains (each one a breach)."""

    judged: int
    ok: int
    unexplained: int
    excluded: int  # in the population, but overlapping the router's or overlapping faults
    unexplained_codes: Counter[str]  # "kind:CODE" of the unexplained ones
    explained_codes: Counter[str]  # "kind:CODE" of the others that did not end OK

    @property
    def ok_share(self) -> float:
        return self.ok / self.judged if self.judged else 1.0

    @property
    def holds(self) -> bool:
        return self.unexplained == 0 and self.ok_share >= AVAILABILITY_GOAL


def availability(rows: Iterable[Ended], windows: Sequence[Window]) -> Availability:
    """The availability invariant (module contract): with at most one pipeline or one
    decoder faulted at a time, >= 99% of its population ends OK, and every other outcome
    is explained by a fault window on a component the request was in flight on."""
    judged = ok = excluded = 0
    unexplained: Counter[str] = Counter()
    explained: Counter[str] = Counter()
    for r in rows:
        if r.kind not in AVAILABILITY_KINDS:
            continue
        hit = [w for w in windows if w.overlaps(r)]
        if any(w.component == "router" for w in hit) or len({w.component for w in hit}) > 1:
            excluded += 1
            continue
        judged += 1
        if r.code == "OK":
            ok += 1
        else:
            (explained if hit else unexplained)[f"{r.kind}:{r.code}"] += 1
    return Availability(judged, ok, sum(unexplained.values()), excluded, unexplained, explained)


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """The router's wavepp_requests_total{outcome} against the client's tally of the
    requests that reached the router's servicer (sent after the router started, and not
    refused by the transport or gRPC's own message limit). Every outcome but ``ok`` and
    ``cancelled`` must be equal. A request its client cancelled (or whose decode worker was
    killed) is ``undetermined``: the router counted it ``cancelled``, or ``ok`` when its
    answer was on the wire as the cancel went out, or not at all when the cancel came before
    its handler ran; so ``router ok >= client ok`` and ``router ok + cancelled <= client ok
    + undetermined``, each side counting its own cancellations."""

    router: dict[str, int]
    client: dict[str, int]
    undetermined: int

    @property
    def mismatches(self) -> dict[str, tuple[int, int]]:
        out = {}
        for outcome in set(self.router) | set(self.client):
            if outcome in ("ok", "cancelled"):
                continue
            r, c = self.router.get(outcome, 0), self.client.get(outcome, 0)
            if r != c:
                out[outcome] = (r, c)
        r_ok, c_ok = self.router.get("ok", 0), self.client.get("ok", 0)
        r_cancelled = self.router.get("cancelled", 0)
        if not (r_ok >= c_ok and r_ok + r_cancelled <= c_ok + self.undetermined):
            out["ok+cancelled"] = (r_ok + r_cancelled, c_ok + self.undetermined)
        return out


# UNAVAILABLE details of gRPC's own transport (the router was not there), not of a server
TRANSPORT_DETAILS = ("failed to connect", "connection refused", "socket closed",
                     "connection reset", "connections to all backends failing",
                     "recvmsg", "broken pipe", "endpoint closing")  # fmt: skip
MESSAGE_LIMIT_DETAILS = "larger than max"  # gRPC's own message limit, before any handler


def reached_router(code: str, detail: str) -> bool:
    """Whether a request that ended ``code`` / ``detail`` reached the router's servicer
    (else gRPC or the transport answered it: the router counts nothing)."""
    low = detail.lower()
    if code == "UNAVAILABLE" and any(t in low for t in TRANSPORT_DETAILS):
        return False
    if code == "RESOURCE_EXHAUSTED" and MESSAGE_LIMIT_DETAILS in low:
        return False
    return code != "STREAM_WRITE_LOST"


def client_outcome(code: str) -> str | None:
    """The router's outcome label for a client's code (None: undetermined, see
    ``Reconciliation``); a decode worker's KV_* after an OK prefill is the router's ok."""
    if code in ("CANCELLED", "DECODER_KILLED"):
        return None
    if code.startswith("KV_"):
        return "ok"
    return code.lower()


def reconcile(router: dict[str, int], ended: Iterable[tuple[str, str]]) -> Reconciliation:
    """``ended``: (code, detail) of every request sent after the router started."""
    client: Counter[str] = Counter()
    undetermined = 0
    for code, detail in ended:
        if not reached_router(code, detail):
            continue
        label = client_outcome(code)
        if label is None:
            undetermined += 1
        else:
            client[label] += 1
    return Reconciliation(dict(router), dict(client), undetermined)
