"""pdserve bench: metric definitions, arrivals, exact prompts, and runs against a scripted server."""

import asyncio
import gc
import json
import math
import socket

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import Connections, send_request
from pdserve.bench.metrics import MaxGoodput, RequestRecord, compute_metrics, max_goodput_rate, parse_slo
from pdserve.bench.runner import RunSettings, run_benchmark
from pdserve.bench.workloads import (PromptBuilder, long_prompt_mix_workload, random_workload, replay_workload,
                                     sample_lengths, shared_prefix_workload)
from tests.fakes.openai_stub import OpenAIStub
from tests.fakes.tiny_tokenizers import STYLES, write_tokenizer


def test_metrics_match_hand_computation():
    records = [
        RequestRecord(send_s=0.0, prompt_tokens=10, chunk_times_s=[0.1, 0.15, 0.25], end_s=0.25, output_tokens=3),
        RequestRecord(send_s=1.0, prompt_tokens=20, chunk_times_s=[1.2, 1.3], end_s=1.35, output_tokens=2),
        RequestRecord(send_s=1.5, prompt_tokens=5, error="http_500"),
    ]
    m = compute_metrics(records, duration_s=2.0, slo=parse_slo("ttft=150ms,tpot=100ms"))
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, {"http_500": 1})
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 5)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.5
    assert m["total_token_throughput"] == 17.5
    # TTFT 100 and 200 ms; TPOT (250-100)/2 = 75 and (350-200)/1 = 150; ITL 50, 100, 100; E2E 250, 350.
    assert m["mean_ttft_ms"] == pytest.approx(150) and m["p99_ttft_ms"] == pytest.approx(199)
    assert m["mean_tpot_ms"] == pytest.approx(112.5) and m["median_tpot_ms"] == pytest.approx(112.5)
    assert m["mean_itl_ms"] == pytest.approx(250 / 3) and m["median_itl_ms"] == pytest.approx(100)
    assert m["p90_itl_ms"] == pytest.approx(100) and m["p50_itl_ms"] == pytest.approx(100)
    assert m["mean_e2el_ms"] == pytest.approx(300) and m["p90_e2el_ms"] == pytest.approx(340)
    # Only the first request meets both SLOs: 1 good request in 2 s.
    assert m["request_goodput"] == pytest.approx(0.5)
    assert m["slo_attainment"] == pytest.approx(1 / 3)  # of the three sent, the failed one included


def test_single_token_requests_have_no_tpot():
    r = RequestRecord(send_s=0.0, prompt_tokens=1, chunk_times_s=[0.1], end_s=0.1, output_tokens=1)
    assert r.tpot_s is None and r.itls_s == []


