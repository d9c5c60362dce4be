"""The package's shape, from its import statements (TYPE_CHECKING and function-level ones too):
imports flow one way along the data path, never up a layer, and never in a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # the package radixserve

# protocol < model_worker < scheduler (and the process-level config it reads) < the front ends
# < launch. A module may import its own layer or lower ones only.
LAYERS = {
    "protocol": 0,
    "model_worker": 1,
    "server_args": 2,
    "process_setup": 2,
    "scheduler": 2,
    "tokenizer_manager": 3,
    "detokenizer": 3,
    "http_server": 3,
    "launch": 4,
}
NOT_PACKAGE = {".venv", "build", "tests", "benchmarks"}


def import_graph() -> dict[str, set[str]]:
    files = {}
    for path in Path(REPO_ROOT).rglob("*.py"):
        rel = path.relative_to(REPO_ROOT)
        if rel.parts[0] in NOT_PACKAGE or rel.parts[0].startswith("."):
            continue
        name = ".".join(("radixserve", *rel.with_suffix("").parts)).removesuffix(".__init__")
        files[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("radixserve"):
                for alias in node.names:  # `from package import module` imports the module
                    sub = f"{node.module}.{alias.name}"
                    graph[name].add(sub if sub in files else str(node.module))
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name.startswith("radixserve")}
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_goes_up_a_layer() -> None:
    graph = import_graph()
    assert "radixserve.scheduler.scheduler" in graph and "radixserve.launch" in graph
    upward = [
        (src, dst)
        for src, targets in graph.items()
        for dst in targets
        if layer(src) in LAYERS and layer(dst) in LAYERS and LAYERS[layer(dst)] > LAYERS[layer(src)]
    ]
    assert not upward
    client = {dst for src, t in graph.items() if layer(src) == "client" for dst in t}
    assert {layer(dst) for dst in client} <= {"client", "protocol"}, "the client is a user"


def test_no_import_cycle() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dst in sorted(graph.get(module, ())):
            assert state.get(dst) != 1, " -> ".join([*path, module, dst])
            if dst not in state:
                visit(dst, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_a_request_knows_nothing_of_the_radix_cache() -> None:
    graph = import_graph()
    reached, todo = set(), ["radixserve.scheduler.req"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph.get(module, ())
    assert "radixserve.scheduler.kv_handle" in reached
    assert "radixserve.scheduler.radix_cache" not in reached
    assert "radixserve.scheduler.kv_manager" not in reached


def test_a_scheduler_starts_without_the_packages_only_its_rare_paths_use() -> None:
    """xgrammar (and the transformers it imports) and torch._dynamo (torch.nn.attention.bias's)
    are imported where a grammar or the reference attention first runs: at every start they took
    ~1.9 s of CPU and ~190 MB of the scheduler's memory (benchmarks/RESULTS.md)."""
    heavy = ("xgrammar", "transformers", "torch._dynamo")
    code = (
        "import sys, radixserve.scheduler.process\n"
        f"print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    )
    imported = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert imported == []
