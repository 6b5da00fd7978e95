"""MLA's absorbed decode kernel (kernels/triton_mla.py) against the torch path, and DeepSeek-V3's
decode step on the Triton paths a CUDA graph captures: under the Triton interpreter on CPU (tiny
shapes), natively on a GPU when there is one."""

from __future__ import annotations

import os

import pytest
import torch

# Triton picks interpreter or compiled mode once per process: interpret on a machine without a
# GPU, compile for the GPU where there is one (then these run on cuda only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from pdserve.engine.attention import AttentionMetadata, PrefillChunkMeta, forward_context  # noqa: E402
from pdserve.engine.checkpoint import PRESETS, _config, make_checkpoint  # noqa: E402
from pdserve.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from pdserve.engine.kernels import ops  # noqa: E402
from pdserve.engine.kernels import paged_attention as ref  # noqa: E402
from pdserve.engine.kernels import triton_mla as tk  # noqa: E402
from pdserve.engine.kernels.paged_attention import GatherWorkspace  # noqa: E402
from pdserve.engine.kv_cache import KVCache  # noqa: E402
from pdserve.engine.latent_attention import LatentAttention  # noqa: E402
from pdserve.engine.llm import LLM  # noqa: E402
from pdserve.engine.models.arch import ModelArch  # noqa: E402
from pdserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE  # noqa: E402
from pdserve.engine.parallel import ParallelState  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK, NUM_BLOCKS = 16, 24
HEADS, RANK, ROPE = 4, 32, 8  # tiny-deepseek-v3's: kv_lora_rank 32, qk_rope_head_dim 8 (the tile pads it to 16)


def garbage_cache(dtype=torch.float32, rank=RANK, rope=ROPE, fill=None):
    """A latent cache whose every slot holds something: large values (or `fill`) where no sequence's
    tokens are, as blocks a finished request freed hold its latents."""
    cache = torch.randn(NUM_BLOCKS, BLOCK, rank + rope, device=DEVICE) * 50
    if fill is not None:
        cache.fill_(fill)
    return cache.to(dtype)


