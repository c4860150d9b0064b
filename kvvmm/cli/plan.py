"""``kvvmm plan``: the capacity plan of a model on a GPU, as a table or JSON."""

from __future__ import annotations

import argparse
import json

from kvvmm.cli.common import profile_line
from kvvmm.hardware import profile_summary


def _cmd_plan(args: argparse.Namespace) -> int:
    from kvvmm.layout import plan
    from kvvmm.viz import format_plan

    p = plan(gpu=args.gpu, model=args.model, dtype=args.dtype, page_size=args.page_size,
             tp=args.tp, budget_bytes=args.budget_bytes, headroom_bytes=args.headroom_bytes,
             free_bytes=args.free_bytes, layout=args.layout,
             reserved_tokens=args.reserved_tokens, count_overhead=args.count_overhead,
             mem_fraction_static=args.mem_fraction_static, weights_dtype=args.weights_dtype,
             max_total_tokens=args.max_total_tokens)
    used = profile_summary(args.gpu)
    if args.json:
        print(json.dumps({**p.to_dict(), "profile": used}, indent=2))
    else:
        print(profile_line(used))
        print(format_plan(p))
    return 0
