"""``kvvmm bench``: measure kvvmm on a real GPU, side by side with the raw driver and the seed.

Sections (each a key of the JSON result):

- ``per_call``: µs per driver call by handle size: raw cuda-python, CudaDriver as it runs
  (hot calls in C where built) and CudaDriver all in Python, rep by rep in a shuffled order.
- ``arena``, ``owner``: construction and close of a 64 GiB arena and of the workload's owner.
- ``growth``: per policy, the workload's decode growth (rounds with the policies' order
  rotated, and back to back for the default), finalize, driver calls, handles, over-commit,
  and the copy bandwidth of the owner's tensors against cudaMalloc's.
- ``elastic_growth``, ``page_ops``, ``elastic_bandwidth``: growth with a handle pool and
  look-ahead, single pages and granules committed and given back, copies over holes
  (:mod:`kvvmm.measure.elastic`).
- ``seed`` (with ``--seed-file`` and ``--seed-script``): SGLang's arena on the same workload,
  run by ``bench/seed/seed_side_by_side.py`` in a child process.

The result goes to ``<out>/<card>-kvvmm-bench.json``; a progress bar goes to stderr, the
summary to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvvmm.driver.base import Driver
from kvvmm.errors import ArgumentError, DriverUnavailableError, KvvmmError
from kvvmm.measure.elastic import (
    GAP_S,
    LOOKAHEAD_BYTES,
    LOOKAHEAD_SWEEP,
    elastic_bandwidth,
    elastic_growth,
    elastic_targets,
    page_ops,
)
from kvvmm.measure.growth import back_to_back, grow_rounds, policy_growth
from kvvmm.measure.results import checkout_root
from kvvmm.measure.stats import median_us
from kvvmm.measure.timer import CallTimes, TimedDriver, _timed, time_handle_calls
from kvvmm.measure.workload import BENCH_WORKLOAD, Workload
from kvvmm.units import GiB, MiB

__all__ = ["BENCH_WORKLOAD", "GAP_S", "LOOKAHEAD_BYTES", "LOOKAHEAD_SWEEP", "SEED_SCRIPT",
           "TimedDriver", "Workload", "elastic_bandwidth", "elastic_growth", "elastic_targets",
           "find_seed_script", "main", "page_ops", "run"]

#: The seed's side of the benchmark, a bench file (see the module docstring).
SEED_SCRIPT = Path("bench") / "seed" / "seed_side_by_side.py"


def _raw_rep(d: Any, prop: Any, acc: Any, size: int, va: int, t: dict[str, list[float]],
             ) -> None:
    """One rep of the raw cuda-python calls at ``va`` (with the error check any caller
    needs), each call's seconds appended to ``t["raw_<call>"]``."""
    ok, pc = d.CUresult.CUDA_SUCCESS, time.perf_counter
    t0 = pc()
    err, h = d.cuMemCreate(size, prop, 0)
    if err != ok:
        raise RuntimeError(err)
    t1 = pc()
    if d.cuMemMap(va, size, 0, h, 0)[0] != ok:
        raise RuntimeError("map")
    t2 = pc()
    if d.cuMemSetAccess(va, size, [acc], 1)[0] != ok:
        raise RuntimeError("access")
    t3 = pc()
    if d.cuCtxSynchronize()[0] != ok:
        raise RuntimeError("sync")
    t4 = pc()
    if d.cuMemUnmap(va, size)[0] != ok:
        raise RuntimeError("unmap")
    t5 = pc()
    if d.cuMemRelease(h)[0] != ok:
        raise RuntimeError("release")
    t6 = pc()
    for k, v in (("create", t1 - t0), ("map", t2 - t1), ("set_access", t3 - t2),
                 ("unmap", t5 - t4), ("unmap_sync", t5 - t3), ("release", t6 - t5)):
        t[f"raw_{k}"].append(v)


def _raw_props(d: Any, device: int) -> tuple[Any, Any]:
    """cuda-python's allocation properties and access descriptor for ``device``."""
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    acc = d.CUmemAccessDesc()
    acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = device
    acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return prop, acc


#: The calls :func:`_per_call` sets side by side (``unmap_sync``: unmap with its synchronize).
_SIDE_BY_SIDE = ("create", "map", "set_access", "unmap_sync", "release")


