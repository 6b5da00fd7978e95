"""Fixtures of the serving roles' tests."""

from pathlib import Path

import pytest

from pdserve.config import EngineConfig, TransferConfig
from pdserve.decode.server import DecodeServer
from pdserve.kvtransfer.backends import layout_of
from pdserve.kvtransfer.local_backend import LocalImporter
from pdserve.prefill.server import PrefillServer


@pytest.fixture
def pools(tiny_llama, request):
    """Both roles over the local backend; `indirect` parametrization picks the KV cache's dtype."""
    config = EngineConfig(model=tiny_llama, num_kv_blocks=96, block_size=8,
                          kv_cache_dtype=getattr(request, "param", "auto"))
    prefill = PrefillServer(config, TransferConfig(lease_s=5), "prefill-0", backend="local")
    importer = lambda e: LocalImporter(e.kv_cache.kv, layout_of(e.kv_cache.kv, Path(tiny_llama).name),  # noqa: E731
                                       {"prefill-0": prefill.exporter})
    decode = DecodeServer(config, TransferConfig(), prefill.prefill, importer)
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()