def test_slo_parsing():
    assert parse_slo("ttft=0.5s, tpot=50ms,e2el=2000") == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    for bad in ("latency=5ms", "ttft=", "ttft=-1ms"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_max_goodput_rate_is_where_attainment_first_drops_below_the_target():
    # 0.95 at 2 req/s, 0.85 at 3: the 0.9 line is crossed halfway. The lucky 0.92 at 4 is past the knee.
    g = max_goodput_rate([(3, 0.85), (1, 1.0), (2, 0.95), (4, 0.92)], 0.9)
    assert g.rate == pytest.approx(2.5) and g.exact
    assert max_goodput_rate([(1, 1.0), (2, 0.9), (3, 0.5)], 0.9) == MaxGoodput(2.0, exact=True)
    assert max_goodput_rate([(1, 1.0), (2, 0.97)], 0.9) == MaxGoodput(2.0, exact=False)  # a lower bound
    assert max_goodput_rate([(1, 0.8), (2, 0.5)], 0.9) is None
    assert max_goodput_rate([], 0.9) is None
    with pytest.raises(ValueError):
        max_goodput_rate([(1, 1.0)], 0)


def test_poisson_arrivals_have_the_requested_rate():
    gaps = np.diff(arrival_offsets(20001, rate=5.0, kind="poisson", seed=1))
    # Mean of 20,000 exponential gaps: standard error 0.2 / sqrt(20000) ~ 0.0014 s.
    assert abs(gaps.mean() - 0.2) < 5 * 0.2 / math.sqrt(len(gaps))
    assert abs(gaps.std() - 0.2) < 0.01  # exponential: std equals mean
    assert arrival_offsets(5, 2.0, "poisson", seed=3) == arrival_offsets(5, 2.0, "poisson", seed=3)
    assert arrival_offsets(4, 4.0, "constant") == [0.0, 0.25, 0.5, 0.75]


@pytest.fixture(scope="module", params=STYLES)
def builder(request, tmp_path_factory):
    return PromptBuilder(str(write_tokenizer(request.param, tmp_path_factory.mktemp(request.param))))


def test_prompts_have_exact_token_counts(builder):
    wanted = sample_lengths("1:3000", 20, np.random.default_rng(2))  # random_workload draws these first
    reqs = random_workload(builder, 20, "1:3000", "16", seed=2)
    for req, n in zip(reqs, wanted):
        ids = builder.tokenizer.encode(req.prompt, add_special_tokens=False).ids
        assert len(ids) == req.prompt_tokens == n and ids == req.prompt_token_ids


def test_shared_prefix_prompts_share_exactly_the_system_prompt(builder):
    reqs = shared_prefix_workload(builder, 200, num_tenants=5, system_len=64, question_len="8:16",
                                  output_len="8", popularity="zipf", seed=4)
    encoded = [builder.tokenizer.encode(r.prompt, add_special_tokens=False).ids for r in reqs]
    assert all(e == r.prompt_token_ids for e, r in zip(encoded, reqs))
    assert all(64 + 8 <= len(e) <= 64 + 16 for e in encoded)

    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    by_tenant = {}
    for r, ids in zip(reqs, encoded):
        by_tenant.setdefault(r.tenant, []).append(ids)
    for prompts in by_tenant.values():
        for other in prompts[1:]:
            shared = common(prompts[0], other)
            # Exactly the 64 system tokens, unless the questions happen to start alike.
            assert shared == 64 or (shared > 64 and prompts[0][64] == other[64])
    firsts = [p[0] for p in by_tenant.values()]
    assert all(common(a, b) < 64 for i, a in enumerate(firsts) for b in firsts[i + 1:])
    counts = np.bincount([r.tenant for r in reqs], minlength=5)
    assert counts[0] > counts[4]  # Zipf: the first tenant is the most popular


def test_long_prompt_mix_and_replay(builder, tmp_path):
    mix = long_prompt_mix_workload(builder, 400, "32", "1024", "64", long_fraction=0.1, seed=5)
    longs = [r for r in mix if r.prompt_tokens == 1024]
    assert 20 < len(longs) < 60 and all(r.max_tokens == 16 for r in longs)
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_tokens": 12, "output_tokens": 4, "offset_s": 0.5}\n'
                     '{"prompt": "hello world", "output_tokens": 2, "offset_s": 1.0}\n')
    reqs = replay_workload(builder, str(trace))
    hello = len(builder.tokenizer.encode("hello world", add_special_tokens=False).ids)
    assert [(r.prompt_tokens, r.max_tokens, r.offset_s) for r in reqs] == [(12, 4, 0.5), (hello, 2, 1.0)]
    trace.write_text('{"output_tokens": 4}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        replay_workload(builder, str(trace))


def _run(stub, n=4, **kw):
    reqs = random_workload(PromptBuilder(), n, "8", kw.pop("output_len", "5"), seed=0)
    return run_benchmark(reqs, RunSettings(base_url=stub.base_url if stub else kw.pop("base_url"), **kw),
                         progress=False)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_run_against_scripted_server(endpoint):
    with OpenAIStub(ttft_s=0.2, itl_s=0.05) as stub:
        m = _run(stub, n=4, concurrency=4, endpoint=endpoint, slo={"ttft": 1000.0})
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (4, 0, 20)
    assert m["output_tokens_counted_by"] == "usage" and m["model_id"] == "stub-model"
    assert (m["max_concurrency"], m["num_prompts"]) == (4, 4)
    # Scripted 200 ms to the first token and 50 ms between tokens; loopback and scheduling add a
    # little, or a lot on a loaded 2-core machine: the upper bounds only catch nonsense.
    assert 195 <= m["median_ttft_ms"] <= 2000
    assert 45 <= m["median_itl_ms"] <= 1000 and 45 <= m["mean_tpot_ms"] <= 1000
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])
    sent = stub.requests[0]
    assert sent["stream"] and sent["stream_options"] == {"include_usage": True} and sent["max_tokens"] == 5
    assert ("messages" in sent) == (endpoint == "chat")
    json.dumps(m)  # the result is plain JSON


@pytest.mark.parametrize("mode, kind", [("http_500", "http_500"), ("malformed_sse", "malformed_sse"),
                                        ("midstream_error", "server_error_midstream"),
                                        ("not_openai", "invalid_response"), ("reset", "connection_reset"),
                                        ("no_done", "truncated_stream")])
