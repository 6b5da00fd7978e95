"""Placement policy: prefix affinity, the per-candidate hot-spot guard, random ties, decode headroom."""

import random

from pdserve.router.policy import DecodeLoad, rank_decode, rank_prefill
from tests.fakes.clock import Clock

BS = 16


def test_prefill_prefers_the_replica_holding_the_prefix():
    order = rank_prefill(["a", "b", "c"], 1000, {"b": 50}, {}, BS)
    assert order[0] == "b"


def test_hot_prefix_spreads_once_its_replica_queues_more_than_the_prefix_is_worth():
    matched = {"a": 60}  # 960 cached tokens of a 1000-token prompt
    assert rank_prefill(["a", "b"], 1000, matched, {"a": 200.0}, BS, queue_weight=1)[0] == "a"
    assert rank_prefill(["a", "b"], 1000, matched, {"a": 1200.0}, BS, queue_weight=1)[0] == "b"
    # The default weight spreads earlier: queued tokens also delay the requests behind them.
    assert rank_prefill(["a", "b"], 1000, matched, {"a": 400.0}, BS)[0] == "b"


def test_an_overloaded_replica_does_not_turn_affinity_off_for_others():
    queued = {"a": 1e6, "b": 0.0, "c": 0.0}
    assert rank_prefill(["a", "b", "c"], 1000, {"a": 60, "c": 60}, queued, BS)[0] == "c"
    assert rank_prefill(["a", "b", "c"], 1000, {"b": 30}, queued, BS)[0] == "b"


def test_a_full_hit_still_costs_the_last_token_and_ties_break_at_random():
    rng = random.Random(0)
    firsts = {rank_prefill(["a", "b", "c"], 64, {"a": 4, "b": 4}, {}, BS, rng=rng)[0] for _ in range(50)}
    assert firsts == {"a", "b"}


def test_decode_ranks_by_headroom_then_running_and_new_replicas_first():
    loads = {"a": DecodeLoad(num_free_kv_blocks=10, num_kv_blocks=100, num_running=1),
             "b": DecodeLoad(num_free_kv_blocks=80, num_kv_blocks=100, num_running=9),
             "c": DecodeLoad(num_free_kv_blocks=80, num_kv_blocks=100, num_running=2)}
    assert rank_decode(["a", "b", "c"], loads, blocks_needed=5) == ["c", "b", "a"]
    assert rank_decode(["a", "new"], loads, blocks_needed=5)[0] == "new"


def test_in_flight_corrects_a_report_for_what_finished_and_was_sent_since(monkeypatch):
    from pdserve.router import policy

    clock = Clock()
    monkeypatch.setattr(policy, "time", clock)
    f = policy.InFlight()
    f.add("try-1", "q1", "a", 100)
    assert f.estimate("a", None, None) == 100  # no report yet: own work only
    t_report = clock.time()
    clock.offset_s += 0.01
    f.finish("q1", "a")  # finished after the report was taken
    assert f.estimate("a", 100, t_report) == 0
    f.add("try-2", "q2", "a", 40)  # sent after the report
    assert f.estimate("a", 250, t_report) == 250 - 100 + 40  # other routers' work stays counted
    f.add("try-4", "q4", "a", 30)  # sent and finished since the report: never in it, so nothing to take off
    f.finish("q4", "a")
    assert f.estimate("a", 250, t_report) == 250 - 100 + 40
    f.add("try-2", "q2", "a", 40)  # a retried choice replaces, not adds
    assert f.total("a") == 40
    f.add("try-3", "q2", "b", 10)  # one client request fanning out: two entries, one request id
    f.finish("q2", "b")
    assert f.total("a") == 40 and f.total("b") == 0
    f.add("try-5", "q5", "a", 1)  # two attempts of one request id on one replica: the oldest finishes first
    f.add("try-6", "q5", "a", 2)
    f.finish("q5", "a")
    assert f.total("a") == 40 + 2
    f.finish("q5")  # the replica not known: the oldest of the request id's anywhere
    assert f.total("a") == 40
    f.forget_replicas({"b"})
    assert f.total("a") == 0 and f.estimate("a", 0, t_report) == 0


def test_late_last_routes_the_requests_inside_the_target_first_then_the_late_oldest_first():
    from collections import deque

    from pdserve.router.policy import LateLast

    order = LateLast(1.0, lambda req: req[1])
    queue = deque([("a", 0.0), ("b", 0.5), ("c", 2.9), ("d", 3.0)])
    taken = []
    while q := order.next_queue(queue, now=3.5):
        taken.append(q.popleft()[0])
    assert taken == ["c", "d", "a", "b"]  # a and b arrived 3.5 and 3.0 s ago: past the 1 s target
    # The boundary: a request exactly the target old is late; one just inside is not.
    queue = deque([("e", 2.0), ("f", 2.0001)])
    assert order.next_queue(queue, now=3.0)[0][0] == "f" and list(order.late) == [("e", 2.0)]
    assert len(order) == 1
    # Nothing waiting: the (empty) late queue, which is falsy.
    assert not LateLast(1.0, lambda req: req).next_queue(deque(), now=0.0)
