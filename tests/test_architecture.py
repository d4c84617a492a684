"""The package structure docs/architecture.md describes: no import cycles anywhere,
and the layering between packages.

Every ``import`` statement counts, at module level or inside a function (a lazy
import hides a cycle, it does not remove it); imports under ``TYPE_CHECKING``
do not, since they never run.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Top-level folder -> package name (pyproject.toml's package-dir).
PACKAGES = {"engine": "tandem.engine", "router": "tandem.router", "kernels": "tandem.kernels",
            "kvtransfer": "tandem.kvtransfer", "prefill_worker": "tandem.prefill_worker",
            "decode_worker": "tandem.decode_worker", "control": "tandem.control",
            "quantize": "tandem.quantize"}

# package -> packages (or third-party top-level modules) it must never import.
FORBIDDEN = {
    "tandem.kernels": {"tandem.engine", "tandem.router", "tandem.kvtransfer",
                       "tandem.prefill_worker", "tandem.decode_worker", "tandem.control",
                       "tandem.quantize"},
    # The offline quantizers build on the engine, never the other way: serving needs
    # only the linear methods in tandem.engine.quantization.
    "tandem.engine": {"tandem.router", "tandem.kvtransfer", "tandem.prefill_worker",
                      "tandem.decode_worker", "tandem.control", "tandem.quantize",
                      "ray", "grpc", "redis"},
    # ``tandem quantize`` is an offline tool: the engine and kernels, nothing of serving.
    "tandem.quantize": {"tandem.router", "tandem.kvtransfer", "tandem.prefill_worker",
                        "tandem.decode_worker", "tandem.control", "ray", "grpc", "redis"},
    "tandem.kvtransfer": {"tandem.router", "tandem.prefill_worker", "tandem.decode_worker",
                          "ray", "grpc"},
    # The cluster state is shared by routers and workers: it may use the engine's
    # event dataclasses, nothing of either side.
    "tandem.control": {"tandem.router", "tandem.prefill_worker", "tandem.decode_worker",
                       "ray", "grpc", "torch"},
}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for folder, pkg in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: pathlib.Path, module: str, is_package: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            found.add(prefix)
            found.update(f"{prefix}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        targets = _imports(path, mod, path.name == "__init__.py")
        graph[mod] = {t for t in targets if t in mods and t != mod}
        graph[mod] |= {t for t in targets if not t.startswith("tandem.")}   # third party
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_module_graph_finds_our_modules_and_their_imports():
    graph = _graph()
    assert "tandem.engine.scheduling.scheduler" in graph and "tandem.router.orchestrator" in graph
    assert "tandem.router.cluster" in graph["tandem.router.orchestrator"]
    assert "tandem.quantize.dense" in graph["tandem.quantize.awq"]
    assert "tandem.quantize.dense" in graph["tandem.quantize.autogptq"]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_a_cycle_would_be_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in graph.items():
        pkg = next((p for p in FORBIDDEN if mod == p or mod.startswith(p + ".")), None)
        if pkg is None:
            continue
        for t in targets:
            if any(t == f or t.startswith(f + ".") for f in FORBIDDEN[pkg]):
                bad.append(f"{mod} imports {t}")
    return sorted(bad)


def test_package_layering():
    assert _violations(_graph()) == []


def test_the_engine_importing_the_offline_quantizers_would_be_found():
    graph = _graph()
    graph["tandem.engine.model.loader"] |= {"tandem.quantize.dense"}
    assert _violations(graph) == ["tandem.engine.model.loader imports tandem.quantize.dense"]
