"""Widget panels for JupyterLab: thin wiring from ipywidgets controls to the library.

- :class:`ArenaLab`: pick a driver and device profile, reserve an arena (or a KV owner),
  allocate, commit, decommit, ensure a prefix, finalize, shrink, close; the VA map updates
  live and a log lists the driver calls each step made.
- :class:`LayoutExplorer`: model, layout, dtype, page size, TP degree and GPU -> the plan
  (:func:`kvvmm.layout.plan`): buffers, VA to reserve, capacity in tokens, granularity waste,
  and the finalized layout's VA map.
- :class:`GrowthLab`: growth policies side by side on a decode-growth workload
  (:func:`kvvmm.growth.decode_growth`): handles, driver calls, over-commit, predicted bandwidth.
- :class:`BudgetLab`: two tenants of one budget ledger (:mod:`kvvmm.budget`), each an owner
  on a ``BudgetedDriver``: grow, give back, change a limit live, shed; the ledger's table and
  chart after every step.

Every panel keeps its controls as attributes (``lab.reserve_button.click()``,
``lab.tokens.value = 512``), its top-level box as ``widget``, and displays itself. Each
action runs in one handler: library errors (bad input, a failed driver call) are shown in
the panel's ``error`` area and change nothing, because the library changes nothing when it
raises. The figure is a plain plotly figure (``figure``) drawn in an ``Output`` widget
(``plot``) and redrawn whole on each change.
"""

from __future__ import annotations

from kvvmm.lab.arena_lab import ArenaLab
from kvvmm.lab.budget_lab import BudgetLab
from kvvmm.lab.growth_lab import GrowthLab
from kvvmm.lab.layout_explorer import LayoutExplorer
from kvvmm.lab.workload_lab import WorkloadLab

__all__ = ["ArenaLab", "BudgetLab", "GrowthLab", "LayoutExplorer", "WorkloadLab"]
