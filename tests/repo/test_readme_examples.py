"""The README is an entry point: short, and every example in it runs as written without a GPU.

Each ```python block runs in a fresh interpreter, and each ```sh block's lines run as a shell
would (the `kvvmm` command as ``python -m kvvmm`` of this checkout), in one temporary folder per
block, in the README's order (so a command can read a file the Python before it wrote). Only
the lines of :data:`SKIP` are left out, each for the reason it gives.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 150

#: Lines of the README's sh blocks that are not run here, and why (a prefix of the command).
SKIP = {
    "make lab": "starts a JupyterLab server that does not return",
    "make test": "runs the whole suite, this test included",
    "sudo apt-get": "installs system packages (needs root and a network)",
}

_BLOCK = re.compile(r"^```(python|sh)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[str, str]]:
    """``(language, code)`` of every python and sh block of the README, in order."""
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(README.read_text("utf-8"))]


def _skipped(line: str) -> bool:
    return any(line.startswith(prefix) for prefix in SKIP)


def _commands(code: str) -> list[str]:
    """An sh block's commands, comments and skipped lines out, ``kvvmm`` as this checkout's."""
    run = []
    for raw in code.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#") or _skipped(line):
            continue
        words = shlex.split(line)
        assert words[0] == "kvvmm", f"README sh line neither kvvmm nor in SKIP: {raw!r}"
        run.append(shlex.join([sys.executable, "-m", "kvvmm", *words[1:]]))
    return run


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["CUDA_VISIBLE_DEVICES"] = ""  # as written for a machine without a GPU
    env.pop("KVVMM_DRIVER", None)
    return env


def test_the_readme_is_at_most_150_lines() -> None:
    n = len(README.read_text("utf-8").splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; it is an entry point (at most {MAX_LINES})"


def test_the_readme_has_a_python_example_and_a_kvvmm_command_to_run() -> None:
    blocks = _blocks()
    assert any(lang == "python" for lang, _ in blocks)
    assert any(_commands(code) for lang, code in blocks if lang == "sh")


def test_every_sh_line_the_readme_shows_is_run_or_skipped_for_a_stated_reason() -> None:
    shown = [line.strip() for lang, code in _blocks() if lang == "sh"
             for line in code.splitlines() if line.strip()]
    for prefix in SKIP:
        assert any(line.startswith(prefix) for line in shown), f"SKIP names {prefix!r}, unused"


def test_the_readme_examples_run_as_written_without_a_gpu(tmp_path: Path) -> None:
    env = _env()
    for i, (lang, code) in enumerate(_blocks()):
        if lang == "python":
            runs = [[sys.executable, "-c", code]]
        else:
            runs = [["/bin/sh", "-c", cmd] for cmd in _commands(code)]
        for argv in runs:
            done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=120)
            if done.returncode:
                pytest.fail(f"README block {i} ({lang}) failed ({done.returncode}):\n"
                            f"{argv[-1]}\n--- stderr:\n{done.stderr[-3000:]}", pytrace=False)
    assert (tmp_path / "run.json").is_file() and (tmp_path / "map.html").is_file()
