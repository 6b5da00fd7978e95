"""Joint prefill:decode sizing against the latency target, within one replica budget. Pure logic.

In, each control tick: what each pool saw over its look-back window (`PrefillSignal`,
`DecodeSignal`), the target (`Slo`) and the budget (`max_total_replicas`, shared by both pools).
Out: the replicas each pool should run (`JointScaler.decide`).

What each pool needs (`wanted`):
- prefill: the fewest replicas at which no more than the SLO's share of misses (1 - percentile)
  of the arriving prompts would wait longer than half the TTFT target for a replica to start them
  (`replicas_for_wait`: Erlang's formula for a pool of servers, the work arriving in prompt tokens
  at what one replica computes a second, each prompt the mean's size; the other half is for the
  prompt's own compute, its KV's transfer and the first decode step). A prompt that would wait
  longer is placed on its decode replica instead (`decode.placement`), so this is the share the
  pool leaves to decode replicas. A constant utilization cannot say this: a prompt's wait is in
  units of its service, which are milliseconds on a GPU against a TTFT target of a second (a
  large pool then runs at 95% and more), and a second on a small CPU model. Plus enough to clear
  a backlog (the tokens queued beyond what those replicas start within the wait) within half the
  TTFT target, or within the time a new replica takes to start when that is longer (a replica
  that comes after a backlog is cleared does not clear it; `StartClock` measures that time);
- decode: its occupancy (the larger of KV blocks held and sequence slots held, on the replicas
  serving) as it will be once the arrival rate holds: by Little's law a pool holds arrival rate x
  residence time requests, so while that exceeds the requests it holds now, the occupancy grows
  in proportion (a step of the load shows in the arrival rate a tick after it happens; the
  occupancy, full at most, never shows it, and mid-step it shows the step only in part). That
  brought to TARGET_KV_USAGE (the rest is headroom for the prompts the prefill pool is about to
  hand over) at the size it will have (`resized_occupancy`: fewer replicas run bigger batches,
  whose steps read more KV and take longer, so each request stays longer and the pool holds
  more), plus slots for the requests waiting to be admitted;
- and each pool whose attainment over the window is below the SLO's percentile grows by STEP_UP
  of its size (at least one replica): decode on the share of inter-token gaps within the ITL
  target, prefill on the share of first tokens within the TTFT target, but only while its own
  queue holds more than QUEUE_SHARE of the TTFT target's work (a first token that waited for a
  decode slot is decode's to fix: its load figures grow with the wait). Latency measures what the
  load figures cannot see (long contexts, local prefill stalling decodes). Not while replicas of
  the pool are still starting: the misses then are the ones those replicas are coming to fix,
  and stepping again on every tick of a start overshoots by a step a tick.
When both together exceed the budget, each pool first gets what keeps it up with its load
(`kept_up`), the rest in proportion to what each wants beyond that (at least one replica each);
with the budget spent, the split moves only once a pool's share is a whole replica from its size
(`within_budget`).

Hysteresis (`JointScaler`): a pool grows at once to what it wants; it shrinks only after its want
has stayed below its size by more than DEADBAND for `downscale_delay_s` (every tick of it), and
then by at most MAX_STEP_DOWN of its size, the next step down another delay later. A load that
swings back and forth between two levels therefore holds the pool at the higher one instead of
following it (Ray Serve drains the replicas removed). A pool with replicas still starting never
shrinks, and its wait begins once they serve: its want is measured on the replicas serving,
without the ones on their way (on real Serve, the pool grew for a missed target, the want fell
back to the load while the replica started, and the pool shrank and grew by turns).

How long a new replica takes to serve is measured, not configured (`StartClock`): from the tick
that asks for it to the first that sees it serving. It is seconds on a CPU and minutes for a
large model on GPUs, and it decides how many replicas a backlog is worth: sized for half the
TTFT target, a 400,000-token backlog asks for dozens of replicas that arrive after it is gone.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from pdserve.telemetry.averages import Average

TARGET_KV_USAGE = 0.8
STEP_UP = 0.2
DEADBAND = 0.1
MAX_STEP_DOWN = 0.5
QUEUE_SHARE = 0.25
MAX_SERVERS = 100_000


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float
    percentile: float = 99.0  # the share of requests (tokens) that must meet the target, in percent

    @property
    def attainment(self) -> float:
        return self.percentile / 100.0


@dataclass(frozen=True)
class PrefillSignal:
    num_replicas: int  # serving and starting
    queued_tokens: float  # prompt tokens waiting in the pool, all replicas
    arrival_tokens_per_s: float  # prompt tokens sent to the pool per second over the window
    tokens_per_s_per_replica: float  # what one busy replica computes per second (measured)
    ttft_attainment: float | None = None  # share of first tokens within the TTFT target (None: no requests)
    num_starting: int = 0  # of num_replicas, those not serving yet
    prompts_per_s: float | None = None  # prompts sent to the pool per second over the window (None: not measured)

    @property
    def service_s(self) -> float | None:
        """How long one replica computes the mean prompt (None: no prompts measured)."""
        if not self.prompts_per_s or not self.arrival_tokens_per_s:
            return None
        return self.arrival_tokens_per_s / self.prompts_per_s / max(self.tokens_per_s_per_replica, 1e-9)


@dataclass(frozen=True)
class DecodeSignal:
    num_replicas: int  # serving and starting
    kv_usage: float  # KV blocks held / KV blocks, over the replicas serving (0..1)
    itl_attainment: float | None = None  # share of inter-token gaps within the ITL target (None: no tokens)
    seq_usage: float = 0.0  # sequences held / sequence slots (max_num_seqs), over the replicas serving (0..1)
    num_waiting: float = 0.0  # requests routed to the pool and not admitted yet
    slots_per_replica: int = 256  # max_num_seqs
    num_starting: int = 0  # of num_replicas, those not serving yet
    arrivals_per_s: float | None = None  # requests the pool received a second over the window (None: not measured)
    residence_s: float | None = None  # how long the requests that ended over the window were held, on average
    num_held: float = 0.0  # requests the pool holds now
    kv_read_share: float = 0.0  # the KV's share of the bytes a decode step reads (decode.placement), mean a replica

    @property
    def growth(self) -> float:
        """How much its occupancy grows before arrivals and departures balance, at least 1: the
        requests it will hold (arrival rate x residence time, Little's law) over those it holds."""
        if not (self.arrivals_per_s and self.residence_s and self.num_held):
            return 1.0
        return max(1.0, self.arrivals_per_s * self.residence_s / self.num_held)


def resized_occupancy(occupancy: float, kv_share: float, size_ratio: float) -> float:
    """A decode pool's occupancy once it has `size_ratio` times its replicas, the load unchanged.

    A step takes a fixed part (the weights) and a part that grows with the batch (its KV), the
    latter `kv_share` (x) of it now. Over n' = r n replicas each batch is 1/r times as large; a
    request stays as many steps, each that much longer, so the pool holds more and each batch
    grows further. With steps a + k b long, a request m steps and arrivals at a rate L, a replica's
    batch b = L (W0 + m (a + k b)) / n' at steady load, so b (n' - L m k) is the same at every size,
    and L m k = x n (x = k b / (a + k b) at the size measured): b'/b = (1 - x) / (r - x). At r = x
    and below the pool cannot keep up (infinite)."""
    return occupancy * (1 - kv_share) / (size_ratio - kv_share) if size_ratio > kv_share else math.inf


def replicas_for_wait(offered: float, service_s: float, wait_s: float, late_share: float) -> int:
    """The fewest servers at which at most `late_share` of arrivals wait longer than `wait_s` to
    start, when `offered` servers' worth of work arrives (arrival rate x mean service time) in jobs
    of `service_s` on average: Erlang's delay formula (M/M/n), P(wait > t) = C(n, a) e^-(n - a) t / s,
    C(n, a) the chance to wait at all. With exponential service times it overstates the wait of
    jobs that vary less (prompt lengths within a range): it errs towards a replica more.

    C(n, a) comes from Erlang's loss formula B(n, a), built up one server at a time (B(0) = 1,
    B(n) = a B(n-1) / (n + a B(n-1))), which stays within floating point at thousands of servers
    where the factorials do not. It takes a step a server: past MAX_SERVERS' worth of work (more
    than any budget, e.g. a replica's rate measured near zero) the work's own count is returned,
    for the budget to cut, instead of a control tick spent counting."""
    if offered <= 0:
        return 0
    if offered >= MAX_SERVERS:
        return math.ceil(offered)
    if wait_s <= 0 or service_s <= 0 or not 0 < late_share < 1:
        raise ValueError("the wait and service times must be positive, the late share within (0, 1)")
    n, loss = 0, 1.0
    while True:
        n += 1
        loss = offered * loss / (n + offered * loss)
        if n > offered:
            delay = loss / (1 - offered / n * (1 - loss))
            if delay * math.exp(-(n - offered) * wait_s / service_s) <= late_share:
                return n


def wanted(prefill: PrefillSignal, decode: DecodeSignal, slo: Slo, replica_start_s: float = 0.0) -> tuple[int, int]:
    """What each pool needs for this window's load and latency, before the budget and hysteresis."""
    rate, wait_s = max(prefill.tokens_per_s_per_replica, 1e-9), slo.ttft_s / 2
    # Prompts not counted (a pool just started): each as long as the wait it may take.
    p = replicas_for_wait(prefill.arrival_tokens_per_s / rate, prefill.service_s or wait_s, wait_s,
                          1 - slo.attainment)
    # A backlog: more queued than those replicas start within the wait (after a step of the load;
    # the queue a sized pool holds as it is, one prompt or two a replica, is no backlog).
    backlog = prefill.queued_tokens - p * rate * wait_s
    p += max(0, math.ceil(backlog / (rate * max(wait_s, replica_start_s)) - 1e-9))
    queue_s = prefill.queued_tokens / (rate * max(prefill.num_replicas - prefill.num_starting, 1))
    if prefill.ttft_attainment is not None and prefill.ttft_attainment < slo.attainment \
            and queue_s > QUEUE_SHARE * slo.ttft_s and not prefill.num_starting:
        p = max(p, prefill.num_replicas + max(1, math.ceil(STEP_UP * prefill.num_replicas)))
    d = math.ceil(_decode_replicas(decode, TARGET_KV_USAGE) + decode.num_waiting / decode.slots_per_replica - 1e-9)
    if decode.itl_attainment is not None and decode.itl_attainment < slo.attainment and not decode.num_starting:
        d = max(d, decode.num_replicas + max(1, math.ceil(STEP_UP * decode.num_replicas)))
    return max(1, p), max(1, d)


def _decode_replicas(decode: DecodeSignal, target: float) -> float:
    """The fewest decode replicas whose resized occupancy is at most `target` (resized_occupancy
    solved for r)."""
    occupancy, x = max(decode.kv_usage, decode.seq_usage) * decode.growth, decode.kv_read_share
    return (decode.num_replicas - decode.num_starting) * (x + (1 - x) * occupancy / target)


def kept_up(prefill: PrefillSignal, decode: DecodeSignal) -> tuple[float, float]:
    """The replicas each pool needs just to keep up with its load: prefill's arrivals at full
    utilization, decode's occupancy to come filling its replicas (no headroom, no backlog, no
    missed target's step)."""
    return (prefill.arrival_tokens_per_s / max(prefill.tokens_per_s_per_replica, 1e-9),
            _decode_replicas(decode, 1.0))


def within_budget(prefill: int, decode: int, max_total_replicas: int, current: tuple[int, int] | None = None,
                  needed: tuple[float, float] = (0.0, 0.0)) -> tuple[int, int]:
    """Both pools' wants fitted into the budget (each keeps at least one replica).

    Each pool first gets what keeps it up with its load (`needed`: `kept_up`, at most its want);
    the rest goes in proportion to what each wants beyond that (headroom, a backlog, a missed
    target's step): in proportion to whole wants, a prefill pool that kept up at 3 replicas but
    wanted 5 for its headroom took a replica from a decode pool that kept up only at 5. When even
    the needs exceed the budget, in proportion to them. With the budget spent already (`current`,
    the pools' sizes now), the split moves only once a pool's share is a whole replica away from
    its size: a move drains a replica in one pool and starts one in the other, and the wants'
    tick-to-tick noise moves the share by fractions (rounded afresh each tick, 3 + 5 flipped to
    4 + 4 and back)."""
    if max_total_replicas < 2:
        raise ValueError("max_total_replicas must leave each pool a replica (at least 2)")
    if prefill + decode <= max_total_replicas:
        return prefill, decode
    need_p, need_d = min(needed[0], prefill), min(needed[1], decode)
    room = max_total_replicas - need_p - need_d
    if room > 0:
        share = need_p + room * (prefill - need_p) / (prefill - need_p + decode - need_d)
    else:
        share = max_total_replicas * need_p / (need_p + need_d)
    if current is not None and sum(current) == max_total_replicas and abs(share - current[0]) < 1:
        return current
    p = min(max_total_replicas - 1, max(1, round(share)))
    return p, max_total_replicas - p


class _Damper:
    """One pool's hysteresis: up at once, down after a sustained low want, by a bounded step."""

    def __init__(self, downscale_delay_s: float):
        self.downscale_delay_s = downscale_delay_s
        self.low_since: float | None = None

    def next(self, current: int, want: int, now_s: float, starting: bool = False) -> int:
        if starting or want >= current * (1 - DEADBAND):  # more, inside the dead band, or starting: never less
            self.low_since = None
            return max(current, want)
        if self.low_since is None:
            self.low_since = now_s
        if now_s - self.low_since < self.downscale_delay_s:
            return current
        self.low_since = now_s  # the next step down waits another delay
        return max(want, current - max(1, math.floor(MAX_STEP_DOWN * current)))


class StartClock:
    """How long a new replica takes to serve, as the policy sees it: from the tick that asked for
    it to the first tick that counts it serving. A moving average over both pools (the same
    model's weights load in each), `prior_s` until a replica has started.

    Each pool's asks wait in order; a replica that comes serving answers the oldest. Asks beyond
    the replicas still starting were not carried out (the pool's ceiling, the budget): the newest
    go. A replica that replaces a lost one was never asked for here; it may answer an ask of
    another replica still starting, which then answers none: the error stays one replica's."""

    def __init__(self, prior_s: float = 0.0):
        if prior_s < 0:
            raise ValueError("a replica's start time must not be negative")
        self._average = Average(prior_s)
        self._asked: dict[str, deque[float]] = {"prefill": deque(), "decode": deque()}
        self._serving: dict[str, int] = {}

    @property
    def seconds(self) -> float:
        return self._average.value

    @property
    def num_samples(self) -> int:
        return self._average.num_samples

    def saw(self, pool: str, now_s: float, num_serving: int, num_starting: int) -> None:
        """A tick's count of the pool's replicas serving and starting."""
        asked = self._asked[pool]
        for _ in range(min(num_serving - self._serving.get(pool, num_serving), len(asked))):
            self._average.add(now_s - asked.popleft())
        while len(asked) > num_starting:
            asked.pop()
        self._serving[pool] = num_serving

    def ask(self, pool: str, now_s: float, num_replicas: int) -> None:
        """This tick asked the pool for `num_replicas` more."""
        self._asked[pool].extend([now_s] * num_replicas)


class JointScaler:
    """The joint policy's state across ticks; `decide` once per control tick. `replica_start_s`
    is the prior of the measured start time (`StartClock`)."""

    def __init__(self, slo: Slo, max_total_replicas: int, downscale_delay_s: float = 30.0,
                 replica_start_s: float = 0.0):
        if downscale_delay_s < 0:
            raise ValueError("downscale_delay_s must not be negative")
        within_budget(1, 1, max_total_replicas)  # validates the budget
        self.slo, self.max_total_replicas = slo, max_total_replicas
        self.starts = StartClock(replica_start_s)
        self._prefill, self._decode = _Damper(downscale_delay_s), _Damper(downscale_delay_s)

    def decide(self, prefill: PrefillSignal, decode: DecodeSignal, now_s: float,
               max_prefill: int | None = None, max_decode: int | None = None) -> tuple[int, int]:
        """Both pools' next sizes. A pool's own ceiling (`max_prefill`, `max_decode`) applies
        before the budget is split, so a share one pool cannot take stays with the other."""
        for pool, signal in (("prefill", prefill), ("decode", decode)):
            self.starts.saw(pool, now_s, signal.num_replicas - signal.num_starting, signal.num_starting)
        p, d = wanted(prefill, decode, self.slo, self.starts.seconds)
        p = self._prefill.next(prefill.num_replicas, p, now_s, prefill.num_starting > 0)
        d = self._decode.next(decode.num_replicas, d, now_s, decode.num_starting > 0)
        p, d = within_budget(min(p, max_prefill or p), min(d, max_decode or d), self.max_total_replicas,
                             (prefill.num_replicas, decode.num_replicas), kept_up(prefill, decode))
        self.starts.ask("prefill", now_s, p - prefill.num_replicas)
        self.starts.ask("decode", now_s, d - decode.num_replicas)
        return p, d