def _per_call(drv_mod: Any, cd: Any, cd_py: Any | None = None) -> dict[str, Any]:
    """Raw cuda-python vs CudaDriver, per call, interleaved rep by rep (order shuffled).

    ``cd`` is the CudaDriver as it runs by default (its hot calls in C when ``_cudafast`` is
    built); ``cd_py``, when given, one with every call in Python (``KVVMM_CUDA_FASTPATH=0``),
    timed in the same reps so the two ratios compare on the same card at the same moment.
    Each driver's rep is the shared timing loop (:func:`time_handle_calls`: one size, create,
    map, set access, unmap with its synchronize, release), the raw calls' rep its twin.
    """
    d = drv_mod
    prop, acc = _raw_props(d, cd.device)
    drivers = [("kvvmm", cd)] + ([("kvvmm_python", cd_py)] if cd_py is not None else [])
    out: dict[str, Any] = {}
    for size, reps in ((2 * MiB, 300), (32 * MiB, 300), (512 * MiB, 90)):
        raw_va = int(_ck(d.cuMemAddressReserve(size, 0, 0, 0)))
        k_vas = [(w, drv, drv.reserve(size)) for w, drv in drivers]
        t: dict[str, list[float]] = {f"raw_{op}": [] for op in (*_SIDE_BY_SIDE, "unmap")}
        # A fresh random order each rep (seeded): what one call costs depends on the call
        # before it, so every runner must follow every other as often (turning a fixed
        # order keeps who follows whom).
        rng = random.Random(size)
        times = {w: CallTimes((size,)) for w, _, _ in k_vas}
        runners: list[Callable[[], None]] = [
            functools.partial(_raw_rep, d, prop, acc, size, raw_va, t),
            *(functools.partial(time_handle_calls, drv, {size: k_va}, time.perf_counter, rng,
                                times[w]) for w, drv, k_va in k_vas)]
        for _ in range(reps):
            rng.shuffle(runners)
            for run_one in runners:
                run_one()
        _ck(d.cuMemAddressFree(raw_va, size))
        for _, drv, k_va in k_vas:
            drv.free(k_va, size)
        for w, got in times.items():
            for op, by in got.samples.items():
                t[f"{w}_{'unmap_sync' if op == 'unmap' else op}"] = by[size]
        row: dict[str, Any] = {k: median_us(v) for k, v in t.items() if v}
        for w, _ in drivers:
            row[f"ratio_{w}_over_raw"] = {
                op: round(row[f"{w}_{op}"] / row[f"raw_{op}"], 3) for op in _SIDE_BY_SIDE}
        out[f"{size // MiB}MiB"] = row
    return out


def _ck(res: Any) -> Any:
    from cuda.bindings import driver as d

    err = res[0] if isinstance(res, tuple) else res
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA call failed: {err}")
    return res[1] if isinstance(res, tuple) and len(res) > 1 else None


def find_seed_script(explicit: str | None) -> Path:
    """The seed's side of the benchmark, ``bench/seed/seed_side_by_side.py``: where it is named.

    Args:
        explicit: a path given with ``--seed-script``; used as is (None: not named).
    Returns:
        The script's path.
    Raises:
        ArgumentError: ``explicit`` is None (the package does not look for the script).
        FileNotFoundError: it is not there (an installed wheel has no ``bench/``).
    """
    if explicit is None:
        raise ArgumentError("--seed-script", None, f"the path of {SEED_SCRIPT} of a kvvmm "
                            "checkout (--seed-file needs it)")
    cand = Path(explicit)
    if cand.is_file():
        return cand
    raise FileNotFoundError(
        f"the seed's benchmark script is not at {cand}: pass --seed-script "
        "PATH/seed_side_by_side.py (it is bench/seed/seed_side_by_side.py of a kvvmm checkout)")


def _check_seed_file(seed_file: str) -> str:
    """The seed file's absolute path; it must exist and be named ``kv_vmm_backing_seed.py``."""
    path = os.path.abspath(seed_file)
    if os.path.basename(path) != "kv_vmm_backing_seed.py":
        raise SystemExit(f"--seed-file must be named kv_vmm_backing_seed.py, got {seed_file}")
    if not os.path.isfile(path):
        raise SystemExit(f"--seed-file {seed_file}: no such file")
    return path


