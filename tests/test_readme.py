"""README's and docs/'s commands and code are what CI and users run."""
import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPERATORS = {"&&", "||", ";", "|", "&"}

# Shown `yue2-vllm` command lines that cannot be parsed offline, each with why. Empty today: every shown command
# parses with the real parser (placeholders such as PATH/YuE2-3B or "$KEY" are plain strings to argparse).
CANNOT_PARSE_OFFLINE: dict[str, str] = {}


@pytest.mark.slow  # README's and upstream's Python calls stay in test_pipeline_upstream
def test_python_api_example_runs_as_printed(tiny_model_dir, tiny_vae_dir, tmp_path):
    from yue2_vllm.testing import TINY_VERSION

    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    (example,) = re.findall(r"```python\n(.*?)```", usage, flags=re.S)
    cache = tmp_path / "cache" / TINY_VERSION  # the tiny default, already generated (what tiny_default() makes)
    cache.mkdir(parents=True)
    (cache / "YuE2-3B-tiny").symlink_to(tiny_model_dir, target_is_directory=True)
    (cache / "YuE2-Vae-tiny").symlink_to(tiny_vae_dir, target_is_directory=True)
    result = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "YUE2_VLLM_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "48 250 (250, 64) (479936, 2)"
    assert "nar: 32/32" in result.stdout and "vae: 1/1" in result.stdout


def test_the_test_command_is_what_ci_runs_and_says_how_to_enable_export_tests():
    section = README[README.index("## Run the tests"):README.index("## Layout")]
    (command,) = re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    runs = [line for line in ci.splitlines() if "-m pytest" in line and not line.startswith("#")]
    # README's command first, then the slow tests, each printing its 25 slowest tests (and nothing else added);
    # each failure is kept and the script exits with it.
    assert runs == [f"{command} --durations=25 || status=$?", f"{command} -m slow --durations=25 || status=$?"]
    assert ci.rstrip().splitlines()[-1] == "exit $status"
    assert f"`{command} -m slow`" in section
    assert "bash calibration/setup-quant-env.sh" in section and "tests/test_quant_export.py" in section
    for step in ("entry_point_installed", "yue2-vllm doctor", "setup-quant-env.sh"):
        assert step in ci
    assert "entry point" in section and "`yue2-vllm doctor`" in section and "setup-quant-env.sh" in section
    assert "`--durations=25`" in section


# --------------------------------------------------------------------------- every shown command parses


def shown_commands(text: str) -> list[tuple[str, list[str]]]:
    """`(line, argv after yue2-vllm)` for each `yue2-vllm` command in the text's ```bash blocks: `\\` continuations
    joined, comments dropped, env assignments before it and anything after a shell operator left out."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line).strip()  # bash: '#' starts a comment only at a word's start
            words = shlex.split(line)
            for start, word in enumerate(words):
                if Path(word).name == "yue2-vllm":
                    argv = words[start + 1:]
                    ends = [i for i, w in enumerate(argv) if w in OPERATORS]
                    commands.append((" ".join(line.split()), argv[:ends[0]] if ends else argv))
    return commands


def parse_error(argv: list[str]) -> str | None:
    """What the real CLI parser says about `yue2-vllm ARGV` (as `main` parses it: `quantize` hands its flags to the
    export's parser), or None when it parses. Nothing runs: no model, engine or network."""
    from yue2_vllm.cli import build_parser
    from yue2_vllm.quant.export import add_arguments

    parser, stderr = build_parser(), io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args, extra = parser.parse_known_args(argv)
            if args.command == "quantize":
                export = argparse.ArgumentParser(prog="yue2-vllm quantize")
                add_arguments(export)
                export.parse_args(extra)
            elif extra:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:
        return stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue().strip() else f"exit {exc.code}"
    return None


ALL_SHOWN = [(page.relative_to(ROOT).as_posix(), line, argv)
             for page in PAGES for line, argv in shown_commands(page.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("page,line,argv", ALL_SHOWN, ids=[f"{page}: {line[:60]}" for page, line, _ in ALL_SHOWN])
def test_every_shown_command_parses_with_the_real_cli(page, line, argv):
    if line in CANNOT_PARSE_OFFLINE:
        pytest.skip(CANNOT_PARSE_OFFLINE[line])
    assert parse_error(argv) is None, f"{page}: {line}: {parse_error(argv)}"


def test_the_command_collection_sees_what_the_pages_show():
    lines = {line for _, line, _ in ALL_SHOWN}
    # README's main job, exactly; tests/test_cli.py's test_readme_main_command_on_embedded_default runs it for real.
    assert shown_commands(README)[0] == (".venv/bin/yue2-vllm generate", ["generate"])
    assert "def test_readme_main_command_on_embedded_default(" in (ROOT / "tests" / "test_cli.py").read_text(
        encoding="utf-8")
    assert ".venv/bin/yue2-vllm generate --model m-a-p/YuE2-3B --vae m-a-p/YuE2-Vae --style \"pop, piano, female " \
           "vocal\" --lyrics-file lyrics.txt --cot full --seed 831001 --output runs" in lines  # joined at its `\`
    assert {"serve", "quantize", "calibrate", "evaluate", "generate"} <= {argv[0] for _, _, argv in ALL_SHOWN}
    assert all(Path(word).name != "yue2-vllm" for _, _, argv in ALL_SHOWN for word in argv)
    assert set(CANNOT_PARSE_OFFLINE) <= lines, "an allow-listed line no page shows any more"
    # and the check can fail: a flag no command has, a missing required flag, quantize's own flags
    assert "unrecognized arguments: --no-such-flag" in parse_error(["generate", "--no-such-flag"])
    assert "--input" in parse_error(["batch"])
    assert "--scheme" in parse_error(["quantize", "M", "--out", "D"])


# --------------------------------------------------------------------------- links between the pages


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[page.name if page.parent == ROOT else f"docs/{page.name}"
                                             for page in PAGES])
def test_relative_links_and_images_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target}"
        if anchor:
            assert anchor in heading_anchors(file.read_text(encoding="utf-8")), f"{page.name}: {target}"
