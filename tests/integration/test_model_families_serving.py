"""Each family added in #44, from a checkpoint `transformers` wrote, served on Ray Serve
disaggregated (every prompt prefilled on the prefill pool, its KV pulled over the transfer backend,
tcp by default; one family's over ucx) and colocated: greedy tokens equal the offline engine's, and
a second turn reuses the first turn's prefix on both pools (only the new blocks are pulled)."""

from __future__ import annotations

import pytest

from pdserve.config import ServeConfig
from pdserve.engine.kv_groups import layer_groups
from pdserve.engine.llm import LLM
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol import GenerateRequest
from tests.harness.fixed_costs import REMOTE_PREFILL_SLO
from tests.harness.hf_checkpoints import FAMILIES, write_checkpoint

BLOCK = 8
ENGINE = {"num_threads": 1, "num_kv_blocks": 96, "block_size": BLOCK, "max_model_len": 512, "max_num_seqs": 8,
          "max_num_batched_tokens": 128}
PROMPTS = [[5, 17, 99, 3, 44, 7, 8, 9], list(range(20, 120)), [300, 301, 7]]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# The app-level run of the ucx backend: a Ray Serve replica's UCX exporter and importer built from
# the config, its blocks over UCX's connection (no shared memory), a second turn's partial pull.
# Every other family's go over tcp (and test_multinode.py's between raylets).
TRANSFER = {"qwen3": {"backend": "ucx", "shared_memory": False}}


def _greedy(app: str, pool: str, prompt: list[int], tag: str) -> list[int]:
    from ray import serve

    handle = serve.get_deployment_handle(pool, app).options(stream=True)
    return [t for out in handle.generate.remote(GenerateRequest(f"{app}-{tag}", prompt, PARAMS))
            for t in out.new_token_ids]


def _stats(app: str, pool: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(pool, app).stats.remote().result(timeout_s=30)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_apps(request, ray_session, checkpoints, tmp_path_factory):
    from ray import serve
    from ray.serve.context import _get_global_client

    from pdserve.app import build

    family = request.param
    model = str(write_checkpoint(family, tmp_path_factory.mktemp(family), checkpoints["tiny-llama"]))
    pool = {"ray_actor_options": {"num_cpus": 0.2}}
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    apps = {f"{family}-pd": ServeConfig(name=f"{family}-pd", model=model, engine=ENGINE, slo=REMOTE_PREFILL_SLO,
                                        transfer={"host": "127.0.0.1", **TRANSFER.get(family, {})}, prefill=pool,
                                        decode=pool),
            f"{family}-colo": ServeConfig(name=f"{family}-colo", model=model, mode="colocated", engine=ENGINE,
                                          decode=pool)}
    # Both apps at once: their replicas start side by side (most of a start is waiting on Serve).
    serve.run_many([serve.RunTarget(build(cfg), name=name, route_prefix=f"/{name}") for name, cfg in apps.items()])
    yield family, model
    _get_global_client().delete_apps(list(apps))  # both at once, as they came


def test_served_greedy_equals_the_offline_engine(family_apps):
    family, model = family_apps
    offline = [o.token_ids for o in LLM(model, block_size=BLOCK).generate(PROMPTS, PARAMS)]
    for i, prompt in enumerate(PROMPTS):
        assert _greedy(f"{family}-pd", "Decode", prompt, f"a{i}") == offline[i], i
        assert _greedy(f"{family}-colo", "Unified", prompt, f"a{i}") == offline[i], i
    stats = _stats(f"{family}-pd", "Decode")
    assert stats["num_remote_prefills"] == len(PROMPTS) and stats["num_failed_pulls"] == 0, stats
    if TRANSFER.get(family, {}).get("shared_memory") is False:
        assert stats["num_shared_memory_pulls"] == 0 and stats["num_pulled_blocks"] > 0, stats


def test_a_second_turn_pulls_only_its_new_blocks(family_apps):
    family, model = family_apps
    app = f"{family}-pd"
    first = list(range(130, 130 + 6 * BLOCK))
    first_out = _greedy(app, "Decode", first, "turn1")
    before = _stats(app, "Decode")["num_pulled_blocks"]
    second = first + first_out + [7, 8, 9, 10]
    offline = LLM(model, block_size=BLOCK).generate([second], PARAMS)[0].token_ids
    assert _greedy(app, "Decode", second, "turn2") == offline
    pulled = _stats(app, "Decode")["num_pulled_blocks"] - before
    # The first turn's 6 full prompt blocks are cached on the decode replica: at most the blocks
    # past them move (the rest of the first turn's output and the new tokens), one block id per
    # layer group each (Gemma 3: its global layers' and each run of sliding layers').
    arch = ModelArch.from_dir(model)
    num_groups = len(layer_groups(arch.num_layers, arch.layer_windows))
    assert 0 < pulled <= (-(-len(second) // BLOCK) - 6) * num_groups, pulled