def _seed(seed_file: str, script: Path) -> dict[str, Any]:
    """Run ``script`` on the seed file in a child process; its ``SEED_JSON`` line, or the error."""
    env = dict(os.environ)
    # The child imports the same kvvmm as this process (the script takes its workload from it).
    env["PYTHONPATH"] = os.pathsep.join([str(checkout_root()), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), seed_file],
                          capture_output=True, text=True, env=env, timeout=540)
    for line in proc.stdout.splitlines():
        if line.startswith("SEED_JSON "):
            res: dict[str, Any] = json.loads(line[len("SEED_JSON "):])
            res["exit_code"] = proc.returncode
            res["stderr_tail"] = proc.stderr[-600:]
            return res
    return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}


def _tqdm() -> Any:
    """tqdm's bar class, imported only here: ``import kvvmm`` does not load it."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError as e:
        e.add_note("kvvmm bench shows its progress with tqdm, a kvvmm dependency: pip install tqdm")
        raise
    return tqdm


def _card_slug(card: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``: the card's part of a result's file name, and the key
    of the profile calibrate makes of it (``"gpu"`` for a card with no name)."""
    return card.lower().replace("nvidia ", "").strip().replace(" ", "-") or "gpu"


@contextlib.contextmanager
def _card(device: int) -> Iterator[tuple[Driver, Callable[[], None]]]:
    """GPU ``device``'s CudaDriver (closed after the block) and how to wait for the device.

    Raises:
        DriverUnavailableError: no usable GPU.
    """
    from kvvmm.driver.cuda import CudaDriver

    try:
        import torch
    except ImportError as e:
        raise DriverUnavailableError(f"torch is not installed ({e})") from None
    if not torch.cuda.is_available():
        raise DriverUnavailableError("torch.cuda.is_available() is False")
    torch.cuda.init()  # type: ignore[no-untyped-call]
    torch.empty(1, device=f"cuda:{device}")
    cd = CudaDriver(device=device)
    try:
        yield cd, lambda: torch.cuda.synchronize(device)
    finally:
        try:
            cd.close()
        except KvvmmError as e:  # what is written stands; what the driver holds goes at exit
            print(f"kvvmm: warning: closing the driver: {e}", file=sys.stderr)


def _policies() -> list[Any]:
    """The growth policies timed, the default first (each once)."""
    from kvvmm.policy import Chunked, Exact, Geometric, default_policy

    return list({str(p): p for p in (default_policy(), Exact(), Chunked(64 * MiB),
                                     Chunked(128 * MiB), Chunked(256 * MiB),
                                     Geometric(2.0, 256 * MiB))}.values())


def _header(cd: Any, device: int, w: Workload) -> dict[str, Any]:
    """The result's card, versions, date, memory and workload."""
    import importlib.metadata as md

    import torch
    from cuda.bindings import driver as d

    from kvvmm._version import __version__
    from kvvmm.policy import default_policy

    free, total = cd.mem_info()
    return {
        "benchmark": "kvvmm bench (gpu)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "card": torch.cuda.get_device_name(device),
        "versions": {"torch": torch.__version__, "cuda_bindings": md.version("cuda-bindings"),
                     "driver": int(_ck(d.cuDriverGetVersion())), "kvvmm": __version__,
                     "python": platform.python_version()},
        "mem_total_bytes": total, "mem_free_bytes": free,
        "granularity_min": cd.granularity_min,
        "granularity_recommended": cd.granularity_recommended,
        "workload": {"buffers": w.buffers, "kv_heads": w.kv_heads, "head_dim": w.head_dim,
                     "page_size": w.page_size, "reserved_tokens": w.reserved_tokens,
                     "step_tokens": w.step_tokens, "grow_to_tokens": w.grow_to_tokens,
                     "finalize_tokens": w.finalize_tokens},
        "default_policy": str(default_policy()),
    }


