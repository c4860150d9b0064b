"""The packaging files agree with each other and with the README's two commands."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import yaml  # PyYAML comes with jupyterlab (jupyter-events needs it)

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _requirement_key(req: str) -> tuple[str, str]:
    """Split ``"Foo_Bar >= 1.2"`` into a normalized name and specifier: ``("foo-bar", ">=1.2")``."""
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*", req)
    assert m, f"cannot read requirement {req!r}"
    name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
    return name, m.group(3).replace(" ", "")


def _environment_yml() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    assert isinstance(data, dict), "environment.yml is not a mapping"
    return data


def _command_lines(path: Path) -> list[str]:
    """The shell lines of a script, comments removed."""
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip() if not raw.lstrip().startswith("#!") else ""
        if line:
            lines.append(line)
    return lines


def test_environment_yml_pip_list_matches_pyproject_dependencies() -> None:
    deps = _pyproject()["project"]["dependencies"]
    env = _environment_yml()
    pip_lists = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip_lists) == 1, "environment.yml should have exactly one pip: section"
    # `-e .` and other pip options install the project itself; they are not requirements.
    env_reqs = [r for r in pip_lists[0] if not str(r).startswith("-")]
    assert dict(map(_requirement_key, env_reqs)) == dict(map(_requirement_key, deps)), (
        "environment.yml's pip list and pyproject.toml's [project].dependencies differ:\n"
        f"  environment.yml: {sorted(env_reqs)}\n  pyproject.toml:  {sorted(deps)}"
    )


def test_environment_yml_names_the_env_and_its_python_meets_requires_python() -> None:
    env = _environment_yml()
    assert env["name"] == "kvvmm"
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    assert "pip" in conda
    pythons = [d for d in conda if d.startswith("python")]
    assert pythons == ["python=3.11"], pythons
    assert _pyproject()["project"]["requires-python"] == ">=3.11"


def test_readme_names_make_lab_and_make_test() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make lab" in readme
    assert "make test" in readme


def test_ci_runs_the_readme_test_command() -> None:
    ci = ROOT / ".ci" / "run"
    assert ci.stat().st_mode & 0o111, ".ci/run is not executable"
    lines = _command_lines(ci)
    assert "set -euo pipefail" in lines
    assert any(shlex.split(line) == ["make", "test"] for line in lines), (
        ".ci/run must run `make test`, the README's test command"
    )


def test_constraints_pin_the_cpu_torch_build() -> None:
    pins = {
        _requirement_key(line)[0]: _requirement_key(line)[1]
        for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    }
    assert pins.get("torch") == "==2.13.0", pins


def test_make_venv_installs_the_test_extra_under_the_constraints() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"pip install .*-c constraints\.txt .*-e '\.\[test\]'", makefile), (
        "make venv should run pip install -c constraints.txt -e '.[test]'"
    )


def test_pyproject_declares_the_cli_the_typed_marker_and_the_model_configs() -> None:
    project = _pyproject()
    assert project["project"]["name"] == "kvvmm"
    assert project["project"]["scripts"] == {"kvvmm": "kvvmm.cli:main"}
    package_data = project["tool"]["setuptools"]["package-data"]["kvvmm"]
    assert {"py.typed", "layout/models/*.json", "hardware/data/*.json"} <= set(package_data)
    assert (ROOT / "kvvmm" / "py.typed").is_file()


def test_pytest_markers_are_declared() -> None:
    pytest_cfg = _pyproject()["tool"]["pytest"]["ini_options"]
    declared = {m.split(":", 1)[0] for m in pytest_cfg["markers"]}
    assert {"cuda", "browser", "heavy"} <= declared
    assert "--strict-markers" in pytest_cfg["addopts"]


_LAB_ONLY = ("jupyterlab", "notebook", "ipywidgets", "plotly", "nbval", "anywidget", "jupytext",
             "kaleido", "nbclient", "nbformat", "ipykernel", "playwright")


def test_a_plain_install_pulls_no_jupyter_plotly_or_test_package() -> None:
    names = {_requirement_key(r)[0] for r in _pyproject()["project"]["dependencies"]}
    assert not names & set(_LAB_ONLY), sorted(names & set(_LAB_ONLY))
    assert "torch" not in names  # an engine brings its own torch build


def test_the_lab_extra_brings_jupyterlab_widgets_plotly_and_the_test_extra_the_lab() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    lab = {_requirement_key(r)[0] for r in extras["lab"]}
    assert {"jupyterlab", "ipywidgets", "plotly", "jupytext"} <= lab
    assert any(r.replace(" ", "") == "kvvmm[torch,lab]" for r in extras["test"])
    assert {_requirement_key(r)[0] for r in extras["torch"]} == {"torch"}


def test_environment_yml_installs_the_project_with_the_lab_and_torch() -> None:
    env = _environment_yml()
    pip_list = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "-e .[torch,lab]" in pip_list
