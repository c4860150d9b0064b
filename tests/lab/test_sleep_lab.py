"""ArenaLab's Sleep and Wake, without a browser (``.click()``, trait values).

For a KV owner and a bare arena, each backup choice: a sleep gives every byte back and the
map and summary say asleep (what a wake backs, at the same VA); a wake draws the same map as
before the sleep; host memory keeps the bytes on the host driver; a refused call (a second
sleep, a wake while awake, a commit while asleep) shows its error and changes nothing; close
works asleep.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from kvvmm.lab import ArenaLab
from kvvmm.units import MiB


def _kv(lab: ArenaLab, tokens: int = 4096) -> None:
    lab.reserve_kv_button.click()
    lab.tokens.value = tokens
    lab.finalize_button.click()
    assert lab.error_text == ""


@pytest.mark.parametrize("backup", ["none", "host", "disk"])
def test_sleep_gives_every_byte_back_draws_asleep_and_wake_draws_the_same_map(
        backup: str) -> None:
    lab = ArenaLab(layers=2, reserved_tokens=8192)
    _kv(lab)
    figure, backed = lab.figure.to_json(), lab.owner.backed_bytes  # type: ignore[union-attr]
    lab.backup.value = backup
    lab.sleep_button.click()
    assert lab.error_text == ""
    assert lab.owner is not None and lab.owner.asleep and lab.owner.backed_bytes == 0
    assert "asleep" in lab.summary.value and "asleep" in lab.figure.layout.title.text
    assert "gave back" in lab.sleep_status.value
    assert ("kept in" in lab.sleep_status.value) == (backup != "none")
    lab.wake_button.click()
    assert lab.error_text == "" and not lab.owner.asleep
    assert lab.owner.backed_bytes == backed and lab.figure.to_json() == figure
    assert "wake: backed" in lab.sleep_status.value
    lab.close_button.click()


def test_a_bare_arena_sleeps_and_wakes_too() -> None:
    lab = ArenaLab()
    lab.reserve_button.click()
    lab.allocate_button.click()
    lab.commit_mib.value = 8
    lab.commit_button.click()
    lab.sleep_button.click()
    assert lab.error_text == "" and lab.arena is not None and lab.arena.asleep
    lab.wake_button.click()
    assert lab.arena.snapshot().backed_bytes == 8 * MiB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the host driver needs Linux")
def test_a_host_backup_keeps_the_kv_bytes_on_the_host_driver() -> None:
    lab = ArenaLab(driver="host", layers=1, reserved_tokens=2048)
    _kv(lab, 1024)
    assert lab.owner is not None
    lab.owner.tensors[0][:1024] = 3.0
    lab.backup.value = "host"
    lab.sleep_button.click()
    lab.wake_button.click()
    assert bool((lab.owner.tensors[0][:1024] == 3.0).all())
    lab.close_button.click()


def test_refused_calls_show_their_error_and_change_nothing() -> None:
    lab = ArenaLab(layers=2, reserved_tokens=8192)
    lab.wake_button.click()
    assert "Reserve" in lab.error_text  # nothing to wake yet
    _kv(lab)
    lab.wake_button.click()
    assert lab.error_text.startswith("SleepRefusedError") and "awake" in lab.error_text
    lab.sleep_button.click()
    asleep = lab.snapshot()
    for button in (lab.sleep_button, lab.finalize_button, lab.shrink_button):
        button.click()
        assert lab.error_text.split(":")[0] in ("SleepRefusedError", "AsleepError")
        assert lab.snapshot() == asleep
    lab.wake_button.click()
    assert lab.error_text == ""


def test_close_while_asleep_gives_everything_back_and_leaves_no_backup_file() -> None:
    lab = ArenaLab(layers=1, reserved_tokens=4096)
    _kv(lab, 2048)
    lab.backup.value = "disk"
    lab.sleep_button.click()
    assert lab.error_text == "" and lab._disk_dir is not None
    assert len(os.listdir(lab._disk_dir)) == 1  # the backup's file, while asleep
    lab.close_button.click()
    assert lab.error_text == "" and lab.owner is None
    assert os.listdir(lab._disk_dir) == []
