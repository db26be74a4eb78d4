"""The package's layout holds: data flows one way between its rooms, and no module imports itself back.

Read from the source (every `import` statement, at module level or inside a function), so a later change
that adds an import circle or reaches back up fails here.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "yue2_vllm"
# Above the single-song orchestrator: the only modules that may import `pipeline`.
ABOVE_PIPELINE = ("yue2_vllm.scheduler", "yue2_vllm.cli", "yue2_vllm.serve", "yue2_vllm.bench",
                  "yue2_vllm.quant.export")
# What each room may not import (room -> forbidden prefixes).
FORBIDDEN = {
    "yue2_vllm.model": ("yue2_vllm.engine", "yue2_vllm.quant", "yue2_vllm.serve", "yue2_vllm.pipeline",
                        "yue2_vllm.scheduler", "yue2_vllm.cli"),
    "yue2_vllm.engine": ("yue2_vllm.serve", "yue2_vllm.pipeline", "yue2_vllm.scheduler", "yue2_vllm.cli"),
    "yue2_vllm.quant": ("yue2_vllm.serve", "yue2_vllm.scheduler", "yue2_vllm.cli"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports: `from .x import y` names module `.x.y` when there is one."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            stem = ".".join(parts[: len(parts) - node.level + 1] + [node.module] if node.level and node.module
                            else parts[: len(parts) - node.level + 1] if node.level else [node.module or ""])
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def test_no_import_circles():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_rooms_import_one_way():
    problems = []
    for name, targets in graph().items():
        for room, forbidden in FORBIDDEN.items():
            if name == room or name.startswith(room + "."):
                problems += [f"{name} imports {t}" for t in targets if t.startswith(forbidden)]
        if "yue2_vllm.pipeline" in targets and not name.startswith(ABOVE_PIPELINE):
            problems.append(f"{name} imports yue2_vllm.pipeline (only {', '.join(ABOVE_PIPELINE)} may)")
    assert not problems, "\n".join(problems)


def test_the_walker_sees_imports():
    edges = graph()
    assert "yue2_vllm.engine.backend" in edges["yue2_vllm.pipeline"]  # a lazy import inside a method counts
    assert "yue2_vllm.model.modeling" in edges["yue2_vllm.model.loader"]
