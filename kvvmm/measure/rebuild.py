"""``kvvmm calibrate rebuild [--check]``: the shipped H200 profile remade from the committed
measurements.

Most of the shipped ``h200.json`` is kept as the file has it (the measured figures and the
``spread`` section). Two figures are derived from committed results and remade, in this order
(the second reads the profile the first made): the growth bandwidth
(:mod:`kvvmm.measure.growth_bandwidth`) and the share of the cold premium the second call of
a kind pays (:mod:`kvvmm.measure.coldtail`).

The results are read from the checkout's ``bench/results`` or ``--results DIR``
(:mod:`kvvmm.measure.results`). ``--check`` changes nothing and exits 1 when the shipped file
differs from the rebuild; ``--collect`` first reads the growth-bandwidth runs again from git
history (a clone with history).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvvmm.errors import KvvmmError
from kvvmm.hardware import profile_from_data
from kvvmm.measure import coldtail, growth_bandwidth
from kvvmm.measure.results import results_dir, shipped_profile_path

__all__ = ["dump", "main", "rebuild"]


def dump(data: Any) -> str:
    """JSON as the repo keeps its profiles and results (indent 1, ASCII, a final newline)."""
    return json.dumps(data, indent=1, ensure_ascii=True) + "\n"


def _read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def rebuild(shipped: Mapping[str, Any], results: Path,
            collected: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The profile ``shipped`` with its derived figures remade from ``results``.

    Args:
        shipped: the profile as the package has it (everything else is kept).
        results: the committed results folder.
        collected: the growth-bandwidth runs (default: as ``results`` has them).
    Returns:
        A new profile (``shipped`` is not changed); it loads (checked by the schema).
    Raises:
        ArgumentError: a committed run that the rebuild cannot use.
        ProfileError: the rebuilt profile breaks the schema.
    """
    data = copy.deepcopy(dict(shipped))
    if collected is None:
        collected = _read(results / growth_bandwidth.COLLECTED)
    data["bandwidth"]["growth"] = growth_bandwidth.profile_section(collected)
    data = coldtail.with_second_shares(data, results)
    profile_from_data(data, where="the rebuilt profile")  # it loads, or this raises
    return data


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvvmm calibrate rebuild``: 0 written or up to date, 1 drifted
    (``--check``), 2 an error."""
    ap = argparse.ArgumentParser(prog="kvvmm calibrate rebuild", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a shipped file differs from the rebuild")
    ap.add_argument("--results", default=None,
                    help="the committed results folder (default: the checkout's bench/results)")
    ap.add_argument("--collect", action="store_true",
                    help="first read the growth-bandwidth runs from git history again")
    args = ap.parse_args(argv)
    target = shipped_profile_path("h200")
    try:
        results = results_dir(args.results)
        wanted: dict[Path, str] = {}
        collected = growth_bandwidth.collect(results) if args.collect else None
        if collected is not None:
            wanted[results / growth_bandwidth.COLLECTED] = dump(collected)
        # everything is computed before anything is written: a failure leaves both files
        wanted[target] = dump(rebuild(_read(target), results, collected))
    except (KvvmmError, OSError, ValueError) as e:
        print(f"kvvmm calibrate rebuild: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    drift = [p for p, text in wanted.items()
             if not p.exists() or p.read_text(encoding="utf-8") != text]
    if args.check:
        for p in drift:
            print(f"{p} differs from the rebuild (kvvmm calibrate rebuild writes it)")
        if not drift:
            print("the shipped profile is what the committed results rebuild")
        return 1 if drift else 0
    for p in drift:
        p.write_text(wanted[p], encoding="utf-8")
        print(f"wrote {p}")
    if not drift:
        print("the shipped profile is what the committed results rebuild: nothing written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

