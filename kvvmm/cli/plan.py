"""``kvvmm plan``: the capacity plan of a model on a GPU, as a table or JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from kvvmm.cli.common import profile_line
from kvvmm.hardware import profile_summary


def _cmd_plan(args: argparse.Namespace) -> int:
    from kvvmm.layout import PlanOptions, plan
    from kvvmm.viz import format_plan

    # The parser names its options as PlanOptions' fields: take those it has.
    given = {f.name: getattr(args, f.name) for f in fields(PlanOptions) if hasattr(args, f.name)}
    p = plan(gpu=args.gpu, model=args.model, **given)
    used = profile_summary(args.gpu)
    if args.json:
        print(json.dumps({**p.to_dict(), "profile": used}, indent=2))
    else:
        print(profile_line(used))
        print(format_plan(p))
    return 0
