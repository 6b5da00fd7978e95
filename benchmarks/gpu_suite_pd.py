"""gpu_suite.py's P/D section: a prefill engine and a decode engine in two processes on one device,
each prompt's KV pulled from the one to the other as a disaggregated deployment pulls it, without
Ray Serve (the GPU image has no Ray).

The prefill process (`_prefill_process`) runs an `LLMEngine` on prefill-only requests and the KV
exporters over its cache: a `TCPExporter` (`transfer.backend: tcp`, the default) and, when UCX
starts there, a `UCXExporter`; this process runs the decode `LLMEngine`, on the same weights (the
same random_weights.json), and an importer of each. The prefill process prefills the prompts and
leases their blocks; for each prompt the decode engine reserves blocks (`add_prefilled_request`)
and pulls into them by each path, each pull timed and its bytes checked against the exporter's
(SHA-256 of the blocks on both sides):
- torch.multiprocessing's CUDA IPC (a baseline outside pdserve): the prefill process gathers the
  blocks into one buffer and shares it (an IPC handle on a GPU, shared memory on a CPU); this
  process copies it into its blocks;
- UCX's messages (CUDA transports on a GPU, TCP on a CPU), when a UCX check in a process of its
  own passed and ucxx starts: the handle is sent without the cache's region, so the blocks travel
  as messages. The decode engine's pool is fresh, so each prompt's blocks are one run and UCX
  receives in place; at the end one prompt is pulled again into every other block of the pool,
  through the importer's staging buffer;
- the tcp backend's socket, the handle without the cache's region (on a GPU through host memory:
  what a decode replica on another host, or with `transfer.shared_memory: false`, pulls by);
- pdserve's local read, as a decode replica on the prefill replica's GPU (or host) pulls: the
  importer maps the exporter's cache (CUDA IPC; shared memory on a CPU) and copies the blocks
  with one kernel, the READ and its answer over UCX; then with the tcp backend (the default,
  last: the decode runs on its bytes), which checks the lease on the exporter's lease board in
  shared memory instead and sends only the ack.
A path that fails is recorded (and shown as a failed row) and the others go on. The decode engine
then decodes the prompts together (each prompt's blocks checked again before and after: nothing
else writes them). Two references follow, in the same engine: the prompts prefilled there and
decoded on the same schedule (same KV bytes and batches: the tokens must be the same), and
colocated with continuous batching (other batches: other roundings). Where tokens differ, the
report keeps both runs' top logprobs at the first difference (a near tie, or other inputs?).

In: the engines' EngineConfig fields, the prompts, the output length. Out: figures and rows on
the suite's report (pull bytes/s against the copy bandwidth, checksums, token agreement).
"""

from __future__ import annotations

import hashlib
import os
import queue
import statistics
import subprocess
import sys
import time
import traceback

import torch

PULL_TIMEOUT_S = 60.0
START_TIMEOUT_S = 300.0  # the prefill process imports torch, builds its engine (CUDA graphs too), prefills

# UCX started and one tensor sent over it on the engines' device, in a process of its own: a UCX
# that cannot start on this machine, or crashes starting, then costs the UCX figures only.
_UCX_CHECK = """
import asyncio, os, sys, torch
from pdserve.kvtransfer.ucx_backend import _buffer, ucx_loop  # what the transfers send and receive
device = sys.argv[1]
src = torch.arange(1 << 20, device=device).to(torch.bfloat16)  # the device's context before UCX's
dst = torch.zeros_like(src)
import ucxx

async def main():
    received = asyncio.Event()

    async def handler(ep):
        await ep.recv(_buffer(dst))
        received.set()
        await ep.close()

    listener = ucxx.create_listener(handler, port=0)
    ep = await ucxx.create_endpoint("127.0.0.1", listener.port)
    await ep.send(_buffer(src))
    await asyncio.wait_for(received.wait(), 20)
    listener.close()

ucx_loop().run(main(), 60)
assert torch.equal(src, dst), "UCX delivered other bytes"
print("ucx", ucxx.get_ucx_version(), "ok on", device, flush=True)
os._exit(0)  # not waiting on UCX's threads to end
"""


def _digest(kv: torch.Tensor, block_ids: list[int]) -> str:
    """SHA-256 of the blocks' bytes, in the transfer layout `[layers, 2, n, block_size, heads, head_dim]`."""
    from pdserve.kvtransfer.blocks import gather_blocks

    blocks = gather_blocks(kv, block_ids).cpu().contiguous()
    return hashlib.sha256(blocks.view(-1).view(torch.uint8).numpy()).hexdigest()


def _sync(kv: torch.Tensor) -> None:
    if kv.is_cuda:
        torch.cuda.synchronize(kv.device)


def ucx_check(device: str) -> str | None:
    """None when UCX moves a tensor on `device`, else what went wrong."""
    try:
        done = subprocess.run([sys.executable, "-c", _UCX_CHECK, device], check=False, capture_output=True,
                              text=True, timeout=120, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return "the UCX check did not finish in 120 s"
    if done.returncode != 0:
        return f"the UCX check exited with {done.returncode}: {(done.stderr or done.stdout)[-1500:]}"
    return None


def _prefill_only(engine, ids: list[str], prompts: list[list[int]], params) -> dict:
    """The prompts prefilled together (prefill-only, as a prefill replica runs them): id -> first output."""
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params, prefill_only=True)
    firsts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            firsts[out.request_id] = out
    return firsts


