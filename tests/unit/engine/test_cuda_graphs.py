"""Decode steps through `DecodeGraphs`: the static buffers, the padding to a captured batch size and
(on a GPU) the captured graphs give the tokens the engine gives without them."""

import pytest
import torch

from pdserve.engine.cuda_graphs import DecodeGraphs, capture_sizes
from pdserve.engine.kernels import cpu_decoder
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

# Seven requests that end one after another, so decode batches of 7 down to 1 run (most of them
# padded to 8, 4 or 2), with prompts that end inside, and exactly on, a 16-token block.
PROMPTS = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((1, 9, 16, 17, 31, 40, 64))]
PARAMS = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, logprobs=2, ignore_eos=True) for i in range(7)]


def _outputs(llm: LLM):
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in llm.generate(PROMPTS, PARAMS)]


def _count_runs(graphs: DecodeGraphs, monkeypatch) -> list[int]:
    batches = []
    run = graphs.run

    def counted(ids, *rest):
        batches.append(len(ids))
        return run(ids, *rest)

    monkeypatch.setattr(graphs, "run", counted)
    return batches


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])  # separate and tied embeddings
def test_static_buffers_and_padding_give_the_engines_tokens(checkpoints, preset, monkeypatch):
    # On the CPU the graphs are not captured: `run` runs the same buffers and padding eagerly.
    # The C decoder is off on both sides, so both run the model op by op and may be compared exactly.
    monkeypatch.setattr(cpu_decoder, "decoder_for", lambda model, kv: None)
    reference, graphed = (LLM(checkpoints[preset], max_num_seqs=8) for _ in range(2))
    engine = graphed.engine
    graphs = DecodeGraphs(engine.model, engine.kv_cache, 8, -(-engine.max_model_len // engine.kv_cache.block_size),
                          "cpu")
    engine.runner.decode_graphs = graphs
    batches = _count_runs(graphs, monkeypatch)

    assert _outputs(graphed) == _outputs(reference)
    assert {3, 5, 6, 7} <= set(batches)  # padded batches ran
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_give_the_eager_engines_tokens(checkpoints, monkeypatch):
    eager = LLM(checkpoints["tiny-llama"], device="cuda:0", max_num_seqs=8, enforce_eager=True)
    graphed = LLM(checkpoints["tiny-llama"], device="cuda:0", max_num_seqs=8)
    assert eager.engine.runner.decode_graphs is None
    graphs = graphed.engine.runner.decode_graphs
    assert sorted(graphs._graphs) == [1, 2, 4, 8]
    batches = _count_runs(graphs, monkeypatch)

    expected, got = _outputs(eager), _outputs(graphed)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, lp_got), (_, lp_expected) in zip(got, expected):
        torch.testing.assert_close(lp_got, lp_expected, atol=1e-4, rtol=1e-4)
    assert {3, 5, 6, 7} <= set(batches)
    # MoE on one GPU runs the fused Triton experts (routing stays on the device): captured too.
    moe_eager = LLM(checkpoints["tiny-mixtral"], device="cuda:0", max_num_seqs=8, enforce_eager=True)
    moe = LLM(checkpoints["tiny-mixtral"], device="cuda:0", max_num_seqs=8)
    assert moe.engine.runner.decode_graphs is not None
    assert [tokens for tokens, _ in _outputs(moe)] == [tokens for tokens, _ in _outputs(moe_eager)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_of_a_sliding_window_model_give_the_eager_engines_tokens(tmp_path):
    """Gemma 3's sliding layers on the Triton kernels' window: captured, the same tokens."""
    from pdserve.engine.checkpoint import make_checkpoint

    path = str(make_checkpoint("tiny-gemma3", tmp_path / "gemma3"))
    eager = LLM(path, device="cuda:0", max_num_seqs=8, enforce_eager=True)
    graphed = LLM(path, device="cuda:0", max_num_seqs=8)
    assert graphed.engine.runner.decode_graphs is not None
    assert [tokens for tokens, _ in _outputs(graphed)] == [tokens for tokens, _ in _outputs(eager)]


def test_static_buffers_of_several_layer_groups_give_the_engines_tokens(tmp_path, monkeypatch):
    """Gemma 3: each layer group's slots and block tables in the static buffers (its sliding
    groups' tables hold placeholders once blocks leave the 40-token window: the prompts and
    outputs here run past it), run eagerly on the CPU as above."""
    from pdserve.engine.checkpoint import make_checkpoint

    path = str(make_checkpoint("tiny-gemma3", tmp_path / "gemma3"))
    reference, graphed = (LLM(path, max_num_seqs=8) for _ in range(2))
    engine = graphed.engine
    assert engine.model.supports_cuda_graphs
    graphs = DecodeGraphs(engine.model, engine.kv_cache, 8, -(-engine.max_model_len // engine.kv_cache.block_size),
                          "cpu")
    assert graphs.num_groups == 3  # the global layer's group, and one per sliding layer (one slot each)
    engine.runner.decode_graphs = graphs
    batches = _count_runs(graphs, monkeypatch)

    assert _outputs(graphed) == _outputs(reference)
    assert {3, 5, 6, 7} <= set(batches)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_static_buffers_of_a_latent_cache_give_the_engines_tokens(tmp_path, monkeypatch):
    """DeepSeek-V3 (MLA over the latent cache, DeepSeekMoE): the static buffers and padding, run
    eagerly on the CPU as above (the torch paths of MLA's absorbed decode and the experts;
    test_triton_mla.py runs the same through the Triton kernels a graph captures)."""
    from pdserve.engine.checkpoint import make_checkpoint

    path = str(make_checkpoint("tiny-deepseek-v3", tmp_path / "deepseek"))
    reference, graphed = (LLM(path, max_num_seqs=8) for _ in range(2))
    engine = graphed.engine
    assert engine.kv_cache.is_latent and not engine.model.supports_cuda_graphs  # no GPU, no Triton path
    graphs = DecodeGraphs(engine.model, engine.kv_cache, 8, -(-engine.max_model_len // engine.kv_cache.block_size),
                          "cpu")
    engine.runner.decode_graphs = graphs
    batches = _count_runs(graphs, monkeypatch)

    # The same tokens; log-probabilities to rounding: the padded batch reads the table's whole
    # width (softmax over more masked positions) and sends more rows through each expert's matmul.
    expected, got = _outputs(reference), _outputs(graphed)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, lp_got), (_, lp_expected) in zip(got, expected):
        torch.testing.assert_close(lp_got, lp_expected, atol=1e-5, rtol=1e-5)
    assert {3, 5, 6, 7} <= set(batches)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_of_a_latent_attention_model_give_the_eager_engines_tokens(tmp_path):
    """DeepSeek-V3 on one GPU: MLA's absorbed decode on the Triton kernel and the fused experts
    (group-limited routing on the device): captured, the same tokens as the eager engine."""
    from pdserve.engine.checkpoint import make_checkpoint

    path = str(make_checkpoint("tiny-deepseek-v3", tmp_path / "deepseek"))
    eager = LLM(path, device="cuda:0", max_num_seqs=8, enforce_eager=True)
    graphed = LLM(path, device="cuda:0", max_num_seqs=8)
    assert graphed.engine.model.supports_cuda_graphs
    graphs = graphed.engine.runner.decode_graphs
    assert graphs is not None and sorted(graphs._graphs) == [1, 2, 4, 8]
    expected, got = _outputs(eager), _outputs(graphed)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, lp_got), (_, lp_expected) in zip(got, expected):
        torch.testing.assert_close(lp_got, lp_expected, atol=1e-4, rtol=1e-4)
