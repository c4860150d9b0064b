"""``kvvmm budget show | set TENANT BYTES | init BYTES``: show the GPU's ledger, change a
tenant's limit or the budget, live. What the file holds is untrusted: names are printed
escaped.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvvmm.budget.ledger import LOCK_TIMEOUT_S, BudgetSnapshot, Ledger, default_path
from kvvmm.units import fmt_bytes

__all__ = ["add_budget_parser", "budget_command", "format_snapshot", "printable"]


def add_budget_parser(sub: Any) -> None:
    """Add ``budget`` to the ``kvvmm`` command's subparsers."""
    from kvvmm.cli.common import number_type, parse_bytes, path_type, size_type

    bp = sub.add_parser("budget", help="show or change the per-GPU budget ledger, live",
                        description="The budget broker's ledger (docs/BUDGET.md): show it, "
                                    "set a tenant's limit, set the GPU's budget.")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--ledger", type=path_type, default=None,
                       help="the ledger file (default /dev/shm/kvvmm-budget-KEY)")
    where.add_argument("--key", default="gpu0",
                       help="the GPU's key in the default path (gpu0; a UUID where "
                            "processes see the card under different ordinals)")
    where.add_argument("--group", default=None,
                       help="a group whose members share the ledger (created 0660 in it); "
                            "default: only this user's file")
    where.add_argument("--lock-timeout", type=float, default=LOCK_TIMEOUT_S,
                       help=f"seconds to wait for the ledger's lock ({LOCK_TIMEOUT_S:g})")
    ops = bp.add_subparsers(dest="budget_cmd", required=True, metavar="ACTION")
    show = ops.add_parser("show", parents=[where], help="the budget and every tenant")
    show.add_argument("--json", action="store_true", help="print the ledger as JSON")
    st = ops.add_parser("set", parents=[where], help="change a tenant's limit, live")
    st.add_argument("tenant", help="the tenant's name")
    st.add_argument("bytes", type=parse_bytes, help="its new limit (bytes, or 40GiB)")
    st.add_argument("--shed-wait", type=number_type(0, 3600, "seconds"), default=1.0,
                    help="seconds a tenant over its new limit is asked to shed within")
    ini = ops.add_parser("init", parents=[where], help="create the ledger or set the budget")
    ini.add_argument("bytes", type=size_type(lo=1), help="the GPU's budget (bytes, or 120GiB)")
    ini.add_argument("--shed-wait", type=number_type(0, 3600, "seconds"), default=1.0,
                     help="seconds tenants over a lowered budget are asked to shed within")


def _path(args: argparse.Namespace) -> Path:
    return Path(args.ledger) if args.ledger else default_path(args.key)


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (newlines, escapes, controls,
    bidirectional overrides) and the backslash written as Python escapes: what the ledger
    file says is untrusted, and one tenant's name must not rewrite the screen."""
    return "".join(c if c.isprintable() and c != "\\"
                   else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def format_snapshot(snap: BudgetSnapshot) -> str:
    """The ledger as a table: one line per tenant, then the totals (names escaped)."""
    lines = [f"ledger {printable(snap.path)}: budget {fmt_bytes(snap.budget_bytes)}, "
             f"{fmt_bytes(snap.backed_bytes)} backed, {fmt_bytes(snap.free_bytes)} free, "
             f"{len(snap.tenants)} tenant(s)"]
    if snap.tenants:
        lines.append(f"  {'tenant':<24} {'pid':>8} {'backed':>12} {'limit':>12} {'shed':>12}")
    for t in snap.tenants:
        shed = f"{fmt_bytes(t.shed_bytes)} ({t.shed_left_s:.1f} s)" if t.shed_bytes else "-"
        lines.append(f"  {printable(t.name):<24} {t.pid:>8} {fmt_bytes(t.backed_bytes):>12} "
                     f"{fmt_bytes(t.limit_bytes):>12} {shed:>12}"
                     + ("" if t.alive else "  (gone)"))
    return "\n".join(lines)


def budget_command(args: argparse.Namespace) -> int:
    """Run ``kvvmm budget ACTION``; errors reach ``kvvmm.cli.main`` (one line, exit 2)."""
    path = _path(args)
    opts: dict[str, Any] = {"group": args.group, "lock_timeout_s": args.lock_timeout}
    shown = printable(str(path))
    if args.budget_cmd == "init":
        try:
            os.lstat(path)  # a link counts as there: Ledger refuses it rather than follow it
        except FileNotFoundError:
            with Ledger(path, budget_bytes=args.bytes, **opts):
                print(f"ledger {shown}: created with budget {fmt_bytes(args.bytes)}")
            return 0
        with Ledger(path, **opts) as ledger:
            old = ledger.set_budget(args.bytes, shed_wait_s=args.shed_wait)
            print(f"ledger {shown}: budget {fmt_bytes(old)} -> {fmt_bytes(args.bytes)}")
        return 0
    with Ledger(path, **opts) as ledger:
        if args.budget_cmd == "set":
            old = ledger.set_limit(args.tenant, args.bytes, shed_wait_s=args.shed_wait)
            print(f"tenant {args.tenant!r}: limit {fmt_bytes(old)} -> {fmt_bytes(args.bytes)}")
            return 0
        snap = ledger.snapshot()
        if args.json:
            print(json.dumps({**asdict(snap), "backed_bytes": snap.backed_bytes,
                              "free_bytes": snap.free_bytes}, indent=2))
        else:
            print(format_snapshot(snap))
        return 0