def _prefill_process(options: dict, use_ucx: bool, commands, replies) -> None:
    """The prefill side: ("prefill", prompts, max_tokens) -> [(request id, first output, {backend:
    handle}, digest)]; ("gather", request id) -> its blocks in one shared buffer (or what failed),
    kept until ("release", request id), which also ends its leases; ("stop",) ends the process."""
    try:
        from pdserve.config import EngineConfig
        from pdserve.engine.engine import LLMEngine
        from pdserve.engine.sampling_params import SamplingParams
        from pdserve.kvtransfer.backends import BACKENDS, layout_of
        from pdserve.kvtransfer.blocks import gather_blocks

        engine = LLMEngine(EngineConfig(**options))
        kv, pool = engine.kv_cache.kv, engine.block_pool
        # shared_memory on, as deployed: handles name the cache (CUDA IPC on a GPU, shared memory
        # on a CPU) for the local read; the pulls over the wire drop that from the handle.
        exporters, errors = {}, {}
        for backend in ("tcp", "ucx") if use_ucx else ("tcp",):
            try:
                exporter_class, _ = BACKENDS[backend]()
                exporters[backend] = exporter_class(f"prefill-0-{backend}", kv, layout_of(kv, "gpu-suite"),
                                                    pool.incref, pool.free, lease_s=600.0, host="127.0.0.1",
                                                    shared_memory=True)
            except Exception as e:  # noqa: BLE001 - the other paths still run; the report names this one
                errors[backend] = repr(e)
        replies.put(("ready", {name: e.address for name, e in exporters.items()}, errors))
        held: dict[str, list[int]] = {}
        shared: dict[str, torch.Tensor] = {}  # buffers the decode process maps, alive until released
        tokens: dict[str, dict[str, str]] = {}  # each lease's token by backend, for its release
        while True:
            cmd = commands.get()
            if cmd[0] == "prefill":
                _, prompts, max_tokens = cmd
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                ids = [f"pd-{i}" for i in range(len(prompts))]
                firsts = _prefill_only(engine, ids, prompts, params)
                results = []
                for rid in ids:
                    first = firsts[rid]
                    held[rid] = first.kv_block_ids
                    handles = {name: e.export(rid, first.kv_block_ids, first.num_prompt_tokens).to_dict()
                               for name, e in exporters.items()}
                    tokens[rid] = {name: h["lease_token"] for name, h in handles.items()}
                    if handles:
                        engine.release_kv(rid)  # the leases hold the blocks now
                    results.append((rid, first, handles, _digest(kv, first.kv_block_ids)))
                replies.put(("prefilled", results))
            elif cmd[0] == "gather":
                rid = cmd[1]
                try:
                    shared[rid] = gather_blocks(kv, held[rid])
                    _sync(kv)
                    replies.put(("blocks", shared[rid]))
                except Exception as e:  # noqa: BLE001 - this path fails alone; the others may still run
                    replies.put(("blocks", repr(e)))
            elif cmd[0] == "release":
                rid = cmd[1]
                shared.pop(rid, None)
                held.pop(rid)
                leases = tokens.pop(rid)
                for name, token in leases.items():
                    exporters[name].ack(rid, token)
                if not leases:
                    engine.release_kv(rid)
                replies.put(("released", rid))
            else:
                for exporter in exporters.values():
                    exporter.close()
                os._exit(0)  # not waiting on UCX's threads, which can keep an interpreter from ending
    except BaseException:  # the decode side reports it
        replies.put(("error", traceback.format_exc()))
        raise


def _reply(replies, child, kind: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            msg = replies.get(timeout=1.0)
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the prefill process exited ({child.exitcode}) before answering {kind!r}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind!r} from the prefill process within {timeout_s:.0f} s") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"the prefill process failed:\n{msg[1]}")
        if msg[0] != kind:
            raise RuntimeError(f"expected {kind!r} from the prefill process, got {msg[0]!r}")
        return msg[1:]


def _decode_all(engine, tokens: dict[str, list[int]], logprobs: dict[str, list] | None = None) -> None:
    """Step until every request is done, appending each one's tokens (and their logprobs)."""
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)