def tables_for(lens, stale=True):
    """Each sequence's blocks: distinct, shuffled physical ids; columns past them hold other
    sequences' (stale) block ids, as the static buffers' tables do, or block 0."""
    perm = torch.randperm(NUM_BLOCKS).tolist()
    need = [-(-n // BLOCK) for n in lens]
    width = max(need) + 1  # a column no sequence reaches
    rows, at = [], 0
    for k in need:
        rows.append(perm[at:at + k])
        at += k
    pad = [perm[-1 - i] for i in range(width)] if stale else [0] * width
    return torch.tensor([r + pad[:width - len(r)] for r in rows], dtype=torch.long, device=DEVICE)


def fill_sequences(cache, tables, lens, rank=RANK, rope=ROPE):
    """Ordinary values in the slots the sequences hold."""
    for row, n in zip(tables.tolist(), lens):
        for p in range(n):
            cache[row[p // BLOCK], p % BLOCK] = torch.randn(rank + rope, device=DEVICE).to(cache.dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_blocks", [None, 1, 2])  # one partition (the default here), or several
@pytest.mark.parametrize("lens", [[1], [17, 33, 48], [1, 15, 16, 31, 32, 64, 80]])  # batches of 1, 3, 7
def test_decode_matches_torch(kv_dtype, partition_blocks, lens):
    """Lengths of one token, ending inside, one before and exactly on a block's end; the cache's
    other slots (past each length in its last block, in the stale table columns, in freed blocks)
    hold large garbage that must not be read."""
    cache = garbage_cache(kv_dtype)
    tables = tables_for(lens)
    fill_sequences(cache, tables, lens)
    seq_lens = torch.tensor(lens, device=DEVICE)
    q = torch.randn(len(lens), HEADS, 24 + ROPE, device=DEVICE)  # a query projection: nope, then rope
    q_lat, q_rope = torch.randn(len(lens), HEADS, RANK, device=DEVICE), q[:, :, 24:]  # q_rope: heads at a stride
    expected = ref.latent_decode_attention(q_lat, q_rope, cache, tables, seq_lens, 0.3)
    got = tk.latent_decode_attention(q_lat, q_rope, cache, tables, seq_lens, 0.3, partition_blocks)
    assert got.shape == (len(lens), HEADS, RANK) and got.dtype == q_lat.dtype
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads, rank, rope", [(20, 24, 12), (1, 16, 16)])  # two head tiles, widths not powers of 2
def test_decode_masks_any_heads_and_widths(heads, rank, rope):
    lens = [5, 40]
    cache = garbage_cache(rank=rank, rope=rope)
    tables = tables_for(lens)
    fill_sequences(cache, tables, lens, rank, rope)
    seq_lens = torch.tensor(lens, device=DEVICE)
    q_lat, q_rope = torch.randn(2, heads, rank, device=DEVICE), torch.randn(2, heads, rope, device=DEVICE)
    expected = ref.latent_decode_attention(q_lat, q_rope, cache, tables, seq_lens, 0.2)
    got = tk.latent_decode_attention(q_lat, q_rope, cache, tables, seq_lens, 0.2, partition_blocks=1)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSeek-V3's own widths compiled for a GPU "
                    "(its registers and shared memory); the interpreter runs the same code at the widths above")
def test_decode_at_deepseek_v3_widths():
    """128 heads over a latent of 512 + 64, a bf16 cache, lengths across blocks and partitions."""
    heads, rank, rope, lens = 128, 512, 64, [1, 100, 300]
    cache = garbage_cache(torch.bfloat16, rank=rank, rope=rope)
    tables = tables_for(lens)
    fill_sequences(cache, tables, lens, rank, rope)
    seq_lens = torch.tensor(lens, device=DEVICE)
    q_lat, q_rope = torch.randn(3, heads, rank, device=DEVICE), torch.randn(3, heads, rope, device=DEVICE)
    expected = ref.latent_decode_attention(q_lat, q_rope, cache, tables, seq_lens, 0.05)
    for partition_blocks in (None, 2):
        got = tk.latent_decode_attention(q_lat, q_rope, cache, tables, seq_lens, 0.05, partition_blocks)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_slots_past_the_lengths_are_never_read():
    """NaN everywhere the sequences do not hold: the kernel's output is the one over zeros there
    (the torch path would give NaN: it multiplies, then masks)."""
    lens = [3, 17, 32]
    cache = garbage_cache(fill=float("nan"))
    tables = tables_for(lens)
    fill_sequences(cache, tables, lens)
    seq_lens = torch.tensor(lens, device=DEVICE)
    q_lat, q_rope = torch.randn(3, HEADS, RANK, device=DEVICE), torch.randn(3, HEADS, ROPE, device=DEVICE)
    got = tk.latent_decode_attention(q_lat, q_rope, cache, tables, seq_lens, 0.3, partition_blocks=1)
    expected = ref.latent_decode_attention(q_lat, q_rope, cache.nan_to_num(0.0), tables, seq_lens, 0.3)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_latent_attention_decodes_on_the_kernel_as_on_the_torch_path(monkeypatch):
    """`LatentAttention`'s decode (W_UK folded into q, W_UV after) through `ops` on the Triton kernel
    and on the torch path, and both against the prefill path's expanded attention, over the same
    cached latents of several sequences."""
    g = torch.Generator().manual_seed(0)
    nope, v, lens = 16, 16, [1, 16, 23]
    kv_b = torch.nn.Linear(RANK, HEADS * (nope + v), bias=False).to(DEVICE)
    kv_b.weight.data = (torch.randn(HEADS * (nope + v), RANK, generator=g) / RANK ** 0.5).to(DEVICE)
    attn = LatentAttention(0, HEADS, RANK, nope, ROPE, v, scale=0.3)
    attn.absorb(kv_b.weight.data)
    cache = KVCache(1, NUM_BLOCKS, BLOCK, 1, RANK + ROPE, device=DEVICE, is_latent=True)
    cache.layer(0).copy_(garbage_cache())
    tables = tables_for(lens)
    qs, latents, slots = [], [], []
    for row, n in zip(tables.tolist(), lens):
        qs.append(torch.randn(n, HEADS, nope + ROPE, generator=g).to(DEVICE))
        latents.append(torch.randn(n, RANK + ROPE, generator=g).to(DEVICE))
        slots.append(torch.tensor([row[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)], device=DEVICE))

    def run(meta, q, latent):
        with forward_context(meta, cache, GatherWorkspace()):
            return attn(q, latent, kv_b)

    expanded = [run(AttentionMetadata(s, 0, None, None, [PrefillChunkMeta(0, n, n, t)]), q, lat)[-1]
                for s, n, t, q, lat in zip(slots, lens, tables, qs, latents)]
    decode = AttentionMetadata(torch.stack([s[-1] for s in slots]), len(lens), tables,
                               torch.tensor(lens, device=DEVICE), [])
    last_q, last_latent = torch.stack([q[-1] for q in qs]), torch.stack([lat[-1] for lat in latents])
    monkeypatch.setattr(ops, "_triton_attention", lambda q: False)  # the CPU's choice, on any device
    on_torch = run(decode, last_q, last_latent)
    monkeypatch.setattr(ops, "_triton_attention", lambda q: True)  # the GPU's
    on_kernel = run(decode, last_q, last_latent)
    torch.testing.assert_close(on_kernel, on_torch, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(on_kernel, torch.stack(expanded), atol=2e-5, rtol=2e-5)


def test_group_limited_routing_has_no_data_dependent_shapes():
    """DeepSeekMoE's router (sigmoid scores, the best `topk_group` of `n_group` groups, top-k within
    them) traced with fake tensors: every shape follows the input's and nothing is read back, as a
    CUDA graph needs. The experts' loop (the CPU path) reads the chosen experts: it does not trace."""
    arch = ModelArch.from_dict(_config(PRESETS["tiny-deepseek-v3"], 512, 1, 2))
    moe = DeepseekV3MoE(arch, ParallelState(0, 1))
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(5, arch.hidden_size)
        top_w, top_i = moe._route(x)
        assert top_w.shape == top_i.shape == (5, arch.num_experts_per_tok)
        with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
            ops.moe(x, moe.w13, moe.w2, top_w, top_i, is_fused=False)


def test_group_limited_routing_matches_the_formula():
    """The router against transformers' DeepseekV3TopkRouter written out (its group mask expanded
    and reshaped), with a correction bias that changes which groups win."""
    arch = ModelArch.from_dict(_config(PRESETS["tiny-deepseek-v3"], 512, 1, 2))
    moe = DeepseekV3MoE(arch, ParallelState(0, 1))
    moe.gate.weight.data.normal_()
    moe.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(9, arch.hidden_size)
    scores = (x @ moe.gate.weight.T).sigmoid()
    choice = scores + moe.e_score_correction_bias
    n_group, per_group = arch.n_group, arch.num_experts // arch.n_group
    group_scores = choice.view(-1, n_group, per_group).topk(2, dim=-1)[0].sum(-1)
    mask = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(arch.topk_group, dim=-1)[1], 1)
    mask = mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(-1, arch.num_experts).bool()
    want_i = choice.masked_fill(~mask, float("-inf")).topk(arch.num_experts_per_tok, dim=-1)[1].sort(-1)[0]
    want_w = scores.gather(1, want_i)
    want_w = want_w / (want_w.sum(-1, keepdim=True) + 1e-20) * arch.routed_scaling_factor
    top_w, top_i = moe._route(x)
    order = top_i.argsort(-1)
    assert torch.equal(top_i.gather(1, order), want_i)
    torch.testing.assert_close(top_w.gather(1, order), want_w)


def test_cuda_graphs_need_one_rank_the_fused_experts_and_the_latent_kernel(monkeypatch):
    arch = ModelArch.from_dict(_config(PRESETS["tiny-deepseek-v3"], 512, 1, 2))
    model = DeepseekV3ForCausalLM(arch, 64)
    moe_layers = [m for m in model.modules() if isinstance(m, DeepseekV3MoE)]
    assert moe_layers and not model.supports_cuda_graphs  # on the CPU: neither kernel
    for m in moe_layers:
        m.is_fused = True
    assert not model.supports_cuda_graphs  # the fused experts alone: MLA's kernel takes a GPU's tensors
    monkeypatch.setattr(ops, "runs_latent_attention_on_triton", lambda device: True)
    assert model.supports_cuda_graphs
    moe_layers[0].is_fused = False
    assert not model.supports_cuda_graphs
    two = DeepseekV3ForCausalLM(arch, 64, ParallelState(0, 2))
    for m in two.modules():
        if isinstance(m, DeepseekV3MoE):
            m.is_fused = True
    assert not two.supports_cuda_graphs


PROMPTS = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((1, 16, 17, 40))]
PARAMS = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, logprobs=1, ignore_eos=True) for i in range(4)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of what a GPU captures: "
                    "test_cuda_graphs.py captures it there")
