"""One transaction helper for every multi-step change of an arena.

A change that takes several driver calls pushes an undo step after each call that
succeeded. If a later call fails, :meth:`Transaction.unwind` runs the steps newest first and
attaches each undo's own failure to the original error as a note, never swallowing it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Transaction"]


class Transaction:
    """A stack of undo steps; arguments are bound when a step is pushed."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps: list[tuple[str, Callable[[], object]]] = []

    def push(self, label: str, fn: Callable[..., object], *args: Any) -> None:
        """Register the undo of a step that just succeeded: ``fn(*args)``, shown as ``label``."""
        self.steps.append((label, (lambda: fn(*args)) if args else fn))

    def unwind(self, err: BaseException) -> None:
        """Run the steps newest first; attach each one's failure to ``err`` as a note."""
        while self.steps:
            label, fn = self.steps.pop()
            try:
                fn()
            except Exception as e:  # the original error matters more; keep this one as a note
                err.add_note(f"undo {label} also failed: {e}")

    def commit(self) -> None:
        """The change is complete: drop the undo steps."""
        self.steps.clear()