def run(rep, options: dict, prompts: list[list[int]], output_tokens: int, log) -> None:
    import torch.multiprocessing as tmp

    from pdserve.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kvtransfer.backends import BACKENDS, layout_of

    ucx_error = ucx_check(options["device"])
    log(f"pd: UCX check: {ucx_error or 'ok'}")
    ctx = tmp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_prefill_process, args=(options, ucx_error is None, commands, replies),
                        name="gpu-suite-prefill", daemon=True)
    child.start()
    importers = {}
    try:
        engine = LLMEngine(EngineConfig(**options))  # while the prefill process builds its own
        kv = engine.kv_cache.kv
        addresses, errors = _reply(replies, child, "ready", START_TIMEOUT_S)
        if ucx_error:
            errors["ucx"] = f"the UCX check failed: {ucx_error}"
        for backend in addresses:
            try:
                importers[backend] = BACKENDS[backend]()[1](kv, layout_of(kv, "gpu-suite"))
            except Exception as e:  # noqa: BLE001 - as in the prefill process
                errors[backend] = repr(e)
        rep.figures("pd", model_layers=kv.shape[0], prompts=len(prompts), prompt_tokens=len(prompts[0]),
                    output_tokens=output_tokens, ucx="ucx" in importers, ucx_error=errors.get("ucx"),
                    tcp_error=errors.get("tcp"))
        log(f"pd: engines ready; importers {sorted(importers)}" + (f"; unavailable: {errors}" if errors else ""))
        pulls = _Pulls(kv, commands, replies, child, importers, errors, log)

        # logprobs: where the tokens differ, the report shows both runs' top logprobs there.
        params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
        commands.put(("prefill", prompts, output_tokens))
        (results,) = _reply(replies, child, "prefilled", START_TIMEOUT_S)
        # Disaggregated first, while the decode engine's pool is fresh: each prompt's blocks are
        # one run there, as on the prefill side, so UCX receives in place (the common case); the
        # scattered case (staging) follows at the end. Each prompt is pulled by every path; the
        # default's local read then pulls them all in a phase of its own (no other backend's pull
        # just before, as where only the default runs), and the decode runs on its bytes.
        disaggregated, decoded_from, placed = {}, set(), []
        for (rid, first, handles, digest), prompt in zip(results, prompts):
            num_local, dst = engine.add_prefilled_request(rid, prompt, params, first)
            if not dst:
                raise RuntimeError(f"the decode engine has no free blocks for {rid}")
            good = [path for path in _Pulls.ORDER[:-1] if path != "ucx_scattered"
                    and pulls.pull(path, rid, handles, dst, num_local, digest)]  # the paths that succeeded
            placed.append((rid, first, handles, digest, num_local, dst, good))
        for rid, first, handles, digest, num_local, dst, good in placed:
            holder = "local" if pulls.pull("local", rid, handles, dst, num_local, digest) else None
            if holder is None and good:  # it failed after zeroing `dst`: the last good path again
                holder = good[-1] if pulls.pull(good[-1], rid, handles, dst, num_local, digest) else None
            if holder is None:
                raise RuntimeError(f"no pull of {rid} succeeded: {pulls.errors}")
            decoded_from.add(holder)
            if rid != results[-1][0]:  # the last leases stay, for the scattered pull and the timings
                pulls.release(rid)
            engine.start_prefilled_request(rid)
            disaggregated[rid] = list(first.new_token_ids)
        # Each prompt's blocks hold the exporter's bytes before the decode (no later pull wrote
        # them), and the blocks the prompt fills hold the same after it (the decode writes past them).
        intact_before = [_digest(kv, dst) == digest for _, _, _, digest, _, dst, _ in placed]
        filled = [dst[:len(prompt) // kv.shape[3]] for (*_, dst, _), prompt in zip(placed, prompts)]
        before = [_digest(kv, blocks) for blocks in filled]
        dis_logprobs: dict[str, list] = {}
        _decode_all(engine, disaggregated, dis_logprobs)
        intact_after = [_digest(kv, blocks) == d for blocks, d in zip(filled, before)]
        rep.figures("pd", kv_intact_before_decode=intact_before, kv_intact_after_decode=intact_after)

        # The reference on the same schedule: this engine prefills the prompts itself, as the
        # prefill process did (same batch, salted so that nothing comes from the blocks pulled
        # above), then takes them over from its own blocks and decodes them together as it did
        # the pulled ones. Same KV bytes and same batches give the same tokens, bit for bit.
        reference, ref_logprobs, same_kv = _reference_on_same_schedule(engine, prompts, output_tokens, results)
        # Colocated with continuous batching (decodes start while other prompts still prefill):
        # other batch compositions, so other roundings; with random weights, near-tied logits.
        colocated = {f"co-{i}": [] for i in range(len(prompts))}
        salted = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True, cache_salt="colocated")
        for rid, prompt in zip(colocated, prompts):
            engine.add_request(rid, prompt, salted)
        _decode_all(engine, colocated)

        rid, first, handles, digest = results[-1]
        _time_local_parts(rep, engine, pulls, handles.get("tcp"), len(first.kv_block_ids), log)
        if kv.is_cuda:
            try:
                _time_run_copies(rep, kv, len(first.kv_block_ids), pulls.block_bytes, log)
            except Exception as e:  # noqa: BLE001 - candidates, not figures the others need
                log(f"pd: timing the copy candidates failed: {e!r}")
        if "ucx_scattered" not in pulls.errors:
            # Every other block of the (now idle) pool: blocks that are no run, received through a
            # staging buffer and scattered, as a decode replica's blocks are once it has run a while.
            pool = engine.block_pool
            taken = pool.allocate(2 * len(first.kv_block_ids))
            try:
                pulls.pull("ucx_scattered", rid, handles, sorted(taken)[::2], 0, digest)
            finally:
                pool.free(taken)
        pulls.release(rid)
        pulls.report(rep, disaggregated, reference, same_kv, colocated, output_tokens, decoded_from)
        _report_first_differences(rep, log, disaggregated, dis_logprobs, reference, ref_logprobs)
    finally:
        for importer in importers.values():
            importer.close()
        if child.is_alive():
            commands.put(("stop",))
            child.join(30)
        if child.is_alive():
            child.kill()


def _report_first_differences(rep, log, disaggregated: dict, dis_logprobs: dict, reference: dict,
                              ref_logprobs: dict) -> None:
    """Where a prompt's tokens first differ from the same-schedule reference's, both runs' top
    logprobs there: equal logprobs up to a near tie say rounding, distant ones other inputs."""
    found = []
    for (rid, dis), (ref_id, ref) in zip(disaggregated.items(), reference.items()):
        k = next((i for i, (a, b) in enumerate(zip(dis, ref)) if a != b), None)
        if k is None or k == 0:  # equal, or the prefill's own token (no logprobs here)
            continue
        # The decode steps' logprobs end with the last token's (the prefill's token may lack one).
        pair = [lps[len(lps) - (len(dis) - k)] if len(lps) >= len(dis) - k else None
                for lps in (dis_logprobs.get(rid, []), ref_logprobs.get(ref_id, []))]
        found.append({"prompt": rid, "position": k, **{
            name: None if lp is None else [[t, round(v, 5)] for t, v in lp.top]
            for name, lp in zip(("disaggregated_top", "reference_top"), pair)}})
    rep.figures("pd", first_differences=found)
    for d in found:
        log(f"pd: {d['prompt']} first differs at position {d['position']}: disaggregated top "
            f"{d['disaggregated_top']}, reference top {d['reference_top']}")


def _two_runs(free: list[int], n: int) -> tuple[list[int], list[int]]:
    """Two disjoint runs of `n` consecutive block ids out of `free` (sorted), as a fresh pool gives
    a prompt; the first 2n ids where there are no such runs."""
    runs, i = [], 0
    while i + n <= len(free) and len(runs) < 2:
        if free[i + n - 1] - free[i] == n - 1:
            runs.append(free[i:i + n])
            i += n
        else:
            i += 1
    return (runs[0], runs[1]) if len(runs) == 2 else (free[:n], free[n:2 * n])


def _time_local_parts(rep, engine, pulls, handle: dict | None, num_blocks: int, log) -> None:
    """The default's local read taken apart, on the host's clock (a pull waits for all of it):
    `copy_blocks` alone (this cache's blocks into its other blocks, as many as a prompt has; both
    sides one run, a strided copy, and the same blocks in another order, the kernel over ids); the
    block ids' upload, by `torch.as_tensor` of the list and through numpy; a local read's steps one
    by one (the handle parsed, the exporter's cache and board looked up, the board's checks, the
    ids checked, the views made, the copy enqueued, its wait); and the same prompt read again and
    again with nothing, a zeroing, an idle device (20 ms) or a digest of its blocks between the
    reads (a phase read has the last two)."""
    from pdserve.engine.host_tensors import long_tensor
    from pdserve.kvtransfer.blocks import _check_ids, _wide, block_run, copy_blocks
    from pdserve.kvtransfer.lease_board import token_digest
    from pdserve.kvtransfer.protocol import KVHandle, head_slice

    kv, pool = engine.kv_cache.kv, engine.block_pool
    taken = pool.allocate(pool.num_free_blocks)  # all: two runs of a prompt's length are picked from them
    copy_bw = rep.limits.get("copy_bytes_per_s", 0) / 1e9

    def clocked(step, before=None, n: int = 8) -> list[float]:
        times = []
        for _ in range(n):
            if before is not None:
                before()
            _sync(kv)
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return times

    def ms(times: list[float]) -> str:
        return f"{statistics.median(times) * 1e3:.3f} ms"

    try:
        src, dst = _two_runs(sorted(taken), num_blocks)
        heads = (0, kv.shape[4])
        shuffled = [dst[1], dst[0], *dst[2:]]  # the same blocks, no run: the kernel over ids
        is_runs = block_run(src) is not None and block_run(dst) is not None
        for label, key, into in (("one run each side (one strided copy)" if is_runs else
                                  "ids not one run, the pool had no two free runs (the kernel over ids)", "run", dst),
                                 ("ids not one run (the kernel over ids)", "ids", shuffled)):
            copy_blocks(kv, src, heads, kv, into)  # compiled before it is timed
            _sync(kv)
            times = clocked(lambda into=into: (copy_blocks(kv, src, heads, kv, into), _sync(kv)))
            nbytes = 2 * num_blocks * pulls.block_bytes  # read + written
            seconds = statistics.median(times)
            rep.figures("pd", **{f"copy_blocks_{key}_s": times, "copy_blocks_bytes": nbytes})
            rep.row("pd", f"copy_blocks alone, {num_blocks} blocks cache to cache in one process, {label}, bytes "
                    "read + written", nbytes / seconds / 1e9, "GB/s", copy_bw, "copy bandwidth", None,
                    note=f"median {seconds * 1e6:.0f} us of 8, launch and sync included")
        # The ids a copy over ids uploads: by torch.tensor from the list (before) and through numpy
        # (long_tensor, now), each with its wait. (From pinned memory: no faster, 53rd session.)
        ids = [*src, *dst]
        by_list = clocked(lambda: (torch.as_tensor(ids, dtype=torch.long, device=kv.device), _sync(kv)), n=20)
        by_numpy = clocked(lambda: (long_tensor(ids, kv.device), _sync(kv)), n=20)
        rep.figures("pd", ids_upload_by_list_s=by_list, ids_upload_by_numpy_s=by_numpy)
        log(f"pd: {len(ids)} block ids uploaded and waited for: by torch.as_tensor of the list {ms(by_list)}, "
            f"through numpy {ms(by_numpy)}")
        if "local" in pulls.errors or handle is None or handle.get("cache_region") is None:
            return
        one, importer = KVHandle.from_dict(handle), pulls.importers["tcp"]
        ids = list(one.block_ids)
        runs = ["one run" if block_run(b) is not None else "not one run" for b in (ids, dst)]
        log(f"pd: the exporter's blocks of this prompt are {runs[0]}; the reads below go into {runs[1]}")
        one_block = clocked(lambda: (importer.pull(one, dst[:1], PULL_TIMEOUT_S, None, num_blocks - 1, ack=False),
                                     _sync(kv)))
        # A local read's steps, as `_fetch` and `read_on_board` take them, and copy_blocks' own.
        source, board = importer.mapped_cache(one), importer.mapped_board(one)

        def views(source):
            wide_kv, wide_source = _wide(kv, source) if kv.is_cuda else (kv, torch.from_numpy(source))
            d, s = dst[0], ids[0]
            return (wide_kv.narrow(2, d, len(dst)),
                    wide_source.narrow(2, s, len(ids)).narrow(4, heads[0], heads[1] - heads[0]))
        into, out_of = views(source)

        def ends(blocks: list[int]) -> tuple[int, int] | None:  # as copy_blocks finds them
            first = block_run(blocks)
            return None if first is None else (first, first + len(blocks) - 1)
        lease = (one.lease_slot, one.lease_generation, token_digest(one.lease_token or ""))
        steps = {
            "the handle parsed": clocked(lambda: KVHandle.from_dict(handle)),
            "the head slice and the ids listed": clocked(lambda: (head_slice(one.layout, importer.layout),
                                                                  list(dst), list(one.block_ids))),
            "the exporter's cache and board looked up": clocked(lambda: (importer.mapped_cache(one),
                                                                         importer.mapped_board(one))),
            "the board's checks (lease live, exporter alive)": clocked(lambda: (board.is_live(*lease),
                                                                                board.exporter_alive())),
            "the ids checked (runs, in range)": clocked(lambda: (_check_ids(ids, source.shape[2], ends(ids)),
                                                                _check_ids(dst, kv.shape[2], ends(dst)))),
            "the strided views made": clocked(lambda: views(source)),
            "an idle stream synchronized": clocked(importer.finish_copy if kv.is_cuda else lambda: None),
            "torch's copy_ enqueued, on views made before": clocked(lambda: into.copy_(out_of)),
            "the copy enqueued (copy_blocks' host part)": clocked(lambda: copy_blocks(source, ids, heads, kv, dst)),
            "the copy enqueued and waited for": clocked(lambda: (copy_blocks(source, ids, heads, kv, dst),
                                                                 importer.finish_copy() if kv.is_cuda else None)),
        }
        if board is None:  # no board mapped here: the READ decides (its round trip is in the one-block read)
            del steps["the board's checks (lease live, exporter alive)"]

        def read():
            importer.pull(KVHandle.from_dict(handle), dst, PULL_TIMEOUT_S, None, 0, ack=False)
            _sync(kv)
        whole = {}  # the same prompt's blocks read again and again, with what a phase has between reads
        dst_ids = torch.tensor(dst, device=kv.device)
        for label, before in (("nothing", None),
                              ("the blocks zeroed", lambda: kv.index_fill_(2, dst_ids, 0)),
                              ("the device idle 20 ms", lambda: time.sleep(0.02)),
                              ("a digest of the blocks (copied to the host)", lambda: _digest(kv, dst))):
            whole[label] = clocked(read, before)
        rep.figures("pd", local_one_block_pull_s=one_block, local_read_steps_s=steps, local_reads_after_s=whole)
        log("pd: a local read's steps (medians of 8): " + "; ".join(f"{k} {ms(v)}" for k, v in steps.items()))
        pulls.notes["local"] = (f"a one-block local read (the round trip) {ms(one_block)}; this prompt read 8 times "
                                f"with, between reads, " + ", ".join(f"{k}: {ms(v)}" for k, v in whole.items()))
    except Exception as e:  # noqa: BLE001 - a diagnosis, not a figure the others need
        log(f"pd: timing the local read's parts failed: {e!r}")
    finally:
        pool.free(taken)


def _cudart():
    """The CUDA runtime library torch loaded (its cudaMemcpy2DAsync is not in torch's API)."""
    import ctypes
    import glob

    for path in ["libcudart.so"] + sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia",
                                                                 "*", "lib", "libcudart.so*"))):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise OSError("no libcudart found")