def test_decode_graphs_on_the_triton_paths_give_the_engines_tokens(tmp_path, monkeypatch):
    """The decode step a CUDA graph captures for DeepSeek-V3, run eagerly through `DecodeGraphs`'
    static buffers and padding: MLA on the latent kernel, the experts fused (as a GPU chooses them,
    here under the interpreter), against the engine on the torch paths. Requests end one after
    another (decode batches of 4 down to 1, 3 padded to 4), prompts end inside and on a block."""
    path = str(make_checkpoint("tiny-deepseek-v3", tmp_path / "deepseek"))
    expected = _outputs(LLM(path, max_num_seqs=4))
    monkeypatch.setattr(ops, "fuses_moe", lambda w13, is_expert_parallel: not is_expert_parallel)
    monkeypatch.setattr(ops, "runs_latent_attention_on_triton", lambda device: True)
    monkeypatch.setattr(ops, "_triton_attention", lambda q: True)  # MLA's decode on the kernel (prefill: torch)
    graphed = LLM(path, max_num_seqs=4)
    engine = graphed.engine
    assert engine.model.supports_cuda_graphs  # one rank, every MoE layer fused, MLA on the kernel
    graphs = DecodeGraphs(engine.model, engine.kv_cache, 4, -(-engine.max_model_len // engine.kv_cache.block_size),
                          "cpu")
    engine.runner.decode_graphs = graphs
    batches, kernel_batches = [], []
    run, kernel = graphs.run, ops.triton_mla.latent_decode_attention
    monkeypatch.setattr(graphs, "run", lambda ids, *rest: batches.append(len(ids)) or run(ids, *rest))
    monkeypatch.setattr(ops.triton_mla, "latent_decode_attention",
                        lambda q_lat, *rest, **kw: kernel_batches.append(q_lat.shape[0]) or kernel(q_lat, *rest, **kw))

    got = _outputs(graphed)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, lp_got), (_, lp_expected) in zip(got, expected):
        torch.testing.assert_close(lp_got, lp_expected, atol=1e-4, rtol=1e-4)
    assert {3, 2, 1} <= set(batches) and 4 in kernel_batches  # 3 live requests ran the graph of 4
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def _outputs(llm: LLM):
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in llm.generate(PROMPTS, PARAMS)]
