"""The package's layout holds: data flows one way between its rooms, and no module imports itself back.

Read from the source (every `import` statement, at module level or inside a function), so a later change
that adds an import circle or reaches back up fails here.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "yue2_vllm"
# Above the single-song orchestrator: the only modules that may import `pipeline`.
ABOVE_PIPELINE = ("yue2_vllm.scheduler", "yue2_vllm.cli", "yue2_vllm.serve", "yue2_vllm.bench")
# What each room may not import (room -> forbidden packages/modules, each with everything inside it).
FORBIDDEN = {
    "yue2_vllm.model": ("yue2_vllm.engine", "yue2_vllm.quant", "yue2_vllm.serve", "yue2_vllm.pipeline",
                        "yue2_vllm.scheduler", "yue2_vllm.bench", "yue2_vllm.cli", "yue2_vllm.adapters"),
    # Adapters users bring: read, checked and converted on top of the floor and the torch model's definition
    # (`model.lora` applies them); the engine, the song's parts and the faces read adapters/, never the reverse.
    "yue2_vllm.adapters": ("yue2_vllm.engine", "yue2_vllm.quant", "yue2_vllm.serve", "yue2_vllm.song",
                           "yue2_vllm.pipeline", "yue2_vllm.scheduler", "yue2_vllm.bench", "yue2_vllm.cli"),
    "yue2_vllm.engine": ("yue2_vllm.serve", "yue2_vllm.pipeline", "yue2_vllm.scheduler", "yue2_vllm.bench",
                         "yue2_vllm.cli"),
    "yue2_vllm.quant": ("yue2_vllm.serve", "yue2_vllm.pipeline", "yue2_vllm.scheduler", "yue2_vllm.bench",
                        "yue2_vllm.cli"),
    # One song's parts (models, engine life, admission, stages, run directory): between the floor and the
    # orchestrators. They may read engine/, model/ and quant/; the pipeline composes them, never the reverse.
    "yue2_vllm.song": ("yue2_vllm.serve", "yue2_vllm.pipeline", "yue2_vllm.scheduler", "yue2_vllm.bench",
                       "yue2_vllm.cli"),
    # Audio in, a melody-mode score out: it stands on the floor (the score's reader) and nothing else; the faces
    # (cli/, serve/, bench) read it, the song's parts never need it (a transcribed score is a request's `abc`).
    "yue2_vllm.transcription": ("yue2_vllm.engine", "yue2_vllm.model", "yue2_vllm.quant", "yue2_vllm.serve",
                                "yue2_vllm.song", "yue2_vllm.adapters", "yue2_vllm.pipeline", "yue2_vllm.scheduler",
                                "yue2_vllm.bench", "yue2_vllm.cli"),
}
# The floor (yue2_vllm/*.py) holds two kinds of module. The orchestrators build on the rooms: `pipeline` runs
# one song on engine/ and model/, `scheduler` many songs over it, `bench` measures them all. Every other floor
# module is the ground the rooms stand on (protocol, checkpoint, hub, derive, quant_scheme, memory, testing,
# ...): it may read the torch model's definition in model/ (derive, memory and testing read its YuE2Config and
# tensor shapes), but never a room built on top of it, nor an orchestrator.
FLOOR_ORCHESTRATORS = ("yue2_vllm.pipeline", "yue2_vllm.scheduler", "yue2_vllm.bench")
FLOOR_FORBIDDEN = ("yue2_vllm.engine", "yue2_vllm.quant", "yue2_vllm.serve", "yue2_vllm.cli", "yue2_vllm.song",
                   "yue2_vllm.adapters", "yue2_vllm.transcription", *FLOOR_ORCHESTRATORS)


def inside(name: str, packages) -> bool:
    """`name` is one of `packages` or a module inside one (`yue2_vllm.quant_scheme` is not inside `.quant`)."""
    return any(name == package or name.startswith(package + ".") for package in packages)


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
            if inside(name, [room]):
                problems += [f"{name} imports {t}" for t in targets if inside(t, forbidden)]
        if "yue2_vllm.pipeline" in targets and not inside(name, ABOVE_PIPELINE):
            problems.append(f"{name} imports yue2_vllm.pipeline (only {', '.join(ABOVE_PIPELINE)} may)")
    assert not problems, "\n".join(problems)


def floor_modules() -> list[str]:
    return sorted(name for name, path in modules().items() if path.parent == PACKAGE and name != "yue2_vllm")


def test_the_floor_reads_no_room_above_it():
    """No arrow runs up from the ground floor: derive reads the scheme table from the floor (quant_scheme), not
    from quant/; quant/ reads derive, never the other way."""
    edges = graph()
    problems = [f"{name} imports {target}" for name in floor_modules() if name not in FLOOR_ORCHESTRATORS
                for target in sorted(edges[name]) if inside(target, FLOOR_FORBIDDEN)]
    assert not problems, "\n".join(problems)


def test_the_layout_rules_see_the_house():
    """The rules above bite on real edges: the floor list is what the drawing says, and the arrows the rules
    are about exist (so a rename cannot leave them checking nothing)."""
    edges = graph()
    assert {"yue2_vllm.derive", "yue2_vllm.quant_scheme", "yue2_vllm.hub", "yue2_vllm.testing",
            *FLOOR_ORCHESTRATORS} <= set(floor_modules())
    assert "yue2_vllm.quant_scheme" in edges["yue2_vllm.derive"]
    assert "yue2_vllm.derive" in edges["yue2_vllm.quant.export"]
    assert "yue2_vllm.derive" in edges["yue2_vllm.quant.policy"]
    assert "yue2_vllm.quant.policy" in edges["yue2_vllm.song.engine_life"]  # the engine asks quant/ which to serve
    song_parts = {"yue2_vllm.song.engine_life", "yue2_vllm.song.stages", "yue2_vllm.song.run_dir"}
    assert song_parts <= edges["yue2_vllm.pipeline"]  # the orchestrator composes the song's parts
    assert "yue2_vllm.score" in edges["yue2_vllm.instrumental"]  # the native score's reader is the floor's
    assert "yue2_vllm.score" in edges["yue2_vllm.transcription.writer"]
    assert inside("yue2_vllm.quant.schemes", ["yue2_vllm.quant"]) and not inside("yue2_vllm.quant_scheme",
                                                                                   ["yue2_vllm.quant"])


def test_the_walker_sees_imports():
    edges = graph()
    assert "yue2_vllm.engine.backend" in edges["yue2_vllm.song.engine_life"]  # a lazy import in a function counts
    assert "yue2_vllm.model.modeling" in edges["yue2_vllm.model.loader"]


ROUTES = "yue2_vllm.serve.routes"
# What a router never reads: the app that composes the routers, and the process and cluster around the app.
ROUTES_FORBIDDEN = ("yue2_vllm.serve.app", "yue2_vllm.serve.runner", "yue2_vllm.serve.cluster",
                    "yue2_vllm.serve.ray_cluster", "yue2_vllm.serve.replica")


def test_the_http_api_is_routers_that_only_the_app_composes():
    """serve/routes/ holds one router per resource (and `common`, what they share): only serve.app includes them, and
    a router reads the service below it, never the app, the server process or the cluster above it."""
    edges = graph()
    assert {name for name in edges if inside(name, [ROUTES])} >= {f"{ROUTES}.{name}" for name in (
        "common", "page", "health", "songs", "files", "takes", "events")}
    problems = [f"{name} imports {target}" for name, targets in edges.items() if inside(name, [ROUTES])
                for target in sorted(targets) if inside(target, ROUTES_FORBIDDEN)]
    problems += [f"{name} imports {target}" for name, targets in edges.items()
                 if not inside(name, [ROUTES]) and name != "yue2_vllm.serve.app"
                 for target in sorted(targets) if inside(target, [ROUTES])]
    assert not problems, "\n".join(problems)