def _time_run_copies(rep, kv: torch.Tensor, n: int, block_bytes: int, log) -> None:
    """Candidates for the copy when the source and destination blocks are each one run (a fresh
    pool's common case), against the kernel above, on the device's clock: every slab's run as one
    2D copy (`cudaMemcpy2DAsync`: rows = slabs, a row = the run's bytes), torch's copy of the two
    strided views (as int64, for wide loads), the same per run when the blocks are 8 or 64 runs,
    and the kernel at other chunk sizes and warp counts. Blocks 0..n-1 into blocks from n on of
    this idle engine (its pool is larger than 3n blocks)."""
    import ctypes

    def timed(copy) -> tuple[float, float]:
        """Median seconds on the device's clock, and on the host's (the launch, then the wait)."""
        copy()
        _sync(kv)
        times, host = [], []
        for _ in range(8):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            _sync(kv)
            times.append(start.elapsed_time(end) / 1e3)
            t = time.perf_counter()
            copy()
            _sync(kv)
            host.append(time.perf_counter() - t)
        return statistics.median(times), statistics.median(host)

    es, slabs = kv.element_size(), kv.shape[0] * kv.shape[1]
    assert kv.is_contiguous()
    nbytes, copy_bw = 2 * n * block_bytes, rep.limits.get("copy_bytes_per_s", 0) / 1e9  # read + written
    row_bytes, pitch = kv.stride(2) * es, kv.stride(1) * es  # a block's bytes in one slab; a slab's
    try:
        cudart = _cudart()
        cudart.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                             ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

        def memcpy2d():
            err = cudart.cudaMemcpy2DAsync(kv.data_ptr() + n * row_bytes, pitch, kv.data_ptr(), pitch,
                                           n * row_bytes, slabs, 3, torch.cuda.current_stream().cuda_stream)
            if err:
                raise RuntimeError(f"cudaMemcpy2DAsync: error {err}")

        candidates = {"cudaMemcpy2DAsync, a row per slab": memcpy2d}
    except OSError as e:
        log(f"pd: no cudaMemcpy2DAsync ({e!r})")
        candidates = {}
    wide = kv.view(torch.int64)  # head_dim * 2 bytes a row: whole int64s
    candidates["torch copy_ of the strided views (int64)"] = lambda: wide[:, :, n:2 * n].copy_(wide[:, :, :n])
    # The blocks in r runs with gaps between them on the destination, a torch copy per run (launches
    # against bandwidth: where would a per-run copy lose to the one-launch kernel?).
    for runs in (8, 64):
        size = n // runs

        def per_run(size=size, runs=runs):
            for k in range(runs):
                d = n + 2 * k * size
                wide[:, :, d:d + size].copy_(wide[:, :, k * size:(k + 1) * size])
        candidates[f"torch copy_ per run, {runs} runs of {size} blocks"] = per_run
    # The kernel itself at other chunk sizes and warp counts (one run: the same bytes as above).
    from pdserve.engine.kernels import triton_paged as tp

    ids = torch.arange(2 * n, device=kv.device)
    for chunk, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (16384, 16)):
        def kernel(chunk=chunk, warps=warps):
            tp._kernels().copy_blocks[(slabs, n)](
                kv, kv, ids[:n], ids[n:], 0, 0, *kv.stride()[1:5], *kv.stride()[1:5], HEADS=kv.shape[4],
                BLOCK_SIZE=kv.shape[3], HEAD_DIM=kv.shape[5], CHUNK=chunk, DENSE=True, num_warps=warps)
        candidates[f"pdserve's kernel, CHUNK {chunk}, {warps} warps"] = kernel
    for name, copy in candidates.items():
        try:
            seconds, host_seconds = timed(copy)
        except Exception as e:  # noqa: BLE001 - a candidate, not a figure the others need
            log(f"pd: {name} failed: {e!r}")
            continue
        if "per run" not in name and not torch.equal(kv[:, :, n:2 * n], kv[:, :, :n]):
            log(f"pd: {name} copied other bytes")
            continue
        rep.figures("pd", **{f"copy_candidate_s[{name}]": seconds, f"copy_candidate_host_s[{name}]": host_seconds})
        rep.row("pd", f"KV copy of {n} blocks: {name} (CUDA events), bytes read + written",
                nbytes / seconds / 1e9, "GB/s", copy_bw, "copy bandwidth", None,
                note=f"median {seconds * 1e6:.0f} us of 8; launched and waited for by the host's clock "
                     f"{host_seconds * 1e6:.0f} us")


