#!/usr/bin/env python3
"""Patch upstream ``yue2/fast.py`` to accept a pre-made AR checkpoint and other vLLM versions.

Usage: python patches/patch_fast.py PATH_TO/yue2/fast.py [--allow-vllm SPEC] [--dry-run]

After patching:
* ``derive_ar_checkpoint`` returns the directory named by ``YUE2_AR_CHECKPOINT`` (which must
  contain config.json) instead of deriving one; unset or empty means upstream behaviour.
* the worker's exact ``vllm.__version__ != "<pin>"`` check also admits versions listed in
  ``YUE2_VLLM_ALLOW``, comma-separated: ``0.20.1`` admits 0.20.1 and 0.20.1.post1 / 0.20.1+cu128,
  ``0.21`` admits 0.21.x, ``0.3*`` is a plain string prefix (0.3.x and 0.30-0.39), ``*`` admits anything.
  ``--allow-vllm SPEC`` bakes a default for that variable into the file; the variable, when set
  (even empty), replaces the baked default.

The edit is idempotent (marker comment), keeps a backup ``fast.py.orig`` and writes atomically.
Standard library only, Python >= 3.10.
"""
import argparse
import ast
import difflib
import io
import os
import re
import sys
import tempfile

MARKER = ">>> yue2_vllm patch (patches/patch_fast.py) >>>"
END_MARKER = "<<< yue2_vllm patch <<<"
LINE_TAG = "  # yue2_vllm patch"
FUNCTION = "derive_ar_checkpoint"
SIGNATURE = ["model_dir", "cache_dir"]
SPEC_ENTRY = re.compile(r"^(\*|[0-9A-Za-z.+!_-]+\*?)$")

HELPERS = '''\
# {marker}
# YUE2_AR_CHECKPOINT: use this AR checkpoint directory instead of deriving one.
# YUE2_VLLM_ALLOW: extra vLLM versions, comma-separated ("0.20.1", "0.21", "0.3*", "*").
# Undo by restoring fast.py.orig.
_YUE2_VLLM_PINNED = {pinned!r}
_YUE2_VLLM_ALLOW_DEFAULT = {allow!r}


def _yue2_ar_override():
    import os
    from pathlib import Path
    value = os.environ.get("YUE2_AR_CHECKPOINT", "")
    if not value:
        return None
    path = Path(value).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"YUE2_AR_CHECKPOINT={{value!r}}: {{path}} is not an existing directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"YUE2_AR_CHECKPOINT={{value!r}}: {{path}} has no config.json")
    return path


def _yue2_vllm_spec():
    import os
    return os.environ.get("YUE2_VLLM_ALLOW", _YUE2_VLLM_ALLOW_DEFAULT)


def _yue2_vllm_allowed(version):
    if version == _YUE2_VLLM_PINNED:
        return True
    for entry in (part.strip() for part in _yue2_vllm_spec().split(",")):
        if entry.endswith("*") and version.startswith(entry[:-1]):
            return True
        if entry and (version == entry or version.startswith((entry + ".", entry + "+"))):
            return True
    return False


def _yue2_vllm_refusal(version):
    return (f"This backend requires vllm=={{_YUE2_VLLM_PINNED}}, found {{version}}; "
            f"YUE2_VLLM_ALLOW={{_yue2_vllm_spec()!r}} does not admit it (set it to a comma-separated "
            f"list of versions or prefixes, e.g. YUE2_VLLM_ALLOW={{version}}, at your own risk)")
# {end_marker}


'''


class Unrecognised(Exception):
    """The file does not have the upstream shapes this patch expects."""


def read_lines(source):
    # Split exactly where ast counts lines (\n, \r\n, \r), keeping the endings.
    return io.StringIO(source, newline="").readlines()


def find_function(tree):
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == FUNCTION]
    if len(found) != 1:
        raise Unrecognised(f"expected exactly one top-level def {FUNCTION}(), found {len(found)}")
    node = found[0]
    names = [arg.arg for arg in node.args.posonlyargs + node.args.args]
    if names != SIGNATURE or node.args.vararg or node.args.kwarg or node.args.kwonlyargs:
        raise Unrecognised(f"{FUNCTION}() has signature ({', '.join(names)}), expected (model_dir, cache_dir=None)")
    if not any(isinstance(child, ast.Return) for child in ast.walk(node)):
        raise Unrecognised(f"{FUNCTION}() has no return statement")
    return node


