"""The lab's working folder: copies of the tracked notebooks, made once, never overwritten.

JupyterLab's autosave rewrote the tracked ``03_growth.ipynb``; the lab now
opens copies in an ignored folder that :func:`kvvmm.cli.workspace.prepare_workspace` fills.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvvmm.cli.workspace import WORK_DIR_NAME, prepare_workspace

ROOT = Path(__file__).resolve().parents[2]


def _notebooks(tmp_path: Path) -> Path:
    nb = tmp_path / "notebooks"
    (nb / "src").mkdir(parents=True)
    for name in ("01_tour", "02_layouts"):
        (nb / f"{name}.ipynb").write_text(f'{{"tracked": "{name}"}}', encoding="utf-8")
    (nb / "build.py").write_text("# not a notebook", encoding="utf-8")
    return nb


def test_the_first_launch_copies_every_notebook_into_the_work_folder(tmp_path: Path) -> None:
    nb = _notebooks(tmp_path)
    work = prepare_workspace(nb)
    assert work == nb / WORK_DIR_NAME
    assert sorted(p.name for p in work.iterdir()) == ["01_tour.ipynb", "02_layouts.ipynb"]
    assert (work / "01_tour.ipynb").read_text() == (nb / "01_tour.ipynb").read_text()


def test_a_users_edited_copy_is_kept_when_the_lab_starts_again(tmp_path: Path) -> None:
    nb = _notebooks(tmp_path)
    work = prepare_workspace(nb)
    (work / "01_tour.ipynb").write_text("my edits", encoding="utf-8")
    (nb / "01_tour.ipynb").write_text("a newer tracked version", encoding="utf-8")
    prepare_workspace(nb)
    assert (work / "01_tour.ipynb").read_text() == "my edits"


def test_a_deleted_copy_comes_back_as_the_tracked_version(tmp_path: Path) -> None:
    nb = _notebooks(tmp_path)
    work = prepare_workspace(nb)
    (work / "02_layouts.ipynb").unlink()
    prepare_workspace(nb)
    assert (work / "02_layouts.ipynb").read_text() == '{"tracked": "02_layouts"}'


def test_a_notebook_added_later_is_copied_and_the_others_are_left_alone(
        tmp_path: Path) -> None:
    nb = _notebooks(tmp_path)
    work = prepare_workspace(nb)
    (work / "01_tour.ipynb").write_text("my edits", encoding="utf-8")
    (nb / "03_growth.ipynb").write_text("new", encoding="utf-8")
    prepare_workspace(nb)
    assert (work / "03_growth.ipynb").read_text() == "new"
    assert (work / "01_tour.ipynb").read_text() == "my edits"


def test_an_explicit_work_folder_is_made_and_used(tmp_path: Path) -> None:
    nb = _notebooks(tmp_path)
    work = prepare_workspace(nb, tmp_path / "lab-work" / "deep")
    assert work == tmp_path / "lab-work" / "deep"
    assert (work / "01_tour.ipynb").exists()


def test_the_notebooks_folder_itself_is_refused_as_the_work_folder(tmp_path: Path) -> None:
    nb = _notebooks(tmp_path)
    with pytest.raises(ValueError, match="tracked notebooks"):
        prepare_workspace(nb, nb)


def test_a_folder_without_notebooks_is_refused_with_its_name(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no notebook"):
        prepare_workspace(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        prepare_workspace(tmp_path / "missing")


def test_git_ignores_the_default_work_folder() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    probe = f"notebooks/{WORK_DIR_NAME}/01_tour.ipynb"
    done = subprocess.run(["git", "check-ignore", "-q", "--no-index", probe], cwd=ROOT,
                          check=False)
    assert done.returncode == 0, f"{probe} is not ignored: add it to .gitignore"
