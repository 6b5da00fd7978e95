"""The machine line every benchmark prints beside its figures (RESULTS.md quotes it), and the
network-namespace lab for the benchmarks that put traffic on real (virtual) links."""

from __future__ import annotations

import os
import platform
import sys


def machine_line(device: str = "cpu") -> str:
    """Host, CPU model, cores (and how many of them this process may use, when fewer), memory, Python;
    with a CUDA `device`, the GPU and torch's build too."""
    # (imported here, not above: importing this module must start no thread, see netns_lab)
    from pdserve.engine.parallel import usable_cpus

    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    cores, usable = os.cpu_count() or 1, usable_cpus()
    cpus = f"{cores} cores" if usable == cores else f"{cores} cores, {usable} usable by this process"
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    line = (f"{platform.node()} {platform.machine()}, {model}, {cpus}, {mem_gib:.0f} GiB, "
            f"Python {platform.python_version()}")
    if device.startswith("cuda"):
        import torch

        line += f", {torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    return line


def warn_if_pinned() -> None:
    """A benchmark that gives its engines all cores measures nothing useful from a process pinned
    to fewer (its parent's taskset, or a container's cpuset): say so before the run."""
    from pdserve.engine.parallel import usable_cpus

    cores, usable = os.cpu_count() or 1, usable_cpus()
    if usable < cores:
        print(f"warning: this process may run on {usable} of the machine's {cores} cores, and so will "
              f"everything it starts; to give it all of them: taskset -c 0-{cores - 1} {' '.join(sys.argv)}",
              file=sys.stderr)


def netns_lab():
    """tests/harness/netns.py (the repository's root on sys.path). A process enters a namespace
    before any thread starts (setns moves the calling thread only), so this module imports
    nothing that starts one (torch does)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.harness import netns

    return netns
