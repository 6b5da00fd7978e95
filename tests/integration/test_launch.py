"""`pdserve serve`'s launcher: a taken port said before Ray starts, and who holds it (a process
standing in for a leftover HAProxy)."""

import os
import socket
import subprocess
import sys

import pytest

from pdserve.cli import main
from pdserve.errors import AddressUnavailableError
from pdserve.launch import check_address


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
