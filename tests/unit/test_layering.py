"""The package's layers (DESIGN.md section 1): no module imports upward, and only the Ray glue
imports Ray.

Imports are read from the source (every `import` statement, inside functions too), so a lazy
import counts as much as one at the top of a module.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "platform"

# What each part of the package may import besides itself, from the bottom up. A part is a
# folder of platform/ or a module at its root.
ALLOWED = {
    "errors": set(),
    "config": set(),
    "engine": {"config", "errors"},  # the model runtime: nothing of serving
    "kvtransfer": {"engine", "errors"},
    "output": {"engine", "errors"},
    "telemetry": {"config"},
    "bench": set(),
    "protocol": {"engine", "kvtransfer"},
    "config_check": {"config", "errors"},
    "router": {"config", "engine", "protocol", "telemetry"},
    "autoscale": {"telemetry"},
    "replica": {"autoscale", "config", "engine", "kvtransfer", "router", "telemetry"},
    "prefill": {"config", "engine", "errors", "kvtransfer", "protocol", "replica", "router", "telemetry"},
    "decode": {"config", "engine", "errors", "kvtransfer", "output", "protocol", "replica", "router", "telemetry"},
    "gateway": {"config", "engine", "errors", "output", "protocol", "telemetry"},
    "app": {"config", "config_check", "decode", "engine", "errors", "gateway", "prefill", "replica", "router"},
    "launch": {"app", "config", "errors", "router", "telemetry"},
    # the simulator drives the router's index and ranking, placement and the autoscaling policy
    "simulate": {"autoscale", "bench", "config", "config_check", "decode", "engine", "errors", "router", "telemetry"},
    "cli": {"app", "bench", "config", "config_check", "engine", "errors", "launch", "simulate", "telemetry"},
}

# The Ray Serve glue: deployments, the replica shell, the Serve request router, Ray's metrics.
# Every other module imports without Ray.
RAY_GLUE = {"pdserve.prefill.deployment", "pdserve.decode.deployment", "pdserve.gateway.deployment",
            "pdserve.replica.engine_replica", "pdserve.replica.rank_workers", "pdserve.router.request_router",
            "pdserve.telemetry.metrics", "pdserve.telemetry.status"}


def _module_name(path: Path) -> str:
    parts = [p for p in path.relative_to(PACKAGE).with_suffix("").parts if p != "__init__"]
    return ".".join(["pdserve", *parts])


def _part(module: str) -> str:
    return module.split(".")[1]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.startswith("pdserve.")}


def test_every_part_has_a_place():
    parts = {_part(_module_name(p)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE}
    assert parts == set(ALLOWED), "a new part of the package: give it a row in ALLOWED"


def test_no_module_imports_upward():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = _part(_module_name(path))
        for name in sorted(_imports(path)):
            if _part(name) != part and _part(name) not in ALLOWED[part]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


# What the engine outside kernels/ may import from it: the dispatch that picks a kernel per op, the
# whole decode step in C (which asks `decoder_for` itself whether it takes a model), and the torch
# reference (the gather workspace; the sliding-window path, which no other kernel takes yet).
KERNEL_DISPATCH = {"pdserve.engine.kernels.ops", "pdserve.engine.kernels.cpu_decoder",
                   "pdserve.engine.kernels.paged_attention"}


def test_the_engine_picks_kernels_only_through_the_dispatch():
    """The model files, the attention layer and the sampler ask `kernels/ops.py` for an op; none of
    them names a C or Triton kernel (#43: kernels behind one dispatch)."""
    wrong = []
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        if path.parent.name == "kernels":
            continue
        tree = ast.parse(path.read_text())
        names = {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                 and n.module.startswith("pdserve.engine.kernels") for a in n.names}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        for name in sorted(names):
            module = name if name.count(".") == 3 else name.rsplit(".", 1)[0]
            if name.startswith("pdserve.engine.kernels.") and module not in KERNEL_DISPATCH:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_only_the_ray_glue_imports_ray():
    modules = sorted({_module_name(p) for p in PACKAGE.rglob("*.py")} - RAY_GLUE)
    code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_messages_between_pools_load_no_engine():
    """The gateway's and the pools' messages load the engine's plain types only: no torch, no models."""
    code = ("import sys, pdserve.protocol, pdserve.output.frames\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pdserve.engine.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("['pdserve.engine.cuda_ipc', 'pdserve.engine.outputs', "
                                  "'pdserve.engine.sampling_params', 'pdserve.engine.shared_memory']")


def test_the_gateway_and_the_simulator_load_no_torch():
    """The gateway (tokenizing, templating, streaming) and `pdserve simulate` / `plan` read model
    configs but touch no tensor: torch (~190 MiB of a process, a second to import) stays out."""
    code = ("import sys, pdserve.gateway.deployment, pdserve.simulate.cli, pdserve.simulate.plan_cli\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
