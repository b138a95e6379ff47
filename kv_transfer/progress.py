"""KVProgress: who advances a NIXL agent's transfers (no torch: CLIs import it at start)."""

from __future__ import annotations

import enum

# EVENT mode: the progress thread's poll() timeout. Traffic wakes it through UCX's event fd
# at once; this only bounds how long an event UCX did not signal can wait (and costs one
# wake-up per interval at idle: about 0.1% of a core at 100 ms, measured).
EVENT_WAKEUP_US = 100_000


class KVProgress(enum.Enum):
    """Who advances this agent's UCX worker (a TARGET must progress too: a decode worker
    receiving a WRITE, a prefill stage serving a READ).

    - ``EVENT`` (default): NIXL's progress thread sleeps in ``poll()`` on UCX's event fd and
      wakes when traffic arrives (or every ``EVENT_WAKEUP_US`` as a safety net). An idle
      agent costs nothing measurable.
    - ``POLL``: the same thread never sleeps (``poll`` with a zero timeout): it shaves the
      wake-up latency (microseconds) at the price of one core per agent, always. For
      dedicated hosts where that core is spare.
    - ``OWNER``: no thread; the owner's own calls (``check_xfer_state``, notifications)
      progress the worker, so it must call them continuously while a transfer or lease is
      live, or the peer stalls.
    """

    EVENT = "event"
    POLL = "poll"
    OWNER = "owner"
