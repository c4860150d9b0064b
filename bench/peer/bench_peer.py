"""Benchmark (not a test): peer-read bandwidth of a peer-mapped KV buffer vs a local one.

    python bench/peer/bench_peer.py [--gib 1] [--repeats 20] [--out bench/results]

Needs two GPUs with a peer path (NVLink or PCIe P2P). A KV buffer (bf16, one handle per
``--handle-mib``, as an owner backs it) lives in an arena on GPU ``--owner`` (default 1); it
is given access for GPU ``--reader`` (default 0), which then reads it three ways, and the
same kernels run on a buffer local to the reader for comparison:

- ``sum``: a reduction (reads only): the bandwidth a decode kernel sees reading peer KV;
- ``copy``: ``local.copy_(peer)`` on the reader (reads the peer, writes locally);
- ``copy_local``: the same copy from the reader's own KV buffer.

Bandwidth is bytes read (plus written for copies) over the median time of ``--repeats``
runs after a warm-up, in GB/s (1e9 bytes/s). The result goes to
``bench/results/<gpu>-x2-peer.json`` (``h200-x2-peer.json``) with the card, versions and
date inside.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

MiB = 1 << 20


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _time_ms(fn: Any, device: int, repeats: int) -> float:
    import torch

    with torch.cuda.device(device):
        for _ in range(3):
            fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _measure(out: dict[str, Any], remote: Any, r_off: int, local: Any, l_off: int, elems: int,
             owner: int, reader: int, repeats: int) -> None:
    """Time the kernels on the reader; tensors live only in here."""
    import torch

    nbytes = 2 * elems
    peer_view = remote.tensor(r_off, (elems,), "bfloat16", device=reader)
    local_kv = local.tensor(l_off, (elems,), "bfloat16")
    remote.tensor(r_off, (elems,), "bfloat16").fill_(1.0)
    local_kv.fill_(1.0)
    dst = torch.empty(elems, dtype=torch.bfloat16, device=f"cuda:{reader}")
    torch.cuda.synchronize(owner)
    torch.cuda.synchronize(reader)
    assert peer_view.device == torch.device("cuda", reader)
    assert float(peer_view[:1024].float().sum()) == 1024.0, "GPU reader does not see the KV"

    def gbs(moved: int, ms: float) -> float:
        return round(moved / (ms / 1e3) / 1e9, 1)

    cases = {
        "sum_peer": (lambda: peer_view.sum(dtype=torch.float32), nbytes),
        "sum_local": (lambda: local_kv.sum(dtype=torch.float32), nbytes),
        "copy_from_peer": (lambda: dst.copy_(peer_view), 2 * nbytes),
        "copy_local": (lambda: dst.copy_(local_kv), 2 * nbytes),
    }
    for name, (fn, moved) in cases.items():
        ms = _time_ms(fn, reader, repeats)
        out[name] = {"ms": round(ms, 4), "GB_per_s": gbs(moved, ms)}
    out["peer_over_local_sum"] = round(out["sum_peer"]["GB_per_s"]
                                       / out["sum_local"]["GB_per_s"], 3)
    out["peer_over_local_copy"] = round(out["copy_from_peer"]["GB_per_s"]
                                        / out["copy_local"]["GB_per_s"], 3)


def run(gib: float, repeats: int, owner: int, reader: int, handle_mib: int) -> dict[str, Any]:
    import torch

    from kvvmm.arena import Arena
    from kvvmm.driver.cuda import CudaDriver

    nbytes = int(gib * (1 << 30)) // (handle_mib * MiB) * (handle_mib * MiB)
    elems = nbytes // 2
    for d in (owner, reader):
        torch.empty(1, device=f"cuda:{d}")
    d_owner, d_reader = CudaDriver(device=owner), CudaDriver(device=reader)
    if not d_owner.can_access_peer(reader):
        raise SystemExit(f"GPU {reader} cannot access GPU {owner}'s memory "
                         "(cuDeviceCanAccessPeer is 0): no peer path to measure")
    remote = Arena(d_owner, reserve_bytes=2 * nbytes, name="peer-kv")
    local = Arena(d_reader, reserve_bytes=2 * nbytes, name="local-kv")
    remote.grant_access([reader])
    r_off = remote.allocate(nbytes, "kv")
    l_off = local.allocate(nbytes, "kv")
    for arena, off in ((remote, r_off), (local, l_off)):
        for end in range(handle_mib * MiB, nbytes + 1, handle_mib * MiB):
            arena.commit(off, end)
    out: dict[str, Any] = {"bytes": nbytes, "handle_mib": handle_mib, "repeats": repeats}
    _measure(out, remote, r_off, local, l_off, elems, owner, reader, repeats)
    import gc

    gc.collect()  # the tensors are gone: the arenas can give their memory back
    remote.close()
    local.close()
    d_owner.close()
    d_reader.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="KV buffer size in GiB")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--owner", type=int, default=1, help="GPU whose memory holds the KV")
    ap.add_argument("--reader", type=int, default=0, help="GPU that reads it")
    ap.add_argument("--handle-mib", type=int, default=64, help="handle size (MiB)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    args = ap.parse_args(argv)
    n = _gpus()
    if n < 2:
        print(f"bench_peer needs 2 GPUs with a peer path; this machine has {n}. "
              "Nothing was measured (run it on a two-GPU machine, e.g. nvidia-h200-x2).",
              file=sys.stderr)
        return 2
    if args.owner == args.reader or max(args.owner, args.reader) >= n:
        print(f"--owner and --reader must be two different GPUs in [0, {n})", file=sys.stderr)
        return 2
    import torch

    import kvvmm

    result = run(args.gib, args.repeats, args.owner, args.reader, args.handle_mib)
    gpu = torch.cuda.get_device_name(args.reader)
    try:
        from cuda import bindings

        bindings_version = str(bindings.__version__)
    except Exception:
        bindings_version = "?"
    doc = {
        "env": {
            "gpu": gpu, "gpus": n, "owner": args.owner, "reader": args.reader,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_bindings": bindings_version, "kvvmm": kvvmm.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        },
        "peer_read": result,
    }
    print(json.dumps(doc, indent=1))
    os.makedirs(args.out, exist_ok=True)
    slug = gpu.lower().replace("nvidia ", "").replace(" ", "-")
    path = os.path.join(args.out, f"{slug}-x2-peer.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
