"""ruff and mypy --strict are clean: the style and typing bar of the package is a test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def test_ruff_finds_nothing_in_the_package_and_the_tests() -> None:
    proc = _run("ruff", "check", "--no-cache", "kvvmm", "tests")
    if proc.returncode != 0:
        pytest.fail(f"ruff check kvvmm tests:\n{proc.stdout}{proc.stderr}", pytrace=False)


@pytest.mark.heavy
def test_mypy_strict_passes_on_the_package() -> None:
    proc = _run("mypy", "--strict", "kvvmm")
    if proc.returncode != 0:
        pytest.fail(f"mypy --strict kvvmm:\n{proc.stdout}{proc.stderr}", pytrace=False)
