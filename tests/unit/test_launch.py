"""`pdserve serve`'s launcher: the environment it gives Ray. (Ray and a second process:
tests/integration/test_launch.py.)"""

import pytest
from pydantic import ValidationError

from pdserve import launch
from pdserve.config import ServeConfig


def test_serve_starts_ray_with_haproxy_ingress_unless_configured(monkeypatch):
    # Ray's workers at nice 0 like its daemons; Serve's control loop slower on small machines.
    large = {launch.WORKER_NICENESS_ENV: "0", launch.GRPC_MAX_MESSAGE_ENV: str(4 * 2**20)}
    small = {**large, launch.CONTROL_LOOP_ENV: "0.5"}
    for cpus, loop in ((2, small), (16, large)):
        haproxy = {**loop, launch.HA_PROXY_ENV: "1", launch.HA_PROXY_THREADS_ENV: str(launch.haproxy_threads(cpus)),
                   launch.HA_PROXY_CLIENT_TIMEOUT_ENV: "600"}
        cases = [("haproxy", None, True, haproxy), ("proxy", None, True, loop),
                 ("haproxy", "ray://h:1", True, {}), ("haproxy", None, False, loop)]  # no binary: Serve's own proxy
        for ingress, address, has_haproxy, expected in cases:
            monkeypatch.setattr(launch, "has_haproxy", lambda: has_haproxy)
            assert launch.ray_env(ServeConfig(model="m", gateway={"ingress": ingress}), address, cpus) == expected
    with pytest.raises(ValidationError):
        ServeConfig(gateway={"ingress": "nginx"})
    assert [launch.haproxy_threads(n) for n in (1, 2, 8, 16, 64)] == [1, 1, 2, 4, 4]
