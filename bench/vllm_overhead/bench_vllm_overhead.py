"""Per-call cost of vLLM's VmmDriver calls: vLLM's own ctypes CudaVmmDriver against kvvmm's.

vLLM 0.34 makes every VMM call of its growable KV cache through one ``VmmDriver``. This
times each of its calls (reserve, create, map, set_access, unmap, release, free_reserved)
one cycle at a time, for a few sizes, through (a) vLLM's own ``CudaVmmDriver`` (loaded from
vLLM's file by ``tests/vllm_files.py``, as the conformance tests load it) and (b)
``kvvmm.integrations.vllm.KvvmmVmmDriver`` over kvvmm's ``CudaDriver``, alternating which
goes first every round, and writes per call and size the median and p99 of each and their
ratio (kvvmm over vLLM; the target is within 1.1x) to ``--out``.

Without a GPU (``--driver host``, or ``auto`` on a machine without one) (a) is skipped and
(b) runs over kvvmm's host driver: the figures then say nothing of CUDA, but the script's
every step runs. Two modes isolate the adapter's own Python on any machine: against
``direct``, vLLM's calls passed straight to a kvvmm driver (no records, no checks of the
adapter's own), ``--driver host-pair`` puts one host driver under each and ``--driver null``
one :class:`NullDriver` (every call returns at once): the ``overhead_us`` per call is then
the adapter's own cost.

    PYTHONPATH=$PWD KVVMM_VLLM_DIR=../shared/reference/vllm-0.34.0 \\
        python bench/vllm_overhead/bench_vllm_overhead.py \\
        --out bench/results/h100-vllm-overhead.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import importlib.util
import itertools
import json
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import kvvmm
from kvvmm.driver.base import Driver, DriverStats, MemoryKind
from kvvmm.integrations.vllm import KvvmmVmmDriver
from kvvmm.measure.machine import cpu_model, load_average, versions
from kvvmm.measure.stats import percentile

ROOT = Path(__file__).resolve().parents[2]
#: The calls one cycle makes, in its order.
CALLS = ("reserve", "create", "map", "set_access", "unmap", "release", "free_reserved")
MiB = 1 << 20
TARGET = 1.1


def load_vllm_files() -> types.ModuleType:
    """``tests/vllm_files.py``, the loader of vLLM's files the tests use (not a package
    module: vLLM's files are test and benchmark inputs only)."""
    spec = importlib.util.spec_from_file_location("kvvmm_bench_vllm_files",
                                                  ROOT / "tests" / "vllm_files.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class NullDriver(Driver):
    """A kvvmm driver whose every call returns at once (a new VA per reserve, a new handle
    per create, nothing checked or kept): under the adapter, what is left is the adapter's
    own cost. A measuring instrument, not a driver to use."""

    kind, device, name, memory = "host", 0, "null", MemoryKind.HOST

    def __init__(self, granularity: int = 2 * MiB) -> None:
        self._gran = granularity
        self._vas = itertools.count(1 << 40, 1 << 34)
        self._ids = itertools.count(1)

    def granularity(self) -> int:
        return self._gran

    def reserve(self, size: int, align: int = 0) -> int:
        return next(self._vas)

    def free(self, va: int, size: int) -> None:
        return None

    def create(self, size: int) -> int:
        return next(self._ids)

    def release(self, handle: int) -> None:
        return None

    def map(self, va: int, size: int, handle: int) -> None:
        return None

    def unmap(self, va: int, size: int) -> None:
        return None

    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        return None

    def mem_info(self) -> tuple[int, int]:
        return (0, 0)

    def stats(self) -> DriverStats:
        return DriverStats(0, 0, 0, 0, 0, 0)

    def export_handle(self, handle: int) -> int:
        raise NotImplementedError("the null driver exports nothing")

    def import_handle(self, fd: int, size: int) -> int:
        raise NotImplementedError("the null driver imports nothing")


class DirectVmm:
    """vLLM's ``VmmDriver`` calls passed straight to a kvvmm driver: the floor the adapter
    is measured against (none of its records, ids, locks or checks)."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    def granularity(self, device_index: int) -> int:
        return self.driver.granularity()

    def reserve(self, size: int) -> int:
        return self.driver.reserve(size, 0)

    def free_reserved(self, ptr: int, size: int) -> None:
        self.driver.free(ptr, size)

    def create(self, size: int, device_index: int, export_handle_types: int = 0) -> int:
        return self.driver.create(size)

    def map(self, ptr: int, size: int, handle: int) -> None:
        self.driver.map(ptr, size, handle)

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        self.driver.set_access(ptr, size)

    def unmap(self, ptr: int, size: int) -> None:
        self.driver.unmap(ptr, size)

    def release(self, handle: int) -> None:
        self.driver.release(handle)


def cycle(drv: Any, size: int, device: int, out: dict[str, list[int]]) -> None:
    """One reserve .. free_reserved of ``size`` bytes through ``drv``; ns per call appended."""
    clock = time.perf_counter_ns
    t0 = clock()
    va = drv.reserve(size)
    t1 = clock()
    handle = drv.create(size, device)
    t2 = clock()
    drv.map(va, size, handle)
    t3 = clock()
    drv.set_access(va, size, device)
    t4 = clock()
    drv.unmap(va, size)
    t5 = clock()
    drv.release(handle)
    t6 = clock()
    drv.free_reserved(va, size)
    t7 = clock()
    for name, a, b in zip(CALLS, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7),
                          strict=True):
        out[name].append(b - a)


def summarize(ns: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Per call: median and p99 in microseconds."""
    return {c: {"median_us": round(percentile(v, 0.5) / 1e3, 3),
                "p99_us": round(percentile(v, 0.99) / 1e3, 3)} for c, v in ns.items()}


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


@contextmanager
def drivers(kind: str, device: int) -> Iterator[tuple[dict[str, Any], str, dict[str, str]]]:
    """The drivers to time (name -> VmmDriver), the card, and why any was skipped."""
    skipped: dict[str, str] = {}
    with ExitStack() as stack:
        if kind == "auto":
            kind = "cuda" if _gpu() else "host"
        if kind == "cuda":
            files = load_vllm_files()
            missing = files.missing_files(files.VLLM_DIR)
            if missing:
                raise SystemExit(f"vLLM 0.34's files are not at {files.VLLM_DIR} (missing "
                                 f"{missing}): set KVVMM_VLLM_DIR")
            v = stack.enter_context(files.vllm_loaded(files.VLLM_DIR))
            theirs = v.vmm_driver.CudaVmmDriver()
            theirs.ensure_context(device)
            inner = kvvmm.open_driver("cuda", device=device)
            stack.callback(inner.close)
            ours = KvvmmVmmDriver(inner)
            ours.ensure_context(device)
            yield {"vllm": theirs, "kvvmm": ours}, _card(device), skipped
            return
        if kind == "host-pair":  # one host driver under each: bare, and under the adapter
            pair: dict[str, Any] = {}
            for name in ("direct", "kvvmm"):
                inner = kvvmm.open_driver("host", capacity_bytes=512 << 20)
                stack.callback(inner.close)
                pair[name] = DirectVmm(inner) if name == "direct" else KvvmmVmmDriver(inner)
            yield pair, "host-pair", skipped
            return
        if kind == "null":  # the adapter's own cost: nothing under it takes any time
            yield ({"direct": DirectVmm(NullDriver()), "kvvmm": KvvmmVmmDriver(NullDriver())},
                   "null", skipped)
            return
        inner = kvvmm.open_driver("host")
        stack.callback(inner.close)
        skipped["vllm"] = "no GPU: vLLM's CudaVmmDriver needs libcuda and a device"
        yield {"kvvmm": KvvmmVmmDriver(inner)}, "host", skipped


def _gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _card(device: int) -> str:
    try:
        import torch

        return str(torch.cuda.get_device_name(device))
    except Exception:  # a card name is a label; the figures stand without it
        return f"cuda:{device}"


def run(kind: str, sizes_mib: Sequence[int], rounds: int, warmup: int, device: int,
        progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Time every call of every driver, alternating; the result as JSON-ready data.

    ``kind`` ``host-pair`` and ``null`` time the adapter against ``direct`` (vLLM's calls
    straight to the same kind of driver): the comparison's control flow without a GPU, and
    the adapter's own cost as ``overhead_us``."""
    with drivers(kind, device) as (drvs, card, skipped):
        names = list(drvs)
        gran = next(iter(drvs.values())).granularity(device)
        per_size: dict[str, Any] = {}
        for mib in sizes_mib:
            size = -(-mib * MiB // gran) * gran
            ns: dict[str, dict[str, list[int]]] = {n: {c: [] for c in CALLS} for n in names}
            first_rounds: list[str] = []  # who went when in rounds 0 and 1 (they alternate)
            scratch: dict[str, list[int]] = {c: [] for c in CALLS}  # warmup: thrown away
            for n in names:
                for _ in range(warmup):
                    cycle(drvs[n], size, device, scratch)
            gc.disable()  # a collection inside a call would be nobody's cost
            try:
                for r in range(rounds):
                    for n in (names if r % 2 == 0 else names[::-1]):
                        cycle(drvs[n], size, device, ns[n])
                        if r < 2:
                            first_rounds.append(n)
            finally:
                gc.enable()
            stats = {n: summarize(ns[n]) for n in names}
            row: dict[str, Any] = {"size_bytes": size, "order": first_rounds, **stats}
            base = names[0] if len(names) > 1 else None  # vllm, or direct
            if base is not None:
                ours, theirs = stats["kvvmm"], stats[base]
                row["ratio_median"] = {c: ratio(ours[c]["median_us"], theirs[c]["median_us"])
                                       for c in CALLS}
                row["ratio_p99"] = {c: ratio(ours[c]["p99_us"], theirs[c]["p99_us"])
                                    for c in CALLS}
                row["ratio_cycle_median"] = ratio(sum(ours[c]["median_us"] for c in CALLS),
                                                  sum(theirs[c]["median_us"] for c in CALLS))
                row["overhead_us"] = {c: round(ours[c]["median_us"] - theirs[c]["median_us"], 3)
                                      for c in CALLS}
                row["overhead_cycle_us"] = round(sum(row["overhead_us"].values()), 3)
            per_size[f"{mib}MiB"] = row
            progress(f"{mib} MiB done")
    cycles = [row["ratio_cycle_median"] for row in per_size.values()
              if row.get("ratio_cycle_median") is not None]
    return {"benchmark": "vllm-overhead", "card": card, "drivers": names,
            "versions": {**versions(ROOT, "torch", "cuda-python", "cuda-bindings"),
                         "vllm_files": "0.34.0"},
            "machine": {"cpu": cpu_model(), "load_average": load_average()},
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "rounds": rounds, "warmup": warmup, "granularity_bytes": gran,
            "calls": list(CALLS), "skipped": skipped, "target_ratio": TARGET,
            "worst_cycle_ratio": max(cycles) if cycles else None,
            "within_target": (max(cycles) <= TARGET) if cycles else None, "sizes": per_size}


def report(result: dict[str, Any]) -> str:
    """The result as a plain table (microseconds; ratio kvvmm / vLLM, or / direct)."""
    lines = [f"{result['card']}  ({result['rounds']} rounds)"]
    base = result["drivers"][0] if len(result["drivers"]) > 1 else "vllm"
    for label, row in result["sizes"].items():
        lines.append(f"-- {label}")
        lines.append(f"{'call':14} {base + ' p50':>11} {'p99':>9} {'kvvmm p50':>10} {'p99':>9} "
                     f"{'x p50':>7} {'x p99':>7} {'+us p50':>8}")
        for c in result["calls"]:
            v = row.get(base, {}).get(c, {})
            k = row["kvvmm"][c]
            x50 = row.get("ratio_median", {}).get(c)
            x99 = row.get("ratio_p99", {}).get(c)
            plus = row.get("overhead_us", {}).get(c, "-")
            lines.append(f"{c:14} {v.get('median_us', '-'):>11} {v.get('p99_us', '-'):>9} "
                         f"{k['median_us']:>10} {k['p99_us']:>9} {x50 or '-':>7} "
                         f"{x99 or '-':>7} {plus:>8}")
        if row.get("ratio_cycle_median") is not None:
            lines.append(f"cycle (sum of medians): kvvmm / {base} = {row['ratio_cycle_median']}, "
                         f"+{row['overhead_cycle_us']} us")
    for name, why in result["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--driver", choices=("auto", "cuda", "host", "host-pair", "null"),
                   default="auto",
                   help="host-pair / null: the adapter against vLLM's calls passed straight to "
                        "a host driver / a driver whose calls return at once (its own cost)")
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 32, 128],
                   help="sizes in MiB (rounded up to the granularity)")
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--device", type=int, default=0)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or any(s < 1 for s in args.sizes):
        p.error("--rounds >= 1, --warmup >= 0 and --sizes >= 1 MiB")
    result = run(args.driver, args.sizes, args.rounds, args.warmup, args.device,
                 progress=lambda s: print(s, file=sys.stderr))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(report(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