def _per_call_section(cd: Any, device: int) -> dict[str, Any]:
    """``per_call`` (:func:`_per_call`), with a second CudaDriver whose every call is in
    Python timed beside the default one; and whether the default has its C path."""
    from cuda.bindings import driver as d

    from kvvmm.driver.cuda import CudaDriver

    old = os.environ.get("KVVMM_CUDA_FASTPATH")
    os.environ["KVVMM_CUDA_FASTPATH"] = "0"
    try:
        cd_py = CudaDriver(device=device)  # every call in Python, timed beside the default
    finally:
        if old is None:
            del os.environ["KVVMM_CUDA_FASTPATH"]
        else:
            os.environ["KVVMM_CUDA_FASTPATH"] = old
    try:
        return {"fast_path": cd.fast_path, "per_call": _per_call(d, cd, cd_py)}
    finally:
        cd_py.close()


def _ms(ctor: list[float], close: list[float]) -> dict[str, float]:
    return {"ctor_ms_median": median_us(ctor) / 1e3, "ctor_ms_max": round(max(ctor) * 1e3, 3),
            "close_ms_median": median_us(close) / 1e3}


def _construction(cd: Any, w: Workload) -> dict[str, Any]:
    """``arena`` (a 64 GiB reservation) and ``owner`` (the workload's buffers): ms to make
    and to close."""
    from kvvmm.arena import Arena
    from kvvmm.owner import KvBufferOwner

    Arena(cd, reserve_bytes=64 * GiB).close()  # warm-up: the first reserve costs more
    arenas: list[Arena] = []
    ctor = _timed(lambda: arenas.append(Arena(cd, reserve_bytes=64 * GiB)), 10)
    close = _timed(lambda: arenas.pop().close(), 10)
    owners: list[KvBufferOwner] = []
    octor = _timed(lambda: owners.append(KvBufferOwner(
        driver=cd, dtype="bfloat16", page_size=w.page_size, reserved_tokens=w.reserved_tokens,
        descs=w.descs())), 5)
    reserved = owners[0].arena.reserved_bytes
    oclose = _timed(lambda: owners.pop().close(), 5)
    return {"arena": {"reserve_bytes": 64 * GiB} | _ms(ctor, close),
            "owner": {"buffers": w.buffers, "reserved_bytes": reserved} | _ms(octor, oclose)}


