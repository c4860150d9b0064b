"""What the interleaved layouts cost a *paged* attention kernel (issue 31, the bandwidth target).

torch's dense SDPA reads the interleaved layout at 0.95-0.96x of per-layer token-major
buffers (``probe_xl_sdpa.py``), and it cannot read a block-interleaved layout at all (no
flat ``(slots, heads, dim)`` view exists). What a serving engine runs on its KV cache is a
paged decode kernel that takes a page table and page / token / head strides (FlashInfer,
FlashAttention's ``flash_attn_with_kvcache``); neither is on the device. So this writes one,
in Triton (a split-K GQA decode kernel: each program reads a run of a sequence's pages for one
KV head, an online softmax, partials combined by a second kernel), and runs the SAME kernel
over three layouts of the same KV (``L`` layers, K and V, ``H`` heads of ``D``, bf16):

- ``token_major``: one buffer per layer, ``[slots][H][D]`` (SGLang's MHA pool);
- ``interleaved``: kvvmm's ``layer_interleaved``, ``[slots][L][2][H][D]`` (a token's row of a
  layer is ``H*D`` elements, the next token's ``L*2*H*D`` further on);
- ``block_interleaved``: ``[pages][L][2][P][H][D]`` (a page's ``P`` tokens of one layer are
  contiguous, ``P*H*D*2`` bytes: 32 KiB at P=16, as in a token-major page).

Each decode step reads every layer's K and V of every sequence (``B`` sequences of ``S``
tokens, pages in a random order, the same table for all layouts). Reported per layout: ms per
step (all layers, CUDA events, median of rounds), the KV read rate in TB/s, the ratio to
token_major; and the outputs' agreement with a torch reference (gather + softmax in fp32).

The copy benchmark's counterpart, paged (``copy_out`` / ``copy_in``): what offloading a
request's KV to a staging buffer and bringing it back does (an engine's page-transfer kernel,
as SGLang's hierarchical cache runs one per layer): every layer's K and V pages of the batch,
in the page table's order, copied to a contiguous ``[layer][k|v][page][P][H][D]`` buffer and
back, by ONE Triton kernel (a program per page and layer: ``P`` token rows of ``H*D``
elements) over each layout's strides. torch's ``Tensor.copy_`` over the same strided views is
the dense copy (0.39x on the token-interleaved layout, ``bench_elastic.py``): elementwise
kernels take a non-vectorized path on any strided source, which no cross-layer layout avoids.

    PYTHONPATH=$PWD python3 bench/probes/probe_xl_paged.py --out $OUT/h200-xl-paged.json
    TRITON_INTERPRET=1 python3 bench/probes/probe_xl_paged.py --cpu-check   # no GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - the device answers whether it has triton
    print(json.dumps({"refused": f"triton is not importable: {e}"}))
    sys.exit(0)


@triton.jit
def _decode_partial(q_ptr, k_ptr, v_ptr, table_ptr, m_out, l_out, acc_out,
                    stride_page, stride_tok, stride_head, scale,
                    pages_per_seq: tl.constexpr, pages_per_split: tl.constexpr,
                    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                    BLOCK_PAGES: tl.constexpr, NSPLIT: tl.constexpr, H: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    BN: tl.constexpr = BLOCK_PAGES * P
    rows = tl.arange(0, GP)
    dims = tl.arange(0, D)
    qmask = rows < G
    q = tl.load(q_ptr + ((b * H + h) * G + rows[:, None]) * D + dims[None, :],
                mask=qmask[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    n = tl.arange(0, BN)
    first = s * pages_per_split
    for jj in range(0, pages_per_split, BLOCK_PAGES):  # a multiple of BLOCK_PAGES
        j = first + jj + n // P
        ok = j < pages_per_seq
        page = tl.load(table_ptr + b * pages_per_seq + j, mask=ok, other=0).to(tl.int64)
        off = page * stride_page + (n % P).to(tl.int64) * stride_tok + h * stride_head
        k = tl.load(k_ptr + off[:, None] + dims[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + off[:, None] + dims[None, :], mask=ok[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k)) * scale
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = ((b * H + h) * NSPLIT + s) * GP + rows
    tl.store(m_out + o, m_i)
    tl.store(l_out + o, l_i)
    tl.store(acc_out + o[:, None] * D + dims[None, :], acc)


@triton.jit
def _decode_combine(m_in, l_in, acc_in, out_ptr, G: tl.constexpr, GP: tl.constexpr,
                    D: tl.constexpr, NSPLIT: tl.constexpr, H: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, GP)
    dims = tl.arange(0, D)
    m = tl.full([GP], float("-inf"), tl.float32)
    for s in range(NSPLIT):
        m = tl.maximum(m, tl.load(m_in + ((b * H + h) * NSPLIT + s) * GP + rows))
    den = tl.zeros([GP], tl.float32)
    num = tl.zeros([GP, D], tl.float32)
    for s in range(NSPLIT):
        o = ((b * H + h) * NSPLIT + s) * GP + rows
        ms = tl.load(m_in + o)
        w = tl.where(ms > float("-inf"), tl.exp(ms - m), 0.0)
        den += w * tl.load(l_in + o)
        num += w[:, None] * tl.load(acc_in + o[:, None] * D + dims[None, :])
    res = num / den[:, None]
    tl.store(out_ptr + ((b * H + h) * G + rows[:, None]) * D + dims[None, :],
             res.to(out_ptr.dtype.element_ty), mask=(rows < G)[:, None])


@triton.jit
def _page_copy(src_ptr, dst_ptr, table_ptr, s_layer, s_kv, s_page, s_tok, s_head,
               d_layer, d_kv, d_page, d_tok, d_head,
               P: tl.constexpr, H: tl.constexpr, D: tl.constexpr, TO_STAGE: tl.constexpr):
    """Program (i, l, kv): page ``table[i]`` of layer ``l``'s K (kv=0) or V (kv=1), between
    a layout (strides ``s_*``) and the staging buffer (``d_*``, its page index ``i``)."""
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    kv = tl.program_id(2).to(tl.int64)
    page = tl.load(table_ptr + i).to(tl.int64)
    hd = tl.arange(0, H * D)
    s_off = (hd // D) * s_head + hd % D
    d_off = (hd // D) * d_head + hd % D
    s_base = src_ptr + layer * s_layer + kv * s_kv + page * s_page
    d_base = dst_ptr + layer * d_layer + kv * d_kv + i.to(tl.int64) * d_page
    for t in range(P):
        if TO_STAGE:
            x = tl.load(s_base + t * s_tok + s_off)
            tl.store(d_base + t * d_tok + d_off, x)
        else:
            x = tl.load(d_base + t * d_tok + d_off)
            tl.store(s_base + t * s_tok + s_off, x)


def layer_strides(lv: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int, int, int,
                                                                        int, torch.Tensor]:
    """One layout's (layer, k|v, page, token, head) element strides, and its base tensor
    (layer 0's K): the views must be evenly spaced by layer and from K to V (all three
    layouts are: per-layer buffers are checked to be, else the copy refuses them)."""
    k0, v0 = lv[0]
    item = k0.element_size()
    s_kv = (v0.data_ptr() - k0.data_ptr()) // item
    s_layer = (lv[1][0].data_ptr() - k0.data_ptr()) // item if len(lv) > 1 else 0
    for li, (k, v) in enumerate(lv):
        if (k.data_ptr() - k0.data_ptr()) // item != li * s_layer or \
                (v.data_ptr() - k.data_ptr()) // item != s_kv or k.stride() != k0.stride():
            raise ValueError("layer views not evenly spaced: give one storage")
    return s_layer, s_kv, k0.stride(0), k0.stride(1), k0.stride(2), k0


def paged_copy(lv: list[tuple[torch.Tensor, torch.Tensor]], stage: torch.Tensor,
               table: torch.Tensor, *, to_stage: bool) -> None:
    """Every layer's K and V pages ``table`` (flat int32) between the layout's views ``lv``
    and ``stage`` (layers, 2, len(table), P, H, D), contiguous. One kernel launch."""
    s_layer, s_kv, s_page, s_tok, s_head, base = layer_strides(lv)
    _, p, h, d = base.shape
    n = table.numel()
    assert stage.is_contiguous() and stage.shape == (len(lv), 2, n, p, h, d), stage.shape
    st = stage.stride()
    _page_copy[(n, len(lv), 2)](base, stage, table, s_layer, s_kv, s_page, s_tok, s_head,
                                st[0], st[1], st[2], st[3], st[4], P=p, H=h, D=d,
                                TO_STAGE=to_stage)


def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, *,
                 nsplit: int = 4, block_pages: int = 4,
                 scratch: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """GQA decode over paged K/V: ``q`` (B, H, G, D); ``k``, ``v`` (pages, P, H, D) views with
    any page / token / head strides and a contiguous last dimension; ``table`` (B, pages per
    sequence) int32. Returns (B, H, G, D)."""
    bsz, heads, g, d = q.shape
    p = k.shape[1]
    assert k.stride(-1) == 1 and v.stride() == k.stride(), (k.stride(), v.stride())
    pps = table.shape[1]
    per_split = -(-pps // nsplit)
    per_split = -(-per_split // block_pages) * block_pages
    gp = max(16, triton.next_power_of_2(g))
    n = bsz * heads * nsplit * gp
    sc = scratch if scratch is not None else {}
    if sc.get("acc") is None or sc["acc"].numel() != n * d:
        sc["m"] = torch.empty(n, device=q.device, dtype=torch.float32)
        sc["l"] = torch.empty(n, device=q.device, dtype=torch.float32)
        sc["acc"] = torch.empty(n * d, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    _decode_partial[(bsz, heads, nsplit)](
        q, k, v, table, sc["m"], sc["l"], sc["acc"],
        k.stride(0), k.stride(1), k.stride(2), d ** -0.5,
        pages_per_seq=pps, pages_per_split=per_split,
        G=g, GP=gp, D=d, P=p, BLOCK_PAGES=block_pages, NSPLIT=nsplit, H=heads)
    _decode_combine[(bsz, heads)](sc["m"], sc["l"], sc["acc"], out, G=g, GP=gp, D=d,
                                  NSPLIT=nsplit, H=heads)
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              table: torch.Tensor) -> torch.Tensor:
    """The same attention by gathering pages and a softmax in fp32 (for the check)."""
    d = q.shape[-1]
    kk = k[table.long()].flatten(1, 2).float()  # (B, S, H, D)
    vv = v[table.long()].flatten(1, 2).float()
    s = torch.einsum("bhgd,bshd->bhgs", q.float(), kk) * d ** -0.5
    return torch.einsum("bhgs,bshd->bhgd", s.softmax(-1), vv).to(q.dtype)


def layouts(layers: int, heads: int, dim: int, page: int, pages: int, dtype: torch.dtype,
            device: str) -> dict[str, tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """The three layouts of the same KV: each its storage and per layer (K, V) paged views
    of shape (pages, page, heads, dim)."""
    slots = pages * page
    out: dict[str, tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
    # per-layer buffers, carved from one allocation ([layer][k|v][slots][H][D]) so one copy
    # kernel reaches every layer by a stride; each buffer is still SGLang's [slots][H][D]
    one = torch.empty(layers, 2, slots, heads, dim, dtype=dtype, device=device)
    tm = [(one[i, 0], one[i, 1]) for i in range(layers)]
    out["token_major"] = (tm, [(k.view(pages, page, heads, dim), v.view(pages, page, heads, dim))
                               for k, v in tm])
    il = torch.empty(slots, layers, 2, heads, dim, dtype=dtype, device=device)
    pv = il.view(pages, page, layers, 2, heads, dim)
    out["interleaved"] = (il, [(pv[:, :, i, 0], pv[:, :, i, 1]) for i in range(layers)])
    bl = torch.empty(pages, layers, 2, page, heads, dim, dtype=dtype, device=device)
    out["block_interleaved"] = (bl, [(bl[:, i, 0], bl[:, i, 1]) for i in range(layers)])
    return out


def fill_same(views: dict[str, tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]],
              seed: int) -> None:
    """Every layout holds the same K and V, layer by layer (from the token-major copy)."""
    torch.manual_seed(seed)
    base = views["token_major"][1]
    for k, v in base:
        k.normal_()
        v.normal_()
    for name, (_, lv) in views.items():
        if name != "token_major":
            for (k, v), (k0, v0) in zip(lv, base, strict=True):
                k.copy_(k0)
                v.copy_(v0)


def cpu_check() -> int:
    """Under TRITON_INTERPRET=1: the kernel equals the reference on every layout (tiny)."""
    torch.manual_seed(0)
    layers, heads, g, dim, page, pages, bsz = 3, 2, 4, 32, 16, 12, 2
    views = layouts(layers, heads, dim, page, pages, torch.float32, "cpu")
    fill_same(views, 1)
    table = torch.stack([torch.randperm(pages)[:5] for _ in range(bsz)]).to(torch.int32)
    q = torch.randn(bsz, heads, g, dim)
    worst = 0.0
    for name, (_, lv) in views.items():
        for k, v in lv:
            got = paged_decode(q, k, v, table, nsplit=2, block_pages=2)
            want = reference(q, k, v, table)
            worst = max(worst, float((got - want).abs().max()))
        print(name, "ok", f"max |err| {worst:.2e}")
    flat = table.flatten()
    want = torch.stack([torch.stack([k[flat.long()], v[flat.long()]])
                        for k, v in views["token_major"][1]])
    copies_ok = True
    for name, (_, lv) in views.items():
        stage = torch.zeros_like(want)
        paged_copy(lv, stage, flat, to_stage=True)
        out_ok = torch.equal(stage, want)
        for k, v in lv:
            k.zero_()
            v.zero_()
        paged_copy(lv, stage, flat, to_stage=False)
        back = torch.stack([torch.stack([k[flat.long()], v[flat.long()]]) for k, v in lv])
        in_ok = torch.equal(back, want)
        print(name, "copy out", "ok" if out_ok else "WRONG", "copy in", "ok" if in_ok else "WRONG")
        copies_ok &= out_ok and in_ok
        if name == "token_major":  # the others are filled from it
            fill_same(views, 1)
    return 0 if worst < 1e-3 and copies_ok else 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = "cuda"
    dtype = torch.bfloat16
    pages_per_seq = args.tokens // args.page
    pages = pages_per_seq * args.batch
    views = layouts(args.layers, args.kv_heads, args.dim, args.page, pages, dtype, dev)
    fill_same(views, 1)
    gen = torch.Generator(device="cpu").manual_seed(2)
    table = torch.randperm(pages, generator=gen).view(args.batch, pages_per_seq)
    table = table.to(torch.int32).to(dev)
    g = args.q_heads // args.kv_heads
    q = torch.randn(args.batch, args.kv_heads, g, args.dim, device=dev, dtype=dtype)
    scratch: dict[str, torch.Tensor] = {}
    check: dict[str, float] = {}
    for name, (_, lv) in views.items():  # agreement, layer 0 and the last
        for li in (0, args.layers - 1):
            k, v = lv[li]
            got = paged_decode(q, k, v, table, nsplit=args.nsplit, scratch=scratch)
            want = reference(q, k, v, table)
            check[f"{name}:{li}"] = round(float((got.float() - want.float()).abs().max()), 5)
    per_step = args.batch * args.tokens * args.layers * 2 * args.kv_heads * args.dim * 2

    def step(lv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for k, v in lv:
            paged_decode(q, k, v, table, nsplit=args.nsplit, scratch=scratch)

    times: dict[str, list[float]] = {n: [] for n in views}
    for _, lv in views.values():  # warm-up (compiles once per stride set)
        for _ in range(3):
            step(lv)
    torch.cuda.synchronize()
    order = list(views)
    for r in range(args.rounds):  # rotated: no layout always first after another
        for n in order[r % 3:] + order[: r % 3]:
            lv = views[n][1]
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(args.reps):
                step(lv)
            e1.record()
            e1.synchronize()
            times[n].append(e0.elapsed_time(e1) / args.reps)
    res: dict[str, Any] = {}
    base = statistics.median(times["token_major"])
    for n, ts in times.items():
        ms = statistics.median(ts)
        res[n] = {"ms_per_step": round(ms, 4), "read_tb_s": round(per_step / (ms / 1e3) / 1e12, 3),
                  "vs_token_major": round(base / ms, 4),
                  "rounds_ms": [round(t, 4) for t in ts]}
    copies = time_copies(views, table.flatten(), args.rounds, args.reps)
    return {
        "benchmark": "probe_xl_paged", "card": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "config": {k: getattr(args, k) for k in ("layers", "kv_heads", "q_heads", "dim", "page",
                                                   "batch", "tokens", "nsplit", "rounds",
                                                   "reps")},
        "kv_bytes_read_per_step": per_step, "results": res, "max_abs_err_vs_reference": check,
        "paged_copy": copies,
    }


def time_copies(views: dict[str, tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]],
                flat: torch.Tensor, rounds: int, reps: int) -> dict[str, Any]:
    """Every layer's K and V pages of the batch out to a staging buffer and back in, per
    layout (one kernel each way), checked equal to the token-major layout's pages; ms per
    copy, moved rate (read + written) and the ratio to token_major."""
    lv0 = views["token_major"][1]
    _, p, h, d = lv0[0][0].shape
    n = flat.numel()
    stage = torch.empty(len(lv0), 2, n, p, h, d, dtype=lv0[0][0].dtype, device=flat.device)
    want = torch.empty_like(stage)
    paged_copy(lv0, want, flat, to_stage=True)
    same: dict[str, bool] = {}
    for name, (_, lv) in views.items():
        paged_copy(lv, stage, flat, to_stage=True)
        same[f"{name}:out"] = bool(torch.equal(stage, want))
        paged_copy(lv, want, flat, to_stage=False)  # writes back what it holds: unchanged
        paged_copy(lv, stage, flat, to_stage=True)
        same[f"{name}:in"] = bool(torch.equal(stage, want))
    moved = 2 * stage.numel() * stage.element_size()
    times: dict[str, list[float]] = {f"{n}:{w}": [] for n in views for w in ("out", "in")}
    order = list(views)
    for r in range(rounds):
        for name in order[r % 3:] + order[: r % 3]:
            lv = views[name][1]
            for way in ("out", "in"):
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(reps):
                    paged_copy(lv, stage, flat, to_stage=way == "out")
                e1.record()
                e1.synchronize()
                times[f"{name}:{way}"].append(e0.elapsed_time(e1) / reps)
    out: dict[str, Any] = {"bytes_moved_per_copy": moved, "equal_to_token_major": same}
    for key, ts in times.items():
        name, way = key.split(":")
        ms = statistics.median(ts)
        base = statistics.median(times[f"token_major:{way}"])
        out[key] = {"ms": round(ms, 4), "moved_tb_s": round(moved / (ms / 1e3) / 1e12, 3),
                    "vs_token_major": round(base / ms, 4), "rounds_ms": [round(t, 4) for t in ts]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096, help="per sequence")
    ap.add_argument("--nsplit", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="h200-xl-paged.json")
    args = ap.parse_args()
    if args.cpu_check:
        return cpu_check()
    data = run(args)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    print(json.dumps(data["results"], indent=1))
    print(json.dumps(data["max_abs_err_vs_reference"]))
    print(json.dumps({k: v for k, v in data["paged_copy"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
