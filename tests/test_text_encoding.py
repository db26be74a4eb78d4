"""Every text read and write in the package names its encoding (the platform default is cp1252 on Windows).

An AST scan, as upstream's test does, over `read_text`/`write_text`, `open`/`os.fdopen` in text mode,
`io.TextIOWrapper` and subprocess calls with `text=True`.
"""
import ast
from pathlib import Path

import yue2_vllm

PACKAGE = Path(yue2_vllm.__file__).resolve().parent
ALWAYS_TEXT = {"read_text", "write_text", "TextIOWrapper"}
MODE_TEXT = {"open", "fdopen"}
SUBPROCESS = {"run", "Popen", "check_output", "check_call", "call"}


def _keywords(node: ast.Call) -> dict:
    return {word.arg: word.value for word in node.keywords if word.arg is not None}


def _text_mode(node: ast.Call, name: str) -> bool:
    """open(path, mode) / os.fdopen(fd, mode): text unless the mode is a constant with 'b'."""
    mode = _keywords(node).get("mode")
    if mode is None:
        position = 1
        mode = node.args[position] if len(node.args) > position else None
    if mode is None:
        return True
    return not (isinstance(mode, ast.Constant) and isinstance(mode.value, str) and "b" in mode.value)


def _is_os_open(func) -> bool:
    return isinstance(func, ast.Attribute) and func.attr == "open" and isinstance(func.value, ast.Name) \
        and func.value.id == "os"


def implicit_text_io(source: str):
    """(line, call) for text I/O without an explicit `encoding=`."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        keywords = _keywords(node)
        if "encoding" in keywords or _is_os_open(func):  # os.open gives a file descriptor: no text layer
            continue
        if name in ALWAYS_TEXT or (name in MODE_TEXT and _text_mode(node, name)):
            yield node.lineno, name
        elif name in SUBPROCESS and any(isinstance(keywords.get(k), ast.Constant) and keywords[k].value is True
                                        for k in ("text", "universal_newlines")):
            yield node.lineno, name


def test_the_scan_finds_what_it_looks_for():
    found = list(implicit_text_io("from pathlib import Path\nPath('a').read_text()\nopen('x')\nopen('x', 'rb')\n"
                                  "open('x', mode='w')\nopen('x', 'a', encoding='utf-8')\n"
                                  "Path('a').write_text('t', encoding='utf-8')\nsubprocess.run(['a'], text=True)\n"
                                  "io.TextIOWrapper(stream)\nos.fdopen(3, 'wb')\nos.open('d', os.O_RDONLY)\n"))
    assert found == [(2, "read_text"), (3, "open"), (5, "open"), (8, "run"), (9, "TextIOWrapper")]


def test_shipped_text_io_declares_an_encoding():
    offenders = [f"{path.relative_to(PACKAGE.parent).as_posix()}:{line} {call}()"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for line, call in implicit_text_io(path.read_text(encoding="utf-8"))]
    assert offenders == [], "text I/O without an explicit encoding: " + ", ".join(offenders)
