"""``kvvmm calibrate``: measure on a GPU what the simulator charges, and write it as a profile.

Measured through :class:`~kvvmm.driver.cuda.CudaDriver` on the card at hand:

- ``per_call``: µs per create, map, set_access, unmap and release by handle size, every size
  interleaved with every other in a fresh seeded order each rep;
- ``reserve_free``: reserve and free by reservation size;
- ``access_multi``: one set_access, and one unmap, over several mappings: µs per mapping;
- ``first_touch`` and ``cold_premium``: a map into fresh VA, the first call after a pause;
- ``library``: kvvmm's own work per arena and owner operation (wall time less its driver calls);
- ``growth``: decode growth per policy and each grown owner's close, every call timed inside;
- ``bandwidth``: copy bandwidth of a 1 GiB bf16 tensor by handle size and interleaving;
- ``post_release``: creates right after a large release against settled ones, repeated.

The profile JSON (``--out``, default ``<card>-profile.json``) is written after every section,
so a run cut short still loads (``calibration.complete`` false, ``calibration.errors`` says
what failed). ``--quick`` measures less; ``--quick --profile EXISTING`` refreshes a profile
instead (:mod:`kvvmm.measure.refresh`). Without a usable GPU it says so and exits 2.
``kvvmm calibrate rebuild [--check]`` needs no GPU (:mod:`kvvmm.measure.rebuild`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvvmm.driver.base import Driver
from kvvmm.errors import DriverUnavailableError, KvvmmError
from kvvmm.measure.bench import _card, _card_slug, _tqdm
from kvvmm.measure.calls import (
    access_multi,
    cold_premium,
    first_touch,
    per_call,
    post_release,
    reserve_free,
)
from kvvmm.measure.fit import build_profile, fit_library_overhead, slowdown_verdict
from kvvmm.measure.operations import bandwidth, growth, library
from kvvmm.measure.plan import FULL, QUICK, Ctx, Plan, fit_to_memory, plan_dict
from kvvmm.measure.timer import TimedDriver

__all__ = ["FULL", "QUICK", "Plan", "TimedDriver", "build_profile", "fit_library_overhead",
           "main", "measure", "run", "slowdown_verdict"]


#: The sections, in the order they run: (its key in the profile's raw data, the function).
SECTIONS: tuple[tuple[str, Callable[[Ctx], dict[str, Any]]], ...] = (
    ("per_call", per_call), ("reserve_free", reserve_free), ("access_multi", access_multi),
    ("first_touch", first_touch), ("cold_premium", cold_premium), ("library", library),
    ("growth", growth),
    ("bandwidth", bandwidth), ("post_release", post_release),
)


def _nvidia_driver() -> str:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout else "?"


def _meta(driver: Driver, cuda: bool, key: str | None) -> dict[str, Any]:
    import importlib.metadata as md

    from kvvmm._version import __version__

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "none"

    torch_v, cuda_v = "none", None
    if cuda:
        import torch

        torch_v, cuda_v = torch.__version__, torch.version.cuda
        card = torch.cuda.get_device_name(driver.device)
    else:
        card = f"{driver.kind} driver ({driver.name})"
    free, total = driver.mem_info()
    gran = driver.granularity_min
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "card": card, "key": key or _card_slug(card),
        "driver": _nvidia_driver() if cuda else "none", "cuda_runtime": cuda_v,
        "torch": torch_v, "cuda_bindings": version("cuda-bindings"), "kvvmm": __version__,
        "python": platform.python_version(), "capacity_bytes": total,
        "free_bytes_at_start": free, "granularity_bytes": gran, "driver_kind": driver.kind,
        # CudaDriver's hot calls in C (_cudafast) or in Python: their costs differ
        "fast_path": driver.fast_path,
    }


def measure(driver: Driver, plan: Plan, *, out: str, key: str | None = None,
            sections: Sequence[str] | None = None, cuda: bool = False,
            sync: Callable[[], None] = lambda: None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the sections on ``driver`` and write the profile to ``out`` after each one.

    A section that fails is recorded (``calibration.errors``) and the run goes on: one run on
    a borrowed GPU must leave every figure it could take. Works on any driver (the tests run
    it on the host driver with a tiny plan); the figures mean something only on CUDA.

    Returns:
        The profile as written (``calibration.complete`` true when every section ran).
    """
    td = TimedDriver(driver)
    ctx = Ctx(td, plan, sync, cuda)
    meta = _meta(driver, cuda, key)
    meas: dict[str, Any] = {}
    errors: dict[str, str] = {}
    names = [n for n, _ in SECTIONS if sections is None or n in sections]
    started = time.perf_counter()
    seconds: dict[str, float] = {}

    def write(complete: bool) -> dict[str, Any]:
        try:
            data = build_profile(meas, meta, plan)
        except Exception as e:  # a fit that fails must not lose the raw figures
            errors["build_profile"] = f"{type(e).__name__}: {e}"
            data = build_profile({k: v for k, v in meas.items() if k != "growth"}, meta, plan)
        data["calibration"] = {"complete": complete, "plan": plan_dict(plan),
                               "sections_done": list(meas), "errors": dict(errors),
                               "seconds": dict(seconds),
                               "wall_s": round(time.perf_counter() - started, 1),
                               "raw": meas}
        _write_json(out, data)
        return data

    for name, fn in SECTIONS:
        if name not in names:
            continue
        if progress is not None:
            progress(name)
        t0 = time.perf_counter()
        try:
            meas[name] = fn(ctx)
        except Exception as e:  # recorded and reported; the other sections still run
            errors[name] = f"{type(e).__name__}: {str(e)[:500]}"
        seconds[name] = round(time.perf_counter() - t0, 2)
        write(False)
    return write(not errors)