def _reference_on_same_schedule(engine, prompts: list[list[int]], output_tokens: int,
                                results: list) -> tuple[dict[str, list[int]], dict[str, list], list[bool]]:
    """Greedy tokens (and their logprobs) of `prompts` prefilled by `engine` itself (prefill-only,
    all at once, as the prefill process ran them), each then taken over from those blocks
    (`add_prefilled_request`, blocks copied within the cache) and all decoded together. Also
    records whether each prompt's KV here equals the exporter's (`results`' digests): the prefill
    is deterministic across processes."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kvtransfer.blocks import gather_blocks, scatter_blocks

    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True, cache_salt="reference",
                            logprobs=2)
    ids = [f"ref-prefill-{i}" for i in range(len(prompts))]
    firsts = _prefill_only(engine, ids, prompts, params)
    kv, tokens, same_kv = engine.kv_cache.kv, {}, []
    for i, (rid, prompt, result) in enumerate(zip(ids, prompts, results)):
        first = firsts[rid]
        same_kv.append(_digest(kv, first.kv_block_ids) == result[3])
        # Out of the cache before its blocks go back: the prefills hold nearly the whole pool.
        blocks = gather_blocks(kv, first.kv_block_ids)
        engine.release_kv(rid)
        num_local, dst = engine.add_prefilled_request(f"ref-{i}", prompt, params, first)
        if dst is None:
            raise RuntimeError(f"the decode engine has no free blocks for ref-{i}")
        if dst:
            scatter_blocks(kv, dst, blocks[:, :, num_local:])
        del blocks
        engine.start_prefilled_request(f"ref-{i}")
        tokens[f"ref-{i}"] = list(first.new_token_ids)
    logprobs: dict[str, list] = {}
    _decode_all(engine, tokens, logprobs)
    return tokens, logprobs, same_kv


class _Pulls:
    """The decode side's pulls, by path: each timed, its bytes checked against the exporter's. A
    path that fails once is recorded and not tried again."""

    NAMES = {"cuda_ipc": "torch.multiprocessing's CUDA IPC (gather, share, scatter; not pdserve's path)",
             "ucx": "UCX messages, blocks in one run (in place)",
             "ucx_scattered": "UCX messages, scattered blocks (staging buffer)",
             "local_ucx": "pdserve's local read, READ and its answer over UCX (the prefill's cache mapped over "
                          "CUDA IPC, one copy kernel)",
             "tcp": "the tcp backend's socket (the blocks through host memory)",
             "local": "pdserve's local read with the tcp backend (the default: the lease checked on the "
                      "exporter's board in shared memory, no message but the ack; the prefill's cache mapped "
                      "over CUDA IPC, one copy kernel)"}
    ORDER = tuple(NAMES)  # the order a prompt's pulls run in: the default's local read last
    # path -> (the importer's backend, whether the handle keeps the cache's region: a local read)
    ROUTES = {"ucx": ("ucx", False), "ucx_scattered": ("ucx", False), "local_ucx": ("ucx", True),
              "tcp": ("tcp", False), "local": ("tcp", True)}

    def __init__(self, kv: torch.Tensor, commands, replies, child, importers: dict, errors: dict, log):
        self.kv, self.commands, self.replies, self.child, self.importers, self.log = \
            kv, commands, replies, child, importers, log
        self.block_bytes = kv[:, :, 0].numel() * kv.element_size()
        self.timed: dict[str, list[tuple[float, int]]] = {p: [] for p in self.NAMES}  # [(seconds, bytes)]
        self.checks: dict[str, list[bool]] = {p: [] for p in self.NAMES}  # pulled bytes equal the exporter's
        # path -> why it is not tried (again): a backend that did not start fails its paths
        self.errors: dict[str, str] = {path: errors[backend] for path, (backend, _) in self.ROUTES.items()
                                       if backend in errors}
        self.notes: dict[str, str] = {}  # path -> more for its row
        if not kv.is_cuda:
            self.NAMES = {**self.NAMES, "cuda_ipc": "torch.multiprocessing shared memory (CPU stand-in for CUDA IPC)",
                          "local_ucx": "pdserve's local read, READ and its answer over UCX (the prefill's cache "
                                       "in shared memory)",
                          "tcp": "the tcp backend's socket",
                          "local": "pdserve's local read with the tcp backend (the default: the lease checked "
                                   "on the exporter's board, no message but the ack; the prefill's cache in shared "
                                   "memory)"}

    def pull(self, path: str, rid: str, handles: dict, dst: list[int], num_local: int, digest: str) -> bool:
        """One timed, checked pull into `dst`; False (and the path recorded as failed) on an error."""
        from pdserve.kvtransfer.blocks import scatter_blocks
        from pdserve.kvtransfer.protocol import KVHandle

        if path in self.errors:
            return False
        kv = self.kv
        kv.index_fill_(2, torch.tensor(dst, device=kv.device), 0)  # a pull that writes nothing fails its check
        _sync(kv)
        t = time.perf_counter()
        try:
            if path == "cuda_ipc":
                self.commands.put(("gather", rid))
                (buf,) = _reply(self.replies, self.child, "blocks", PULL_TIMEOUT_S)
                if isinstance(buf, str):
                    raise RuntimeError(f"the prefill process could not share the blocks: {buf}")
                scatter_blocks(kv, dst, buf)
                del buf
            else:
                backend, is_local = self.ROUTES[path]
                importer, handle = self.importers[backend], handles[backend]
                if is_local and handle.get("cache_region") is None:
                    raise RuntimeError("the exporter's handle names no cache to map")
                local_pulls = importer.num_shared_memory_pulls
                importer.pull(KVHandle.from_dict(handle if is_local else {**handle, "cache_region": None}), dst,
                              PULL_TIMEOUT_S, None, num_local, ack=False)
                if is_local and importer.num_shared_memory_pulls == local_pulls:
                    raise RuntimeError("the importer could not map the exporter's cache: the blocks came by wire")
            _sync(kv)
        except Exception as e:  # noqa: BLE001 - the other paths still run
            self.log(f"pd: {path} pull of {rid} failed: {e!r}")
            self.errors[path] = repr(e)[:1000]
            return False
        self.timed[path].append((time.perf_counter() - t, len(dst) * self.block_bytes))
        self.checks[path].append(_digest(kv, dst) == digest)
        return True

    def release(self, rid: str) -> None:
        """The prefill process drops the blocks' lease (or hold) and the buffer it shared."""
        self.commands.put(("release", rid))
        _reply(self.replies, self.child, "released", PULL_TIMEOUT_S)

    def report(self, rep, disaggregated: dict, reference: dict, same_kv: list[bool], colocated: dict,
               output_tokens: int, decoded_from: set[str | None]) -> None:
        copy_bw = rep.limits.get("copy_bytes_per_s", 0)
        for path, timed in self.timed.items():
            metric = f"KV pull over {self.NAMES[path]}, prefill process -> decode process, bytes read + written"
            # The target is the deployed path's: on one GPU (or host) pdserve reads locally.
            target = 0.5 if path == "local" else None
            if not timed:
                if self.errors.get(path):  # tried and failed: a row, so that the table shows it
                    rep.row("pd", metric, 0.0, "GB/s", copy_bw / 1e9, "copy bandwidth", target,
                            note=f"FAILED: {self.errors[path][:300]}")
                continue
            # The first pull opens the connection and maps the other process's memory: left out
            # of the rate when there are others.
            steady = timed[1:] or timed
            seconds, nbytes = sum(s for s, _ in steady), sum(b for _, b in steady)
            rep.figures("pd", **{f"{path}_pull_ms": [s * 1e3 for s, _ in timed], f"{path}_pull_bytes": timed[0][1],
                                 f"{path}_kv_bytes_per_s": nbytes / seconds})
            rep.row("pd", metric, 2 * nbytes / seconds / 1e9, "GB/s", copy_bw / 1e9, "copy bandwidth", target,
                    note=f"{nbytes / seconds / 1e9:.3g} GB/s of KV; {len(timed)} pulls of "
                         f"{timed[0][1] / 2**20:.3g} MiB, median {statistics.median(s for s, _ in timed) * 1e3:.2f} ms, "
                         f"first {timed[0][0] * 1e3:.2f} ms" + (f"; {self.notes[path]}" if path in self.notes else ""))
        checked = [c for cs in self.checks.values() for c in cs]
        if "tcp" in self.importers:  # the default's local reads the exporter's lease board vouched for
            rep.figures("pd", tcp_board_reads=self.importers["tcp"].num_board_reads)
        rep.figures("pd", checksums_equal={p: c for p, c in self.checks.items() if c}, pull_errors=self.errors,
                    decoded_from=sorted(str(p) for p in decoded_from), prefill_kv_equal_across_processes=same_kv)
        rep.row("pd", "pulled KV bytes equal the exporter's (SHA-256), all pulls", sum(checked) / len(checked),
                "of pulls", 1.0, "all", 1.0,
                note=", ".join(f"{self.NAMES[p]} {sum(c)}/{len(c)}" for p, c in self.checks.items() if c))
        lengths_ok = all(len(d) == output_tokens for d in disaggregated.values())
        pulled_from = " and ".join(self.NAMES.get(p, str(p)) for p in sorted(decoded_from, key=str))
        for name, other, target, note in (
                ("the same engine prefilling them itself on the same schedule", reference, 0.99,
                 f"the prompts' KV computed there equals the exporter's for {sum(same_kv)} of {len(same_kv)}; "
                 f"decoded on the {pulled_from} pull"),
                ("colocated with continuous batching (other batch compositions)", colocated, None,
                 "random bf16 weights: near-tied logits flip on rounding differences")):
            pairs = [(a, b) for dis, co in zip(disaggregated.values(), other.values()) for a, b in zip(dis, co)]
            agree = sum(a == b for a, b in pairs) / (len(other) * output_tokens) if lengths_ok else 0.0
            key = "tokens_agree_same_schedule" if other is reference else "tokens_agree_colocated"
            # Where each prompt's tokens first differ (-1: nowhere): one early flip, or many?
            firsts = [next((i for i, (a, b) in enumerate(zip(dis, co)) if a != b), -1)
                      for dis, co in zip(disaggregated.values(), other.values())]
            rep.figures("pd", **{key: agree, f"{key}_first_difference": firsts}, disaggregated_lengths_ok=lengths_ok)
            rep.row("pd", f"greedy tokens, disaggregated = {name} ({len(other)} x {output_tokens} positions)",
                    agree, "of positions", 1.0, "all", target, note=note)
