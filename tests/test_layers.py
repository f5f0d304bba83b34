"""The packages import only downward, and no module imports itself through others.

    top        moemesh.entrypoints (CLI, launchers, generate/serve, LLMEngine, tools, benchmarks)
    control    coordinator/, gateway/          |  compute   stage_worker/, kernels/  (torch, triton)
    base       moemesh/ (protocol, config, layout, settings, sampling, errors, log, client, ...)

control and compute never import each other; base and control never import torch or triton. Every
import counts, including those inside functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# import name: its directory (the kernels/ directory is imported as moemesh_kernels: a top-level `kernels`
# would be HuggingFace's, which transformers imports)
PACKAGES = {"moemesh": "moemesh", "coordinator": "coordinator", "gateway": "gateway", "stage_worker": "stage_worker",
            "moemesh_kernels": "kernels"}
HEAVY = ("torch", "triton")


def layer(module: str) -> str:
    if module.startswith(("moemesh.entrypoints", "moemesh.__main__")):
        return "top"
    if module.split(".")[0] in ("coordinator", "gateway"):
        return "control"
    if module.split(".")[0] in ("stage_worker", "moemesh_kernels"):
        return "compute"
    return "base"


ALLOWED = {"base": {"base"}, "control": {"base", "control"}, "compute": {"base", "compute"},
           "top": {"base", "control", "compute", "top"}}


def modules() -> dict[str, Path]:
    found = {}
    for package, directory in PACKAGES.items():
        for path in (ROOT / directory).rglob("*.py"):
            name = ".".join((package, *path.relative_to(ROOT / directory).with_suffix("").parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict) -> set[str]:
    """Every module `name` imports (ours by their full name, third-party by their top package)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
        else:
            continue
        for t in targets:
            if t in known:
                out.add(t)
            elif t.split(".")[0] in HEAVY:
                out.add(t.split(".")[0])
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_import_points_down_or_sideways_within_a_layer():
    wrong = []
    for name, deps in graph().items():
        for dep in deps:
            if dep in HEAVY:
                if layer(name) in ("base", "control"):
                    wrong.append(f"{name} imports {dep}")
            elif layer(dep) not in ALLOWED[layer(name)]:
                wrong.append(f"{name} ({layer(name)}) imports {dep} ({layer(dep)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    g = {n: {d for d in deps if d not in HEAVY} for n, deps in graph().items()}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_a_wrong_import_and_a_cycle(tmp_path, monkeypatch):
    """The two tests above on a made-up tree: a control module importing torch and stage_worker,
    and two base modules importing each other."""
    for package, files in {"coordinator": {"x.py": "import torch\nfrom stage_worker import y\n"},
                           "stage_worker": {"y.py": ""},
                           "moemesh": {"a.py": "from moemesh import b\n", "b.py": "def f():\n    import moemesh.a\n"},
                           "gateway": {}, "kernels": {}}.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        for fname, text in files.items():
            (tmp_path / package / fname).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    g = graph()
    assert {"torch", "stage_worker.y"} <= g["coordinator.x"]
    assert "moemesh.a" in g["moemesh.b"] and "moemesh.b" in g["moemesh.a"]
    for check in (test_every_import_points_down_or_sideways_within_a_layer, test_no_import_cycles):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} passed on a broken tree")


def test_the_lists_of_names_agree():
    """Dtype, backend and quantization names are declared in the base layer; the compute side maps
    them and must know every one."""
    from moemesh.config import DTYPES, MOE_BACKENDS
    from moemesh.protocol import TENSOR_ITEM_SIZES
    from moemesh_kernels.backend import BACKENDS
    from stage_worker.tensors import DTYPES as TORCH_DTYPES

    assert BACKENDS == MOE_BACKENDS
    assert set(TORCH_DTYPES) == set(TENSOR_ITEM_SIZES) and set(DTYPES) <= set(TORCH_DTYPES)
    assert all(TORCH_DTYPES[name].itemsize == size for name, size in TENSOR_ITEM_SIZES.items())


def test_the_packages_pyproject_lists_are_the_tree():
    """pyproject lists the packages (kernels/ is installed as moemesh_kernels, so they are not found):
    a new subpackage missing from the list would be missing from a wheel. And kernels/ stays without
    an __init__.py, so a checkout on sys.path does not hide HuggingFace's `kernels` from transformers."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools.get("package-dir", {})

    def directory(name: str) -> Path:  # as setuptools finds it: through the longest mapped prefix
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in mapped:
                return ROOT / mapped[".".join(parts[:n])] / Path(*parts[n:])
        return ROOT / Path(*parts)

    directories = {name: directory(name) for name in setuptools["packages"]}
    tree = {".".join((package, *path.parent.relative_to(ROOT / directory).parts))
            for package, directory in PACKAGES.items() for path in (ROOT / directory).rglob("*.py")}
    assert set(setuptools["packages"]) == tree
    assert all(path.is_dir() for path in directories.values())
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_gateway_and_coordinator_load_without_torch():
    """What a gateway or coordinator host runs (`pip install moemesh`, no worker extra): the two
    servers and the CLI that starts them."""
    code = ("import sys, gateway.server, coordinator.server, moemesh.client, moemesh.layout, moemesh.settings\n"
            "from moemesh.entrypoints.cli import build_parser\n"
            "build_parser().parse_args(['coordinator', '--model', 'm'])\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy', 'safetensors'))\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
