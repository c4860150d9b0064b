"""The committed H200 measurements of the owner's copy bandwidth after decode growth, as the
points the bandwidth model is fitted to (``bandwidth.growth`` of the shipped profile).

Each run is one ratio to cudaMalloc per growth policy. :func:`collect` reads every run from
the commit that added it (:data:`RUNS`; a clone with history) into :data:`COLLECTED`;
:func:`profile_section` makes the profile's section from that file: per policy, the ratios and
how the copied bytes lie over handle sizes, worked out by growing the same owner on the sim.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvvmm.errors import ArgumentError

#: The collected runs, inside the results folder.
COLLECTED = "h200-growth-bandwidth.json"

#: ``(commit, path)`` of every committed `kvvmm bench` run of the 64-buffer growth, oldest
#: first (git log --all -- 'bench/results/*.json', the files with a ``growth`` section).
RUNS: tuple[tuple[str, str], ...] = (
    ("855dd33", "bench/results/gpu-2026-11-29-run7.json"),
    ("855dd33", "bench/results/gpu-2026-11-29-run8.json"),
    ("855dd33", "bench/results/gpu-2026-11-29.json"),
    ("8fc8a4d", "bench/results/gpu-2026-11-29-cfast-try1.json"),
    ("8fc8a4d", "bench/results/gpu-2026-11-29-cfast-try2.json"),
    ("8fc8a4d", "bench/results/gpu-2026-11-29-cfast-a.json"),
    ("8fc8a4d", "bench/results/gpu-2026-11-29-cfast-b.json"),
    ("08eef41", "bench/results/gpu-2026-11-29-cfast-c.json"),
    ("8cb18bc", "bench/results/h200-kvvmm-bench.json"),
    ("764153a", "bench/results/h200-kvvmm-bench.json"),
    ("35240a9", "bench/results/h200-kvvmm-bench.json"),
)
#: The probe's rounds, read as committed.
PROBE = ("35240a9", "bench/results/h200-default-bandwidth.json")


def _git_json(repo: Path, commit: str, path: str) -> Any:
    text = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=repo, check=True,
                          capture_output=True, text=True).stdout
    return json.loads(text)


def collect(repo: Path) -> dict[str, Any]:
    """Every run's ratio by policy, with where it came from, read from the git history of
    the clone at ``repo`` (any folder inside it)."""
    by_policy: dict[str, list[dict[str, Any]]] = {}
    workload = None
    for commit, path in RUNS:
        data = _git_json(repo, commit, path)
        if workload is None:
            workload = data["workload"]
        if data["workload"] != workload:  # a run of another workload is not the same figure
            raise ArgumentError("run", f"{commit}:{path}", f"a run of workload {workload}")
        for g in data["growth"]:
            by_policy.setdefault(g["policy"], []).append(
                {"ratio": g["bandwidth"]["ratio"], "from": f"{commit}:{path}",
                 "date": data["date"]})
    probe = _git_json(repo, *PROBE)
    for policy, ratios in probe["ratios"].items():
        for i, r in enumerate(ratios):
            by_policy.setdefault(policy, []).append(
                {"ratio": r, "from": f"{PROBE[0]}:{PROBE[1]} round {i + 1}",
                 "date": probe["date"]})
    return {"what": "copy bandwidth of an owner's tensor after decode growth and finalize, "
                    "over that of a cudaMalloc tensor (kvvmm.bench._growth: the first GiB of "
                    "tensor 2 copied into tensor 3), one entry per run",
            "card": "NVIDIA H200", "workload": workload,
            "made_by": "kvvmm calibrate rebuild --collect (kvvmm.measure.growth_bandwidth)",
            "runs": by_policy}


def copied_mib(policy: Any, workload: dict[str, Any]) -> list[list[float]]:
    """How the bench's copied GiB lies over handles under ``policy``: ``[[handle MiB, MiB
    copied from handles of that size], ...]``, from the same growth on the sim driver."""
    from kvvmm.driver import open_driver
    from kvvmm.layout import mha_token_major
    from kvvmm.owner import KvBufferOwner
    from kvvmm.units import GiB, MiB

    w = workload
    descs = mha_token_major(layers=w["buffers"] // 2, kv_heads=w["kv_heads"],
                            head_dim=w["head_dim"], reserved_tokens=w["reserved_tokens"],
                            page_size=w["page_size"], dtype="bfloat16")
    owner = KvBufferOwner(driver=open_driver("sim", profile="h200"), dtype="bfloat16",
                          page_size=w["page_size"], reserved_tokens=w["reserved_tokens"],
                          descs=descs, policy=policy)
    try:
        for n in range(w["step_tokens"], w["grow_to_tokens"] + 1, w["step_tokens"]):
            owner.ensure_prefix(n)
        owner.finalize(w["finalize_tokens"])
        snap = owner.snapshot()
    finally:
        owner.close()
    lo = snap.buffers[2].offset  # the bench copies tensor 2's first GiB (into tensor 3's)
    hi = lo + GiB
    by_size: dict[int, int] = {}
    for m in snap.arena.mappings:
        if m.offset < hi and m.end > lo:
            by_size[m.size_bytes] = (by_size.get(m.size_bytes, 0)
                                     + min(m.end, hi) - max(m.offset, lo))
    return [[s / MiB, b / MiB] for s, b in sorted(by_size.items())]


def profile_section(collected: Mapping[str, Any]) -> dict[str, Any]:
    """The ``bandwidth.growth`` section of the H200 profile."""
    from kvvmm.policy import Chunked, Exact, Geometric, default_policy
    from kvvmm.units import MiB

    known = {str(p): p for p in (default_policy(), Exact(), Chunked(64 * MiB),
                                 Chunked(128 * MiB), Chunked(256 * MiB),
                                 Geometric(2.0, 256 * MiB))}
    points = {}
    for label, runs in collected["runs"].items():
        if label not in known:
            raise ArgumentError("policy", label, "one of " + ", ".join(known))
        points[label] = {"copied_mib": copied_mib(known[label], collected["workload"]),
                         "ratios": [r["ratio"] for r in runs]}
    n = sum(len(v) for v in collected["runs"].values())
    rounds = len({r["from"] for v in collected["runs"].values() for r in v
                  if " round " in r["from"]})
    return {"unit": "copy bandwidth of an owner's tensor over a cudaMalloc tensor's, one "
                    "entry per run; copied_mib: [[handle MiB, MiB of the copy in handles of "
                    "that size], ...]",
            "source": f"{n} ratios by policy from {len(RUNS)} kvvmm bench runs of the growth "
                      f"bandwidth and {rounds} rounds of its probe (probe_default_bandwidth.py) "
                      "on H200s, "
                      "2026-11-29 to 2026-12-01, collected with their commits in "
                      "bench/results/h200-growth-bandwidth.json by "
                      "kvvmm calibrate rebuild (kvvmm.measure.growth_bandwidth; "
                      "docs/MEASUREMENTS.md \u00a74)",
            "workload": "64 buffers of 2 KiB per token (32 layers, K and V), 64-token pages, "
                        "2,000,000 tokens reserved, grown by 4096-token decode steps to "
                        "500,000 tokens, finalized at 1,000,000; the first GiB of one buffer "
                        "copied",
            "points": points}
