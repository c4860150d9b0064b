"""Benchmark (not a test): sleep and wake of a 60 GiB KV pool, beside torch_memory_saver.

    python bench/sleep/bench_sleep.py [--driver cuda|host] [--gib 60] [--reps 3]
                                [--tms-path .peers-tms/site] [--out h200-sleep.json]

Issue 28, item 4. The pool is rank 0's of llama-3.1-70b at TP 8 (80 layers, one KV head of
128 per rank, bf16: 160 buffers), laid out by :func:`kvvmm.owner.tp.tp_descs` and finalized
to ``--gib`` GiB on one GPU (``CudaDriver``), every byte filled with seeded random bits.

- **PCIe**: a pinned host buffer copied to and from the device (up to 4 GiB, best of 5),
  measured in the same run: the wake with contents is held against ``bytes / H2D``.
- **kvvmm**, ``--reps`` times each, backup ``"host"`` (torch's pinned memory), the same
  with ``HostBackup(memory="mmap")`` (the default: one huge-page mapping faulted in and
  registered with CUDA chunk by chunk on threads while the copy runs), ``"host-mmap-serial"``
  (the same memory in one chunk on one thread: the path before the chunking, everything
  pinned and then everything copied), ``"host-keep"`` (one ``HostBackup(keep=True)`` for
  every rep: the first pins, the later ones copy into the memory kept), then none
  (and ``"disk"`` with ``--disk-dir``): ``sleep`` and
  ``wake`` wall times (each ends in a device synchronize), the device's free memory before
  and after (bytes given back against the owner's physical bytes), every byte compared after
  a wake with contents (regenerated from the seeds, buffer by buffer: bit for bit), and a CUDA
  graph captured once before the first sleep (copies and an add over the first, a middle and
  the last buffer's backed ends) replayed after every wake: equal to its replay before the
  sleep (with contents), and to an eager read of the same slices (without). Each rep keeps
  where the sleep's and the wake's time went (``phases``, ``wake_phases``: ``Arena.last_phases``;
  for the chunked memory the faulting in, the pinning, the copy's wait for them) and the
  sleep is held against the device-to-host copy of the same bytes (``targets.sleep_with_contents``:
  2x at most).
- **torch_memory_saver** (``--tms-path``: a folder holding the built package; skipped with the
  reason when it is missing or fails to import), in a child process after kvvmm's pool is
  closed: the same 160 buffer sizes allocated in a ``region`` (``hook_mode="torch"``), with
  and without ``enable_cpu_backup``, ``pause`` / ``resume`` timed the same way, memory and
  contents checked the same way, and the same graph.

``--driver host --gib 1`` runs the same logic on host memory (no PCIe, no graph, no
torch_memory_saver); ``tests/measure/test_bench_sleep.py`` runs it on 32 MiB with 64 KiB
granules. One JSON to ``--out`` with per-op times, bytes, checks, the targets, the card,
versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GiB, MiB = 1 << 30, 1 << 20
MODEL, TP, PAGE = "llama-3.1-70b", 8, 16
#: Issue 28's targets, and issue 50's for the sleep with contents.
WAKE_COPY_RATIO, WAKE_EMPTY_S, GIVEN_FRACTION, SLEEP_COPY_RATIO = 1.2, 0.050, 0.999, 2.0
#: The backups with contents, by label (see the module docstring).
HOST_MODES = ("host", "host-mmap", "host-mmap-serial", "host-keep")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def host_facts() -> dict[str, Any]:
    """What decides how fast fresh host memory is faulted in: transparent huge pages (and
    whether a fault compacts memory for one), CPUs, memory."""
    out: dict[str, Any] = {"cpus": os.cpu_count()}
    for key in ("enabled", "defrag"):
        try:
            out[f"thp_{key}"] = Path(f"/sys/kernel/mm/transparent_hugepage/{key}").read_text(
                encoding="utf-8").strip()
        except OSError:
            out[f"thp_{key}"] = None
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.split(":")[0] in ("MemTotal", "MemAvailable"):
                out[line.split(":")[0]] = line.split(":")[1].strip()
    except OSError:
        pass
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def pool_layout(gib: float) -> tuple[Any, int, int]:
    """(descs, reserved_tokens, finalize_tokens) of rank 0's pool holding ``gib`` GiB."""
    from kvvmm.owner.tp import tp_descs

    one = tp_descs(MODEL, tp=TP, reserved_tokens=PAGE * 2, page_size=PAGE, dtype="bfloat16")
    per_token = sum(-(-d.row_bytes // d.tokens_per_row) for d in one)
    tokens = int(gib * GiB) // per_token // PAGE * PAGE
    descs = tp_descs(MODEL, tp=TP, reserved_tokens=tokens, page_size=PAGE, dtype="bfloat16")
    return descs, tokens, tokens - PAGE  # finalize(n) backs n + page_size slots


# -- contents: seeded random bits, regenerated to compare ------------------------------------


def _gen(device: Any, seed: int) -> Any:
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def fill(tensors: list[Any], rows: int, seed: int) -> None:
    import torch

    for i, t in enumerate(tensors):
        v = t[:rows].view(torch.int16)
        v.random_(-(1 << 15), 1 << 15, generator=_gen(v.device, seed * 1000 + i))


def same_bytes(tensors: list[Any], rows: int, seed: int) -> bool:
    """Every byte equal to what :func:`fill` wrote (one buffer's scratch at a time)."""
    import torch

    ok = True
    for i, t in enumerate(tensors):
        v = t[:rows].view(torch.int16)
        want = torch.empty_like(v).random_(-(1 << 15), 1 << 15,
                                           generator=_gen(v.device, seed * 1000 + i))
        ok = ok and bool(torch.equal(v, want))
        del want
    return ok


# -- the graph ------------------------------------------------------------------------------


class Graph:
    """A CUDA graph over three buffers' backed ends: copies out, and one add."""

    def __init__(self, tensors: list[Any], rows: int) -> None:
        import torch

        self.picked = [tensors[0], tensors[len(tensors) // 2], tensors[-1]]
        k = min(rows, 4096)
        self.slices = [(0, k), (rows - k, rows)]
        self.outs = [torch.empty_like(t[a:b]) for t in self.picked for a, b in self.slices]
        self.added = torch.empty_like(self.picked[0][:k])
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body()  # warm up off the capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph):
            self._body()
        torch.cuda.synchronize()

    def _body(self) -> None:
        import torch

        outs = iter(self.outs)
        for t in self.picked:
            for a, b in self.slices:
                next(outs).copy_(t[a:b])
        torch.add(self.picked[0][: self.added.shape[0]], 1, out=self.added)

    def replay(self) -> list[Any]:
        import torch

        self.graph.replay()
        torch.cuda.synchronize()
        return [o.clone() for o in (*self.outs, self.added)]

    def eager(self) -> list[Any]:
        import torch

        outs = [t[a:b].clone() for t in self.picked for a, b in self.slices]
        outs.append(self.picked[0][: self.added.shape[0]] + 1)
        torch.cuda.synchronize()
        return outs


def _equal(a: list[Any], b: list[Any]) -> bool:
    """Bit for bit: the fill's random bits hold bf16 NaNs, which ``torch.equal`` on the
    values would call unequal to themselves."""
    import torch

    return len(a) == len(b) and all(
        bool(torch.equal(x.view(torch.int16), y.view(torch.int16)))
        for x, y in zip(a, b, strict=True))


# -- PCIe ------------------------------------------------------------------------------------


def pcie(total_bytes: int) -> dict[str, Any]:
    """Host-to-device and device-to-host copy bandwidth of one pinned buffer, best of 5."""
    import torch

    size = min(4 * GiB, total_bytes)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"bytes": size}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times = times[1:]  # the first warms the path up
        out[f"{name}_s"] = _stats(times)
        out[f"{name}_gbps"] = size / min(times) / 1e9
    del host, dev
    torch.cuda.empty_cache()
    getattr(torch._C, "_host_emptyCache", lambda: None)()
    return out


# -- kvvmm -----------------------------------------------------------------------------------


def _free(drv: Any) -> int:
    return int(drv.mem_info()[0])


def run_kvvmm(kind: str, gib: float, reps: int, disk_dir: str | None,
              host_granularity: int = 2 * MiB) -> dict[str, Any]:
    import torch

    from kvvmm.driver import open_driver
    from kvvmm.owner import KvBufferOwner
    from kvvmm.policy import Exact

    cuda = kind == "cuda"
    descs, reserved, n = pool_layout(gib)
    room = int(gib * GiB) + len(descs) * 2 * host_granularity  # buffers round up to granules
    drv = open_driver(kind) if cuda else open_driver("host", capacity_bytes=2 * room,
                                                     granularity=host_granularity)
    t0 = time.perf_counter()
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=PAGE, reserved_tokens=reserved,
                          descs=descs, policy=Exact(), name="llama70b-tp8-rank0")
    owner.finalize(n)
    grow_s = time.perf_counter() - t0
    rows = owner.backed_tokens  # token-major: one row a token
    fill(owner.tensors, rows, seed=1)
    if cuda:
        torch.cuda.synchronize()
    snap = owner.arena.snapshot()
    res: dict[str, Any] = {
        "buffers": len(descs), "reserved_tokens": reserved, "final_tokens": n,
        "backed_bytes": owner.backed_bytes, "mappings": len(snap.mappings),
        "grow_s": grow_s, "runs": {}}
    graph = Graph(owner.tensors, rows) if cuda else None
    before = graph.replay() if graph is not None else None
    from kvvmm.arena.backup import HostBackup, wait_unpinned

    # "host": torch's pinned allocator (named: the default is the mapping); "host-mmap": the
    # default, chunked; "host-mmap-serial": one chunk, one thread (the path before chunking);
    # "host-keep": one kept backup for every rep.
    modes: list[tuple[str, str | None]] = [(m, m) for m in HOST_MODES] + [("none", None)]
    if disk_dir is not None:
        modes.insert(len(HOST_MODES), ("disk", "disk"))
    for label, backup in modes:
        runs = []
        kept = HostBackup(keep=True) if backup == "host-keep" else None
        for r in range(reps):
            path = os.path.join(disk_dir, f"kvvmm-sleep-{r}.bin") if backup == "disk" else None
            how: Any = (HostBackup(memory="mmap") if backup == "host-mmap" else
                        HostBackup(memory="torch") if backup == "host" else
                        HostBackup(memory="mmap", workers=1, chunk_bytes=1 << 50)
                        if backup == "host-mmap-serial" else kept if backup == "host-keep"
                        else backup)
            backed, free0 = owner.backed_bytes, _free(drv)
            t0 = time.perf_counter()
            got = owner.sleep(how, path=path)
            sleep_s = time.perf_counter() - t0
            free1 = _free(drv)
            t0 = time.perf_counter()
            woke = owner.wake()
            wake_s = time.perf_counter() - t0
            run: dict[str, Any] = {
                "sleep_s": sleep_s, "wake_s": wake_s, "physical_bytes": backed,
                "given_bytes": got.given_bytes, "free_gain_bytes": free1 - free0,
                "given_fraction": (free1 - free0) / backed if backed else None,
                "woke_bytes": woke, "backup_bytes": got.backup_bytes,
                "phases": got.phases,
                "wake_phases": owner.arena.last_phases.get("wake", {})}
            if backup is not None:
                run["bit_exact"] = same_bytes(owner.tensors, rows, seed=1)
            if graph is not None:
                after = graph.replay()
                run["graph_same_as_before_sleep"] = _equal(after, before or [])
                run["graph_same_as_eager"] = _equal(after, graph.eager())
            runs.append(run)
        if kept is not None:
            kept.drop()
        wait_unpinned(60.0)  # the next mode's pinning does not race this one's unpinning
        res["runs"][label] = {
            "sleep_s": _stats([x["sleep_s"] for x in runs]),
            "wake_s": _stats([x["wake_s"] for x in runs]),
            "given_fraction_min": min((x["given_fraction"] or 0.0) for x in runs),
            "reps": runs}
        if backup is None:  # fresh memory now: the pattern again for whoever reads next
            fill(owner.tensors, rows, seed=1)
    del graph, before
    owner.close()
    if cuda:
        torch.cuda.synchronize()
    try:
        drv.close()
    except Exception as e:  # the measurements stand; say why the driver stayed open
        res["driver_close_error"] = f"{type(e).__name__}: {e}"
    return res


# -- torch_memory_saver, in a child --------------------------------------------------------


def tms_child(gib: float, reps: int, label: str, out: str) -> None:
    """In a fresh process: the same buffer sizes through torch_memory_saver, one mode (a
    process each: a region's pool keeps its memory until the process ends)."""
    import torch
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = "torch"
    descs, _, n = pool_layout(gib)
    rows = n + PAGE
    res: dict[str, Any] = {"version": _version("torch_memory_saver") or _tms_version(),
                           "hook_mode": "torch", "runs": {}}
    cpu_backup = label == "cpu_backup"
    tag = f"kv-{label}"
    torch.cuda.synchronize()
    with tms.region(tag=tag, enable_cpu_backup=cpu_backup):
        tensors = [torch.empty((rows, *d.shape[1:]), dtype=torch.bfloat16, device="cuda")
                   for d in descs]
    fill(tensors, rows, seed=2)
    torch.cuda.synchronize()
    graph = Graph(tensors, rows)
    before = graph.replay()
    phys = sum(t.numel() * t.element_size() for t in tensors)
    runs = []
    for _ in range(reps):
        free0 = torch.cuda.mem_get_info()[0]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tms.pause(tag)
        torch.cuda.synchronize()
        pause_s = time.perf_counter() - t0
        free1 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        tms.resume(tag)
        torch.cuda.synchronize()
        resume_s = time.perf_counter() - t0
        run: dict[str, Any] = {"sleep_s": pause_s, "wake_s": resume_s,
                               "physical_bytes": phys, "free_gain_bytes": free1 - free0,
                               "given_fraction": (free1 - free0) / phys}
        if cpu_backup:
            run["bit_exact"] = same_bytes(tensors, rows, seed=2)
        after = graph.replay()
        run["graph_same_as_before_sleep"] = _equal(after, before)
        run["graph_same_as_eager"] = _equal(after, graph.eager())
        runs.append(run)
        if not cpu_backup:
            fill(tensors, rows, seed=2)
    res["runs"][label] = {
        "sleep_s": _stats([x["sleep_s"] for x in runs]),
        "wake_s": _stats([x["wake_s"] for x in runs]),
        "given_fraction_min": min(x["given_fraction"] for x in runs), "reps": runs}
    del graph, before, tensors
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    Path(out).write_text(json.dumps(res, indent=1))


def _tms_version() -> str | None:
    try:
        import torch_memory_saver

        return getattr(torch_memory_saver, "__version__", None)
    except Exception:
        return None


def run_tms(gib: float, reps: int, tms_path: str | None, out_dir: Path,
            timeout_s: float) -> dict[str, Any]:
    if not tms_path or not os.path.isdir(tms_path):
        return {"skipped": f"no built torch_memory_saver at --tms-path {tms_path!r}"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tms_path, str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    got: dict[str, Any] = {"runs": {}}
    for label in ("cpu_backup", "none"):
        child_out = out_dir / f"bench-sleep-tms-{label}.json"
        cmd = [sys.executable, __file__, "--tms-child", label, "--gib", str(gib),
               "--reps", str(reps), "--child-out", str(child_out)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"skipped": f"torch_memory_saver's {label} child ran past "
                               f"{timeout_s} s", **got}
        if not child_out.exists():
            return {"skipped": f"torch_memory_saver's {label} child failed (rc "
                               f"{p.returncode})", "stderr_tail": p.stderr[-3000:], **got}
        if p.returncode != 0:  # on the H200 its CPU-backup child measured, wrote its JSON,
            # then died at exit (SIGSEGV inside tms_torch_free): what it measured stands
            got.setdefault("child_exits", {})[label] = {
                "rc": p.returncode, "stderr_tail": p.stderr[-1500:]}
        one = json.loads(child_out.read_text())
        got["runs"].update(one.pop("runs"))
        got.update(one)
    return got


# -- the report --------------------------------------------------------------------------


def targets(res: dict[str, Any]) -> dict[str, Any]:
    """Issue 28's targets, each with the numbers it was judged on (None: not measured)."""
    kv = res["kvvmm"]["runs"]
    out: dict[str, Any] = {}
    h2d = (res.get("pcie") or {}).get("h2d_gbps")
    host = kv["host"]
    copy_s = host["reps"][0]["backup_bytes"] / (h2d * 1e9) if h2d else None
    d2h = (res.get("pcie") or {}).get("d2h_gbps")
    d2h_s = host["reps"][0]["backup_bytes"] / (d2h * 1e9) if d2h else None
    sleeps = {}
    for mode in HOST_MODES:
        if mode not in kv:
            continue
        sl = kv[mode]["sleep_s"]["median"]
        xs = [r.get("sleep_s") for r in kv[mode]["reps"]]
        if mode == "host-keep" and len(xs) > 1 and None not in xs:
            sl = statistics.median(xs[1:])  # a kept backup pins at its first sleep only
        sleeps[mode] = {"sleep_s_median": sl, "ratio": sl / d2h_s if d2h_s else None,
                        "met": (sl <= SLEEP_COPY_RATIO * d2h_s) if d2h_s else None}
    out["sleep_with_contents"] = {
        "d2h_copy_s": d2h_s, "target_ratio": SLEEP_COPY_RATIO, "by_memory": sleeps,
        "default_memory": "host-mmap",
        "met": sleeps.get("host-mmap", {}).get("met")}
    per_mode = {}
    for mode in ("host", "host-mmap"):
        if mode not in kv:
            continue
        w = kv[mode]["wake_s"]["median"]
        per_mode[mode] = {"wake_s_median": w, "ratio": w / copy_s if copy_s else None,
                          "met": (w <= WAKE_COPY_RATIO * copy_s) if copy_s else None}
    best = min(per_mode, key=lambda m: per_mode[m]["wake_s_median"])
    out["wake_with_contents"] = {
        "h2d_copy_s": copy_s, "target_ratio": WAKE_COPY_RATIO, "by_memory": per_mode,
        "best_memory": best, "wake_s_median": per_mode[best]["wake_s_median"],
        "ratio": per_mode[best]["ratio"], "met": per_mode[best]["met"]}
    out["wake_without_contents"] = {
        "wake_s_median": kv["none"]["wake_s"]["median"], "target_s": WAKE_EMPTY_S,
        "met": kv["none"]["wake_s"]["median"] <= WAKE_EMPTY_S}
    frac = min(r["given_fraction_min"] for r in kv.values())
    out["given_back"] = {"fraction_min": frac, "target": GIVEN_FRACTION,
                         "met": frac >= GIVEN_FRACTION,
                         "by_mode": {m: r["given_fraction_min"] for m, r in kv.items()}}
    graph = [r.get("graph_same_as_before_sleep") for r in host["reps"]]
    out["graph_after_wake"] = {"identical": all(graph) if None not in graph else None}
    out["bit_exact"] = all(r.get("bit_exact", True) for m in kv.values() for r in m["reps"])
    tms = res.get("torch_memory_saver") or {}
    if "runs" in tms:
        pairs = (("host", "cpu_backup"), ("host-mmap", "cpu_backup"), ("none", "none"))
        out["vs_torch_memory_saver"] = {
            k: {"kvvmm_wake_s": kv[k]["wake_s"]["median"],
                "tms_resume_s": tms["runs"][t]["wake_s"]["median"],
                "kvvmm_sleep_s": kv[k]["sleep_s"]["median"],
                "tms_pause_s": tms["runs"][t]["sleep_s"]["median"],
                "met": (kv[k]["wake_s"]["median"] <= tms["runs"][t]["wake_s"]["median"]
                        and kv[k]["sleep_s"]["median"] <= tms["runs"][t]["sleep_s"]["median"])}
            for k, t in pairs if k in kv and t in tms["runs"]}
    else:
        out["vs_torch_memory_saver"] = {"met": None, "why": tms.get("skipped")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--driver", choices=("cuda", "host"), default="cuda")
    ap.add_argument("--gib", type=float, default=60.0, help="the pool's backed GiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--disk-dir", default=None,
                    help="also sleep to a file in this folder (not timed against a target)")
    ap.add_argument("--tms-path", default=None,
                    help="a folder holding the built torch_memory_saver package")
    ap.add_argument("--tms-timeout", type=float, default=120.0,
                    help="seconds for each torch_memory_saver child (one a mode)")
    ap.add_argument("--host-granularity-kib", type=int, default=2048,
                    help="the host driver's granularity (tests make it small, so that a "
                         "small pool is not 160 rounded-up granules)")
    ap.add_argument("--out", default="bench-sleep.json")
    ap.add_argument("--tms-child", choices=("cpu_backup", "none"), default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--judge", default=None, metavar="RESULT",
                    help="judge the targets again on a result this script wrote (its runs, "
                         "pcie and torch_memory_saver sections) and print them; no run")
    args = ap.parse_args(argv)
    if args.judge:
        print(json.dumps(targets(json.loads(Path(args.judge).read_text(encoding="utf-8"))),
                         indent=1))
        return 0
    if args.gib <= 0 or args.reps < 1:
        ap.error("--gib must be > 0 and --reps >= 1")
    if args.tms_child:
        tms_child(args.gib, args.reps, args.tms_child, args.child_out)
        return 0
    import torch

    import kvvmm

    cuda = args.driver == "cuda"
    if cuda:
        torch.zeros(1, device="cuda")
    res: dict[str, Any] = {
        "benchmark": "bench_sleep", "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "card": torch.cuda.get_device_name(0) if cuda else f"host ({platform.machine()})",
        "driver": args.driver,
        "versions": {"kvvmm": getattr(kvvmm, "__version__", "?"), "torch": torch.__version__,
                     "cuda_bindings": _version("cuda-bindings"),
                     "python": platform.python_version()},
        "pool": {"model": MODEL, "tp": TP, "rank": 0, "gib": args.gib, "dtype": "bfloat16",
                 "page_size": PAGE},
        "host": host_facts()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []

    def section(key: str, fn: Any) -> None:
        """One part of the run; a failure is reported in the JSON, the rest still runs."""
        try:
            res[key] = fn()
        except Exception as e:
            import traceback

            errors.append(f"{key}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
            res[key] = None
        out.write_text(json.dumps(res, indent=1))  # what is measured so far, at every step

    section("pcie", lambda: pcie(int(args.gib * GiB)) if cuda else None)
    section("kvvmm", lambda: run_kvvmm(args.driver, args.gib, args.reps, args.disk_dir,
                                       args.host_granularity_kib * 1024))
    if cuda:
        torch.cuda.empty_cache()
        section("torch_memory_saver", lambda: run_tms(args.gib, args.reps, args.tms_path,
                                                      out.parent, args.tms_timeout))
    else:
        res["torch_memory_saver"] = {"skipped": "needs CUDA (--driver host)"}
    if res.get("kvvmm") is not None:
        section("targets", lambda: targets(res))
    res["errors"] = errors
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res.get("targets"), indent=1))
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