def test_server_faults_are_counted_and_the_run_finishes(mode, kind):
    with OpenAIStub(ttft_s=0.01, itl_s=0.01, mode=mode) as stub:
        m = _run(stub, n=3, rate=50.0)
    assert m["completed"] == 0 and m["errors"] == {kind: 3}
    assert kind in m["error_examples"]


def test_the_client_keeps_its_heap_out_of_full_collections_for_the_run_only():
    with OpenAIStub(ttft_s=0.01, itl_s=0.005) as stub:
        assert _run(stub, n=3, concurrency=1)["completed"] == 3
    assert len(stub.frozen_objects) == 3 and min(stub.frozen_objects) > 10_000
    assert gc.get_freeze_count() == 0


def test_connections_are_kept_alive_across_requests_and_error_responses():
    with OpenAIStub(ttft_s=0.01, itl_s=0.005) as stub:
        m = _run(stub, n=5, concurrency=1)
        assert m["completed"] == 5 and len(set(stub.client_ports)) == 1
    with OpenAIStub(ttft_s=0.01, itl_s=0.005, mode="http_500") as stub:
        m = _run(stub, n=3, concurrency=1)
        assert m["errors"] == {"http_500": 3} and "boom" in m["error_examples"]["http_500"]
        assert len(set(stub.client_ports)) == 1  # a complete error response leaves the connection usable


def test_a_request_past_its_timeout_is_reported_and_the_run_goes_on():
    with OpenAIStub(ttft_s=1.0, itl_s=0.01) as stub:
        m = _run(stub, n=2, concurrency=2, timeout_s=0.3)
    assert m["errors"] == {"timeout": 2} and m["completed"] == 0


def _read_stream(chunks: list[bytes], path: str = "/v1/completions", gap_s: float = 0.05):
    """`send_request`'s record of a response whose body arrives as `chunks`, one HTTP chunk each."""
    async def main():
        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for c in chunks:
                writer.write(b"%x\r\n%s\r\n" % (len(c), c))
                await writer.drain()
                await asyncio.sleep(gap_s)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        connections = Connections()
        payload = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
        rec = await send_request(connections, f"http://127.0.0.1:{port}{path}", payload, 1, 10)
        connections.close()
        server.close()
        return rec

    return asyncio.run(main())


def test_sse_lines_split_across_reads_are_parsed_and_stamped_when_complete():
    """The protocol's parser against a body whose lines arrive in pieces."""
    rec = _read_stream([b'data: {"choices": [{"index": 0, "te', b'xt": " a"}]}\n\n',
                        b'data: {"choices": [{"index": 0, "text": " b"}]}\n',
                        b'\ndata: {"choices": [], "usage": {"completion_tokens": 2}}\n\ndata: [DO', b'NE]\n\n'])
    assert rec.error is None and rec.output_tokens == 2 and rec.output_tokens_source == "usage"
    assert len(rec.chunk_times_s) == 2 and rec.chunk_times_s[1] - rec.chunk_times_s[0] >= 0.04


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_token_without_text_is_timed_as_it_arrives(path):
    """A chunk with no text (a special token, text held back) is a token's arrival, as vLLM's bench
    counts it; the chat stream's opening role chunk is not."""
    if path == "/v1/completions":
        def chunk(text):
            return b'data: {"choices": [{"index": 0, "text": %s}]}\n\n' % json.dumps(text).encode()
        opening = []
    else:
        def chunk(text):
            return b'data: {"choices": [{"index": 0, "delta": {"content": %s}}]}\n\n' % json.dumps(text).encode()
        opening = [b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n']
    rec = _read_stream(opening + [chunk("a"), chunk(""), chunk("b"), b"data: [DONE]\n\n"], path)
    assert rec.error is None and rec.output_tokens == 3 and rec.output_tokens_source == "chunks"
    gaps = [b - a for a, b in zip(rec.chunk_times_s, rec.chunk_times_s[1:])]
    assert len(gaps) == 2 and min(gaps) >= 0.04  # each token timed on its own, none merged into the next gap


def test_unreachable_server_is_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nothing listens there
    m = _run(None, n=2, base_url=f"http://127.0.0.1:{port}", rate=100.0, model="m")
    assert m["errors"] == {"connection_error": 2}


def test_duration_stops_a_fixed_concurrency_run():
    with OpenAIStub(ttft_s=0.05, itl_s=0.05) as stub:
        m = _run(stub, n=50, concurrency=1, duration_s=0.6, output_len="4")
    # Each request takes ~0.2 s at concurrency 1: a handful fit in 0.6 s, not 50.
    assert 1 <= m["completed"] <= 6 and m["failed"] == 0
