"""`pdserve serve`'s launcher: the environment it gives Ray, and a taken port said before Ray starts."""

import os
import socket
import subprocess
import sys

import pytest
from pydantic import ValidationError

from pdserve import launch
from pdserve.cli import main
from pdserve.config import ServeConfig
from pdserve.errors import AddressUnavailableError
from pdserve.launch import check_address


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


def test_serve_on_a_taken_port_says_so_before_starting_ray(capsys, monkeypatch):
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray must not start when the port is taken")

    monkeypatch.setattr(ray, "init", no_ray)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        taken = rf"127\.0\.0\.1:{port} is already in use \(by \S+, pid {os.getpid()}\)"  # who holds it: us
        with pytest.raises(AddressUnavailableError, match=taken):
            check_address("127.0.0.1", port)
        assert main(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve serve: 127.0.0.1:{port} is already in use") and "--port" in err
    check_address("127.0.0.1", port)  # closed: free again
    with pytest.raises(AddressUnavailableError, match=r"cannot listen on 192\.0\.2\.77:.*--host"):
        check_address("192.0.2.77", port)  # TEST-NET-1: no address of this machine


def test_a_port_held_by_a_leftover_haproxy_says_how_to_free_it(tmp_path):
    # Ray Serve's HAProxy outlives a `pdserve serve` killed with SIGKILL; a process named haproxy
    # stands in for it here.
    haproxy = tmp_path / "haproxy"
    haproxy.symlink_to(sys.executable)
    code = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); sys.stdin.read()")
    proc = subprocess.Popen([str(haproxy), "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        with pytest.raises(AddressUnavailableError, match=rf"by HAProxy, pid {proc.pid}, .*`kill {proc.pid}`"):
            check_address("127.0.0.1", port)
    finally:
        proc.kill()
        proc.wait()