def is_docstring(node):
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def is_version_check(node):
    """``if vllm.__version__ != "X": raise Error(...)`` with no else branch."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
        return False
    test = node.test
    left = test.left
    return (isinstance(left, ast.Attribute) and left.attr == "__version__"
            and isinstance(left.value, ast.Name) and left.value.id == "vllm"
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.NotEq)
            and isinstance(test.comparators[0], ast.Constant) and isinstance(test.comparators[0].value, str))


def find_version_check(tree):
    found = [node for node in ast.walk(tree) if is_version_check(node)]
    if len(found) != 1:
        raise Unrecognised(f'expected exactly one `if vllm.__version__ != "...":` check, found {len(found)}')
    node = found[0]
    body = node.body
    if (node.orelse or len(body) != 1 or not isinstance(body[0], ast.Raise)
            or not isinstance(body[0].exc, ast.Call) or not isinstance(body[0].exc.func, ast.Name)):
        raise Unrecognised("the vLLM version check is not a bare `raise SomeError(...)` without else")
    return node


def check_whole_lines(lines, node, what):
    """The statement must own its lines so it can be replaced line by line."""
    # ast column offsets count UTF-8 bytes.
    first, last = lines[node.lineno - 1].encode(), lines[node.end_lineno - 1].encode()
    if first[:node.col_offset].strip() or last[node.end_col_offset:].strip():
        raise Unrecognised(f"{what} shares a line with other code (line {node.lineno})")


def newline_of(lines):
    ending = lines[0][len(lines[0].rstrip("\r\n")):] if lines else ""
    return ending or "\n"


def plan_edits(source, allow):
    """Return the source lines and edits [(start, stop, new_lines)] over 0-based line slices."""
    tree = ast.parse(source)
    lines = read_lines(source)
    nl = newline_of(lines)
    function, check = find_function(tree), find_version_check(tree)

    has_docstring = is_docstring(function.body[0])
    if len(function.body) == has_docstring:
        raise Unrecognised(f"{FUNCTION}() has no body besides its docstring")
    first = function.body[has_docstring]
    previous_end = function.body[0].end_lineno if has_docstring else function.lineno
    if first.lineno <= previous_end:
        raise Unrecognised(f"{FUNCTION}() body does not start on its own line")
    check_whole_lines(lines, first, f"first statement of {FUNCTION}()")
    check_whole_lines(lines, check, "the vLLM version check")

    pinned = check.test.comparators[0].value
    helpers = HELPERS.format(marker=MARKER, end_marker=END_MARKER, pinned=pinned, allow=allow)
    top = function.decorator_list[0].lineno if function.decorator_list else function.lineno
    pad = " " * first.col_offset
    override = [f"{pad}_yue2_override = _yue2_ar_override(){LINE_TAG}: YUE2_AR_CHECKPOINT",
                f"{pad}if _yue2_override is not None:",
                f"{pad}    return _yue2_override"]
    pad = " " * check.col_offset
    error = ast.get_source_segment(source, check.body[0].exc.func)
    gate = [f"{pad}if not _yue2_vllm_allowed(vllm.__version__):{LINE_TAG}: YUE2_VLLM_ALLOW",
            f"{pad}    raise {error}(_yue2_vllm_refusal(vllm.__version__))"]

    def block(text_lines):
        return [line + nl for line in text_lines]

    return lines, [(top - 1, top - 1, block(helpers.splitlines())),
                   (first.lineno - 1, first.lineno - 1, block(override)),
                   (check.lineno - 1, check.end_lineno, block(gate))]


def patch_source(source, allow):
    lines, edits = plan_edits(source, allow)
    # Apply bottom-up so earlier line numbers stay valid.
    for start, stop, new in sorted(edits, key=lambda edit: edit[0], reverse=True):
        lines[start:stop] = new
    patched = "".join(lines)
    ast.parse(patched)  # a bug here must never leave a broken fast.py behind
    return patched


def baked_allowance(source):
    for node in ast.parse(source).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "_YUE2_VLLM_ALLOW_DEFAULT"):
            return getattr(node.value, "value", None)
    return None


def validate_spec(spec):
    entries = [entry.strip() for entry in spec.split(",")]
    bad = [entry for entry in entries if not SPEC_ENTRY.match(entry)]
    if bad:
        raise ValueError(f"--allow-vllm: invalid entries {bad}; use e.g. '0.20.1,0.21' or '0.3*'")
    return ",".join(entries)


def write_atomically(path, text):
    directory = os.path.dirname(os.path.abspath(path))
    handle, temp = tempfile.mkstemp(prefix=".fast.py.", dir=directory)
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temp, os.stat(path).st_mode & 0o7777)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


def write_backup(path, data):
    """Create PATH.orig once; an existing backup is never overwritten."""
    backup = path + ".orig"
    try:
        with open(backup, "xb") as stream:
            stream.write(data)
        return f"backup: {backup}"
    except FileExistsError:
        return f"backup kept as is: {backup} already exists"


def unified_diff(path, before, after):
    return "".join(difflib.unified_diff(read_lines(before), read_lines(after), path, path + " (patched)"))


def run(path, allow, dry_run):
    with open(path, "rb") as stream:
        data = stream.read()
    original = data.decode("utf-8")
    if MARKER in original:
        baked = baked_allowance(original)
        if allow and allow != baked:
            print(f"{path} is already patched with --allow-vllm {baked!r}; "
                  f"restore {path}.orig to patch it again with {allow!r}", file=sys.stderr)
            return 1
        print(f"{path} is already patched; nothing changed")
        return 0
    patched = patch_source(original, allow)
    if dry_run:
        sys.stdout.write(unified_diff(path, original, patched))
        print(f"dry run: {path} not changed")
        return 0
    note = write_backup(path, data)
    write_atomically(path, patched)
    print(f"patched {path} ({note})")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="upstream yue2/fast.py")
    parser.add_argument("--allow-vllm", default="", metavar="SPEC",
                        help="default for YUE2_VLLM_ALLOW baked into the file, e.g. '0.20.1,0.21' or '0.3*'")
    parser.add_argument("--dry-run", action="store_true", help="print the unified diff, change nothing")
    args = parser.parse_args(argv)
    try:
        allow = validate_spec(args.allow_vllm) if args.allow_vllm else ""
        return run(args.path, allow, args.dry_run)
    except Unrecognised as error:
        print(f"{args.path}: not a recognised upstream yue2/fast.py ({error}); nothing changed", file=sys.stderr)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as error:
        print(f"{args.path}: {error}; nothing changed", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
