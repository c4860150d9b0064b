"""Did a change move `kvvmm bench`? Put two runs of it side by side, one JSON.

`bash bench/device/h200_session.sh beforeafter` runs `kvvmm bench` at a git archive of an earlier
commit (`.before`) and at this tree, on one machine minutes apart; this script reads the two
files it leaves and writes the figures a layout change could move, each with after / before:

    python bench/device/beforeafter.py BEFORE.json AFTER.json --before-commit eea50ba \
        --after-commit "$(git rev-parse --short HEAD)" --out bench/results/h200-beforeafter.json

The ratio of two runs of one commit is the yardstick (h200-beforeafter-split.json's runs
without the pool: 1.13x on untouched code), not 1.0.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

#: (name in the summary, path in a kvvmm bench JSON)
FIGURES = (
    ("owner_ctor_ms", ("owner", "ctor_ms_median")),
    ("owner_close_ms", ("owner", "close_ms_median")),
    ("arena_ctor_ms", ("arena", "ctor_ms_median")),
    ("default_growth_ms", ("growth", 0, "grow_ms")),
    ("default_finalize_1M_ms", ("growth", 0, "finalize_1M_ms")),
    ("cudaMalloc_same_bytes_ms", ("cudaMalloc_same_bytes_ms",)),
)
TARGETS = (
    "per_call_ratio_max", "default_overcommit<=one_chunk", "elastic_blocked_ms",
    "elastic_blocked_ms_without_pool", "elastic_step_p99_us_without_pool",
    "elastic_back_to_back_over_settled", "elastic_back_to_back_over_settled_driver_time",
    "elastic_driver_ms_with_pool", "elastic_driver_ms_without_pool", "elastic_lookahead_bytes",
    "elastic_lookahead_overcommit_bytes", "elastic_lookahead_overcommit_peak_bytes",
    "elastic_noop_step_after_gap_us", "elastic_bandwidth_ratio_2MiB_granules",
)


def _at(doc: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each figure of both runs with after / before (None where before is 0)."""
    rows = [(name, _at(before, path), _at(after, path)) for name, path in FIGURES]
    rows += [(f"targets.{t}", before["targets"][t], after["targets"][t]) for t in TARGETS
             if t in before["targets"] and t in after["targets"]]
    return {name: {"before": b, "after": a,
                   "after_over_before": round(a / b, 3) if b else None}
            for name, b, a in rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--before-commit", required=True)
    ap.add_argument("--after-commit", required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    before = json.loads(a.before.read_text())
    after = json.loads(a.after.read_text())
    doc = {
        "benchmark": "kvvmm-bench-before-after",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "card": after["card"], "versions": after["versions"],
        "before_commit": a.before_commit, "after_commit": a.after_commit,
        "how": "one machine, one call: kvvmm bench at a git archive of the before commit, "
               "then at the after tree, minutes apart "
               "(bash bench/device/h200_session.sh beforeafter)",
        "summary": summary(before, after), "before": before, "after": after,
    }
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    for name, row in doc["summary"].items():
        print(f"{name:55s} {row['before']!s:>14} -> {row['after']!s:>14}  "
              f"x{row['after_over_before']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