def _write_json(path: str, data: Any) -> None:
    """``data`` to ``path`` through a ``.part`` file: never a half-written file at ``path``."""
    tmp = f"{path}.part"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def run(*, out: str | None, quick: bool, device: int = 0, key: str | None = None,
        sections: Sequence[str] | None = None) -> dict[str, Any]:
    """Calibrate the GPU ``device`` (CudaDriver) and write the profile; see the module docstring.

    Raises:
        DriverUnavailableError: no usable GPU.
    """
    tqdm = _tqdm()
    names = [n for n, _ in SECTIONS if sections is None or n in sections]
    with _card(device) as (cd, sync), tqdm(total=len(names), file=sys.stderr, unit="section",
                                          dynamic_ncols=True) as bar:
        import torch

        path = out or f"{key or _card_slug(torch.cuda.get_device_name(device))}-profile.json"
        started: list[str] = []

        def progress(label: str) -> None:  # called as each section starts
            if started:
                bar.update()
            started.append(label)
            bar.set_description_str(label)

        try:
            plan = fit_to_memory(QUICK if quick else FULL, cd.mem_info()[0])
            data = measure(cd, plan, out=path, key=key, sections=sections,
                           cuda=True, sync=sync, progress=progress)
        finally:
            bar.update(len(names) - bar.n)
    data["path"] = path
    return data


def refresh(profile: str, out: str | None, device: int = 0) -> dict[str, Any]:
    """``kvvmm calibrate --quick --profile``: refresh ``profile`` on GPU ``device``, write it.

    Raises:
        DriverUnavailableError: no usable GPU.
        ProfileError, OSError: ``profile`` cannot be read.
    """
    from kvvmm.hardware import get_profile, profile_data
    from kvvmm.measure.refresh import quick_refresh

    old = dict(profile_data(get_profile(profile)))  # refused before the GPU is touched
    with _card(device) as (cd, sync):
        data = quick_refresh(cd, old, clock=lambda: time.perf_counter() * 1e6, sync=sync)
    path = out or f"{os.path.splitext(os.path.basename(profile))[0]}-refreshed.json"
    _write_json(path, data)
    data["path"] = path
    return data