def _malloc_ms(nbytes: int, device: int) -> float:
    """ms of one cudaMalloc (``torch.empty``) of ``nbytes``."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    big = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    torch.cuda.synchronize()
    ms = round((time.perf_counter() - t0) * 1e3, 2)
    del big
    torch.cuda.empty_cache()
    return ms


def _growth_sections(cd: Any, res: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    """The rotated rounds of every policy, then per policy its finalize and bandwidth."""
    policies = _policies()
    rounds: dict[str, list[float]] = {}
    b2b: list[float] = []

    def growth_rounds() -> None:
        rounds.update(grow_rounds(cd, policies))
        b2b.extend(back_to_back(cd, policies[0]))
        res["growth"] = []

    def growth(p: Any) -> None:
        g = policy_growth(cd, p, rounds[str(p)])
        if p is policies[0]:
            g["grow_ms_back_to_back"] = b2b
        res["growth"].append(g)

    return [("growth, rotated rounds", growth_rounds),
            *[(f"finalize and bandwidth {p}", functools.partial(growth, p)) for p in policies]]


def run(out_dir: str, seed_file: str | None, device: int = 0,
        seed_script: str | None = None) -> dict[str, Any]:
    """Run every section; return the result dict (also written as JSON under ``out_dir``).

    Args:
        out_dir: folder for ``<card>-kvvmm-bench.json`` (made if missing).
        seed_file: SGLang's ``kv_vmm_backing_seed.py`` to run side by side, or None.
        device: the CUDA device ordinal.
        seed_script: the seed's benchmark script, ``bench/seed/seed_side_by_side.py`` (needed
            with ``seed_file``).
    Returns:
        The result, with ``"path"`` set to the file written.
    Raises:
        DriverUnavailableError: no usable GPU.
        ArgumentError: ``seed_file`` is given and ``seed_script`` is not.
        FileNotFoundError: ``seed_file`` is given and the seed's script is not found.
        ImportError: tqdm is missing.
    """
    # All three checked before minutes of measuring, not after them.
    seed = _check_seed_file(seed_file) if seed_file else None
    script = find_seed_script(seed_script) if seed else None
    tqdm = _tqdm()
    with _card(device) as (cd, _):
        res = _header(cd, device, BENCH_WORKLOAD)
        sections = _sections(cd, device, res, (seed, script) if seed and script else None)
        # One step of the bar per section, on stderr: stdout is the summary.
        with tqdm(total=len(sections), file=sys.stderr, unit="section",
                  dynamic_ncols=True) as bar:
            for label, section in sections:
                bar.set_description_str(label)
                section()
                bar.update()
    res["targets"] = _targets(res)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{_card_slug(res['card'])}-kvvmm-bench.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    res["path"] = path
    return res


def _sections(cd: Any, device: int, res: dict[str, Any], seed: tuple[str, Path] | None,
              ) -> list[tuple[str, Callable[[], None]]]:
    """Every section in the order it runs: its label, and what fills its part of ``res``."""
    w = BENCH_WORKLOAD
    sections: list[tuple[str, Callable[[], None]]] = [
        ("per-call costs", lambda: res.update(_per_call_section(cd, device))),
        ("arena and owner construction", lambda: res.update(_construction(cd, w))),
        *_growth_sections(cd, res),
        ("cudaMalloc of the same bytes", lambda: res.update(cudaMalloc_same_bytes_ms=_malloc_ms(
            res["growth"][0]["backed_after_finalize_bytes"], device))),
        # the elastic sections come last so the figures above stay comparable with earlier
        # runs (nothing before them has held a pool's thread or a look-ahead's memory)
        ("elastic growth, pool vs none", lambda: res.update(elastic_growth=elastic_growth(cd))),
        ("single-page map/unmap", lambda: res.update(page_ops=page_ops(cd))),
        ("bandwidth with holes", lambda: res.update(elastic_bandwidth=elastic_bandwidth(cd))),
    ]
    if seed is not None:
        sections.append(("seed (SGLang arena) in a subprocess",
                         lambda: res.update(seed=_seed(*seed))))
    return sections


def _targets(res: dict[str, Any]) -> dict[str, Any]:
    default = next(g for g in res["growth"] if g["policy"] == res["default_policy"])
    ratios = [v for row in res["per_call"].values()
              for v in row["ratio_kvvmm_over_raw"].values()]
    out = {
        "arena_ctor_ms<=50": res["arena"]["ctor_ms_max"] <= 50,
        "owner_ctor_ms<=50": res["owner"]["ctor_ms_max"] <= 50,
        "per_call_ratio<=1.1": max(ratios) <= 1.1,
        "per_call_ratio_max": max(ratios),
        "default_growth_ms<=60": default["grow_ms"] <= 60,
        "default_growth_ms_rounds": default["grow_ms_rounds"],
        "default_growth_ms_back_to_back": default.get("grow_ms_back_to_back"),
        "default_bandwidth_ratio>=0.99": default["bandwidth"]["ratio"] >= 0.99,
        "default_overcommit<=one_chunk": default["max_overcommit_per_buffer"],
    }
    out.update(elastic_targets(res))
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvvmm bench``."""
    ap = argparse.ArgumentParser(prog="kvvmm bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join("bench", "results"),
                    help="folder for the JSON result (default: bench/results)")
    ap.add_argument("--seed-file", default=None,
                    help="path to SGLang's kv_vmm_backing as kv_vmm_backing_seed.py: run it "
                         "side by side")
    ap.add_argument("--seed-script", default=None,
                    help="the seed's benchmark script, bench/seed/seed_side_by_side.py of a kvvmm "
                         "checkout (needed with --seed-file)")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args(argv)
    script = None
    if args.seed_file:
        try:
            script = str(find_seed_script(args.seed_script))
        except (ArgumentError, FileNotFoundError) as e:
            print(f"kvvmm bench: {e}", file=sys.stderr)
            return 2
    try:
        res = run(args.out, args.seed_file, args.device, seed_script=script)
    except DriverUnavailableError as e:
        print(f"kvvmm bench needs a GPU: {e}", file=sys.stderr)
        return 2
    summary = {k: res[k] for k in ("card", "arena", "owner", "targets")}
    summary["growth"] = [{k: g[k] for k in ("policy", "grow_ms", "grow_ms_rounds",
                                             "grow_handles", "max_overcommit_per_buffer")}
                         | {"bw_ratio": g["bandwidth"]["ratio"]} for g in res["growth"]]
    if "seed" in res:
        summary["seed"] = res["seed"]
    print(json.dumps(summary, indent=1))
    print("wrote", res["path"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
