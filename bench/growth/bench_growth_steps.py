"""Benchmark (not a test): decode growth step by step, the per-layer and the interleaved layout.

    python bench/growth/bench_growth_steps.py [--driver cuda] [--rounds 3] [--gap both]
                                       [--out h200-growth-steps.json]

The decode growth ``kvvmm bench`` times in its ``elastic_growth`` section (llama-3.1-8b-like:
32 layers, 8 KV heads of 128, bf16; ``ensure_prefix`` every 20 ms, 4,096 tokens a step, 122
steps to 500,000 tokens), on two layouts of the same bytes:

- ``token_major``: K and V per layer, 64 buffers (the section's own workload);
- ``interleaved``: one buffer of every layer (:func:`kvvmm.layout.layer_interleaved`), a
  step grows it by 64 x as many bytes, so its look-ahead is 64 x the per-buffer one (the same
  four steps ahead).

Each without and with the handle pool's look-ahead, settled and back to back, medians of
``--rounds`` (:func:`kvvmm.measure.bench.elastic_growth`, the sweep of other look-aheads left out).
What a step blocks for is wall time on the calling thread; the no-op step after a gap is
``ensure_prefix`` with nothing to back, and beside it an empty function's call after the same
gap (what the host charges any call then).

The gap between steps (``--gap``): ``sleep`` (``time.sleep``: the decode thread's CPU idles,
the pessimistic case the targets were first judged on) and, on CUDA, ``kernel``
(:func:`kvvmm.measure.elastic.kernel_gap`: a kernel keeps the GPU busy for the gap and the
host waits in a synchronize, as an engine's decode thread does); ``both`` (the default on
CUDA) runs each. One JSON with the card, versions and date: ``gaps`` holds each gap's
layouts, ``layouts`` the sleep gap's (as before).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvvmm.driver import DRIVER_KINDS, open_driver  # noqa: E402
from kvvmm.measure.elastic import (  # noqa: E402
    LOOKAHEAD_BYTES,
    STEP_TARGET_US,
    elastic_growth,
    kernel_gap,
)
from kvvmm.measure.workload import BENCH_WORKLOAD, Workload  # noqa: E402
from kvvmm.units import MiB  # noqa: E402

#: the growth targets of the elastic-serving issue for this benchmark
BLOCKED_TARGET_MS = 10.0


def _card(kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {"driver": kind, "python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        if kind == "cuda" and torch.cuda.is_available():
            out["card"] = torch.cuda.get_device_name(0)
            out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out


def run(kind: str, rounds: int, gap: Any = None, *, base: Workload = BENCH_WORKLOAD,
        lookahead_bytes: int = LOOKAHEAD_BYTES, **options: Any) -> dict[str, Any]:
    """Each layout's growth (``base`` with that layout) on a fresh driver of ``kind``;
    ``options`` go to :func:`~kvvmm.measure.elastic.elastic_growth` (``gap_s``, ...)."""
    layouts: dict[str, Any] = {}
    for layout in ("token_major", "interleaved"):
        w = dataclasses.replace(base, layout=layout)
        la = lookahead_bytes * (2 * w.layers if layout == "interleaved" else 1)
        t0 = time.perf_counter()
        res = elastic_growth(open_driver(kind), w, lookahead_bytes=la, sweep=(la,),
                             rounds=rounds, gap=gap, **options)
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        pooled = res["with_pool"]["settled"]
        res["targets"] = {
            f"blocked_ms<={BLOCKED_TARGET_MS:g}":
                pooled["blocked_ms_median"] <= BLOCKED_TARGET_MS,
            f"step_p99_us<={STEP_TARGET_US:g}": pooled["step_p99_us_median"] <= STEP_TARGET_US,
            "noop_step_after_gap_us<=5": pooled["noop_step_after_gap_us_median"] <= 5.0}
        layouts[layout] = res
        gap_kind = "sleep" if gap is None else "kernel"
        print(f"{layout:12s} {gap_kind} gap, with pool: blocked "
              f"{pooled['blocked_ms_median']:.3f} ms, step p50 "
              f"{pooled['step_p50_us_median']:.1f} us, p99 {pooled['step_p99_us_median']:.1f} us"
              f" (worst round {pooled['step_p99_us_max']:.1f}), no-op after a gap "
              f"{pooled['noop_step_after_gap_us_median']:.1f} us (an empty call "
              f"{pooled['empty_call_after_gap_us_median']:.1f}); without: blocked "
              f"{res['without_pool']['settled']['blocked_ms_median']:.3f} ms", flush=True)
    return layouts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--driver", default="cuda", choices=DRIVER_KINDS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap", choices=("sleep", "kernel", "both"), default=None,
                    help="the gap between steps (default: both on cuda, sleep elsewhere)")
    ap.add_argument("--grow-to", type=int, default=BENCH_WORKLOAD.grow_to_tokens,
                    help="tokens the growth ends at (default %(default)s: 122 steps; a card "
                         "with less than ~80 GiB free needs fewer)")
    ap.add_argument("--out", default="h200-growth-steps.json")
    ap.add_argument("--smoke", action="store_true",
                    help="one round of a small growth (2 layers, 16 steps of 512 tokens, a 1 ms "
                         "gap, a 2 MiB look-ahead): a check that it runs, on any driver")
    args = ap.parse_args(argv)
    step = BENCH_WORKLOAD.step_tokens
    if not step <= args.grow_to <= BENCH_WORKLOAD.reserved_tokens:
        print(f"bench_growth_steps: --grow-to must be in [{step}, "
              f"{BENCH_WORKLOAD.reserved_tokens}] tokens, got {args.grow_to}", file=sys.stderr)
        return 2
    base = dataclasses.replace(BENCH_WORKLOAD, grow_to_tokens=args.grow_to)
    gaps = args.gap or ("both" if args.driver == "cuda" else "sleep")
    if gaps != "sleep" and args.driver != "cuda":
        print(f"bench_growth_steps: --gap {gaps} needs --driver cuda (a kernel makes the gap), "
              f"got --driver {args.driver}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"bench_growth_steps: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    if args.smoke:
        small = Workload(layers=2, kv_heads=1, head_dim=128, page_size=16,
                         reserved_tokens=40_000, step_tokens=512, grow_to_tokens=8_192,
                         finalize_tokens=20_000)
        got = run(args.driver, 1, base=small, lookahead_bytes=2 * MiB, gap_s=0.001,
                  settle_s=0)
        Path(args.out).write_text(json.dumps(got, indent=1) + "\n", encoding="utf-8")
        return 0
    out = {"benchmark": "growth-steps", **_card(args.driver),
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "rounds": args.rounds, "gaps": {}}
    if gaps in ("sleep", "both"):
        out["gaps"]["sleep"] = run(args.driver, args.rounds, base=base)
    if gaps in ("kernel", "both"):
        gap = kernel_gap()
        out["kernel_gap_cycles_per_s"] = round(gap.cycles_per_s)  # type: ignore[attr-defined]
        out["gaps"]["kernel"] = run(args.driver, args.rounds, gap, base=base)
    out["layouts"] = out["gaps"].get("sleep") or out["gaps"]["kernel"]
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