def _no_gpu(e: DriverUnavailableError) -> int:
    """The one line ``kvvmm calibrate`` prints without a usable GPU; its exit status."""
    one = str(e).replace("\n", " ")
    print(f"kvvmm calibrate: needs a CUDA GPU; none is usable here ({one})", file=sys.stderr)
    return 2


def refresh_main(profile: str, out: str | None, device: int = 0) -> int:
    """``refresh`` with one line per failure (exit 2) and a summary (exit 0)."""
    try:
        data = refresh(profile, out, device)
    except DriverUnavailableError as e:
        return _no_gpu(e)
    except (KvvmmError, OSError, ImportError) as e:
        print(f"kvvmm calibrate: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    r = data["refreshed"]
    print(json.dumps({"path": data["path"], "seconds": r["seconds"], "from_date": r["from_date"],
                      "sources": r["sources"], "factors": r["factors"],
                      "history": len(data["spread"]["history"])}, indent=1))
    return 0


def _parser() -> argparse.ArgumentParser:
    """``kvvmm calibrate``'s options."""
    ap = argparse.ArgumentParser(prog="kvvmm calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None,
                    help="profile JSON to write (default: <card>-profile.json); rewritten "
                         "after every section")
    ap.add_argument("--quick", action="store_true",
                    help="fewer sizes, one round (~1 min); with --profile: refresh that "
                         "profile instead (kvvmm.measure.refresh)")
    ap.add_argument("--profile", default=None,
                    help="with --quick: an existing profile (a .json, or a shipped key such "
                         "as h200 or h100) to refresh: the drift-prone figures measured "
                         "(per-call costs by size, first touch, cold premium, library work) "
                         "in under a minute, the rest rescaled, the old figures kept as the "
                         "bands' history; a profile of capacity only refreshes the h200's "
                         "costs under its own capacity; written to --out (default "
                         "<profile>-refreshed.json)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--key", default=None, help="the profile's key (default: from the card)")
    ap.add_argument("--sections", default=None,
                    help=f"comma-separated subset of {','.join(n for n, _ in SECTIONS)}")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvvmm calibrate`` (``kvvmm calibrate rebuild``:
    :mod:`kvvmm.measure.rebuild`)."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["rebuild"]:
        from kvvmm.measure import rebuild

        return rebuild.main(argv[1:])
    args = _parser().parse_args(argv)
    if args.profile is not None:
        if not args.quick:
            print("kvvmm calibrate: error: --profile refreshes a profile, with --quick (the "
                  "full calibrate makes a new one)", file=sys.stderr)
            return 2
        return refresh_main(args.profile, args.out, args.device)
    sections = None if args.sections is None else [s.strip() for s in args.sections.split(",")]
    unknown = sorted(set(sections or ()) - {n for n, _ in SECTIONS})
    if unknown:
        print(f"kvvmm calibrate: error: unknown sections {unknown}", file=sys.stderr)
        return 2
    try:
        data = run(out=args.out, quick=args.quick, device=args.device, key=args.key,
                   sections=sections)
    except DriverUnavailableError as e:
        return _no_gpu(e)
    except ImportError as e:  # tqdm (a kvvmm dependency) or cuda-python missing
        print(f"kvvmm calibrate: error: {e} ({' '.join(getattr(e, '__notes__', []))})",
              file=sys.stderr)
        return 2
    cal = data["calibration"]
    lo = data.get("library_overhead_us", {}).get("per_call")
    print(json.dumps({"path": data["path"], "complete": cal["complete"],
                      "errors": cal["errors"], "seconds": cal["seconds"],
                      "library_overhead_per_call_us": lo,
                      "post_release_modelled": data.get("post_release_slowdown", {})
                      .get("modelled")}, indent=1))
    return 0 if cal["complete"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
