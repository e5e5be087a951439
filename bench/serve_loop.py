"""A small continuous-batching serving loop over a paged KV cache (issue #22's example), weights-free.

Prompts of mixed lengths are prefilled through flash_attn_varlen_func (causal, packed) and their K/V written
into scattered pages by append_kvcache; then each step decodes one token per active slot
(flash_attn_with_kvcache: append + attend), sequences that reach their generation length give their pages back
and new prompts join the free slots. The decode step runs eagerly and as a replayed CUDA graph, over a bf16 cache
and an fp8 one (where this build has it). Printed: median attention time per decode step (CUDA events around the
call or the replay alone; eager steps thus include the host's launch time wherever the GPU waits for it),
decode tokens/s, cache memory, and ||out - ref|| / ||ref|| against a float32 reference
computed from shadow copies of every token's K/V (independent of the cache).

    PYTHONPATH=python python3 bench/serve_loop.py                      # bf16 and fp8, eager and graph
    PYTHONPATH=python python3 bench/serve_loop.py --cache-dtype bf16 --no-graph --steps 50 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMPORT_ERROR = ""
try:
    import flashhopper as fh
    import torch
except ImportError as exc:  # CI without torch / the package: still importable, main() says why it stops
    IMPORT_ERROR = str(exc)

DEVICE = "cuda"     # a module constant so a test can run the bookkeeping on the CPU reference
SCRATCH_PAGE = 0     # idle slots point here: their (ignored) decode appends land in it, never in a live page
OUTLIERS = (3, 17, 66, 101)  # K channels with a large offset (real keys have a few): what stresses fp8 scales
OUTLIER_MAG = 20.0
# K's Hadamard transform for the fp8 cache: off (None). With one scale per token it costs accuracy rather than
# buying it (bench/kvcache_fp8_accuracy.py; docs/kvcache-fp8.md); --hadamard-seed turns it on.
HADAMARD_SEED: int | None = None


@dataclass
class Seq:
    prompt_len: int
    gen_len: int
    pages: list[int]
    generated: int = 0


def fp8_status(d: int) -> tuple[bool, str]:
    """Whether this build runs e4m3 caches here: one tiny call (a build without the kernel raises, saying what to
    rebuild with)."""
    try:
        k8, v8, ks, vs = fh.kvcache_fp8.quantize_kv_cache(*(torch.zeros(1, 16, 1, d, device=DEVICE),) * 2)
        q = torch.zeros(1, 1, 1, d, dtype=torch.bfloat16, device=DEVICE)
        fh.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=1, page_table=torch.zeros(1, 1, dtype=torch.int32,
                                   device=DEVICE), k_cache_scale=ks, v_cache_scale=vs)
    except (ValueError, TypeError, AttributeError, RuntimeError) as e:
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def make_cache(kind: str, pages: int, page: int, hkv: int, d: int, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any], int]:
    """(k_cache, v_cache, the extra kwargs of every call, bytes incl. scales)."""
    dtype = torch.bfloat16 if kind == "bf16" else torch.float8_e4m3fn
    k = torch.zeros(pages, page, hkv, d, dtype=dtype, device=DEVICE)
    v = torch.zeros_like(k)
    extra: dict[str, Any] = {}
    held = [k, v]
    if kind == "fp8":  # one float32 scale per (page, kv head, token)
        ks = torch.ones(pages, hkv, page, dtype=torch.float32, device=DEVICE)
        vs = torch.ones_like(ks)
        extra = {"k_cache_scale": ks, "v_cache_scale": vs, "hadamard_seed": HADAMARD_SEED}
        held += [ks, vs]
    return k, v, extra, sum(t.numel() * t.element_size() for t in held)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def run(args: argparse.Namespace, kind: str, graph: bool) -> dict[str, Any]:
    """One whole loop; the same seed gives eager and graph runs the same schedule and the same activations."""
    rng = random.Random(args.seed)
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    B, P, hq, hkv, d = args.max_batch, args.page_size, args.heads_q, args.heads_kv, args.headdim
    per_seq = math.ceil((args.prompt_lens[1] + args.gen_lens[1]) / P)  # pages of the longest sequence
    num_pages = args.pages or B * per_seq + 1
    k_cache, v_cache, extra, cache_bytes = make_cache(kind, num_pages, P, hkv, d, args.seed)
    outlier_idx = torch.tensor([c % d for c in OUTLIERS], device=DEVICE)

    def fill(x: torch.Tensor, outliers: bool = False) -> torch.Tensor:
        x.normal_(generator=gen)
        if outliers:
            x[..., outlier_idx] += OUTLIER_MAG
        return x

    free = list(range(num_pages))
    free.remove(SCRATCH_PAGE)
    seqs: list[Seq | None] = [None] * B
    host_lens = [0] * B
    # Device state the captured graph reads; changed in place only (never reallocated).
    table = torch.full((B, per_seq), SCRATCH_PAGE, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(B, dtype=torch.int32, device=DEVICE)
    active = torch.zeros(B, dtype=torch.int32, device=DEVICE)  # lens += active after each step: no host copy
    q = torch.zeros(B, 1, hq, d, dtype=torch.bfloat16, device=DEVICE)
    kn = torch.zeros(B, 1, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    vn = torch.zeros_like(kn)
    # float32 shadow of every token's K/V per slot: the reference never reads the cache.
    shadow_k = torch.zeros(B, per_seq * P, hkv, d, dtype=torch.float32, device=DEVICE)
    shadow_v = torch.zeros_like(shadow_k)
    slots = torch.arange(B, device=DEVICE)
    zero1 = torch.zeros(1, dtype=torch.int32, device=DEVICE)

    def step_call() -> torch.Tensor:
        return fh.flash_attn_with_kvcache(q, k_cache, v_cache, k=kn, v=vn, cache_seqlens=lens, page_table=table,
                                          causal=True, **extra)

    # Warm-up while every slot is idle (appends go to the scratch page only), on a side stream as capture wants.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step_call()
    torch.cuda.current_stream().wait_stream(side)
    decode: Callable[[], torch.Tensor] = step_call
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = step_call()

        def replay() -> torch.Tensor:  # the inputs are copied into q/kn/vn/lens/table in place beforehand
            g.replay()
            return static_out
        decode = replay

    def admit() -> list[int]:
        joined = []
        for s in range(B):
            if seqs[s] is not None:
                continue
            plen, glen = rng.randint(*args.prompt_lens), rng.randint(*args.gen_lens)
            need = math.ceil((plen + glen) / P)  # reserved up front: no preemption in this loop
            if need > len(free):
                break  # out of pages: wait for sequences to finish
            seqs[s] = Seq(plen, glen, [free.pop(rng.randrange(len(free))) for _ in range(need)])
            joined.append(s)
        return joined

    def prefill(joined: list[int]) -> tuple[float, float]:
        """Varlen prefill of the joiners, then their K/V appended into their pages; returns (ms, the largest
        difference between an attention call's last-query output over the pages and varlen's last row: the cache as
        written)."""
        plens = [seqs[s].prompt_len for s in joined]  # type: ignore[union-attr]
        cu_host = [0]
        for n in plens:
            cu_host.append(cu_host[-1] + n)
        cu = torch.tensor(cu_host, dtype=torch.int32, device=DEVICE)
        qp = fill(torch.empty(cu_host[-1], hq, d, dtype=torch.bfloat16, device=DEVICE))
        kp = fill(torch.empty(cu_host[-1], hkv, d, dtype=torch.bfloat16, device=DEVICE), outliers=True)
        vp = fill(torch.empty_like(kp))
        for s in joined:
            pages = seqs[s].pages  # type: ignore[union-attr]
            table[s].copy_(torch.tensor(pages + [SCRATCH_PAGE] * (per_seq - len(pages)), dtype=torch.int32))
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = fh.flash_attn_varlen_func(qp, kp, vp, cu, cu, max(plens), max(plens), causal=True)
        for i, s in enumerate(joined):  # each prompt's K/V into its pages, without attending
            a, b = cu_host[i], cu_host[i + 1]
            fh.append_kvcache(k_cache, v_cache, kp[a:b][None], vp[a:b][None], zero1, table[s:s + 1], **extra)
        e1.record()
        # The cache as written (untimed): the joiners' last queries over their pages, one call, against varlen's rows.
        ends = torch.tensor(cu_host[1:], device=DEVICE) - 1
        lasts = fh.flash_attn_with_kvcache(qp[ends][:, None], k_cache, v_cache,
                                           cache_seqlens=torch.tensor(plens, dtype=torch.int32, device=DEVICE),
                                           page_table=table[torch.tensor(joined, device=DEVICE)], causal=True, **extra)
        xerr = 0.0
        for i, s in enumerate(joined):
            a, b = cu_host[i], cu_host[i + 1]
            shadow_k[s, :b - a] = kp[a:b].float()
            shadow_v[s, :b - a] = vp[a:b].float()
            lens[s].fill_(b - a)
            active[s].fill_(1)
            host_lens[s] = b - a
            xerr = max(xerr, rel_err(lasts[i, 0], out[b - 1].float()))
        torch.cuda.synchronize()
        return e0.elapsed_time(e1), xerr

    def check(live: list[int], out: torch.Tensor) -> float:
        """Largest ||out - ref|| / ||ref|| over a few live slots, reference float32 over the shadow K/V."""
        pick = live[:args.check_slots]
        idx = torch.tensor(pick, device=DEVICE)
        seen = torch.tensor([host_lens[s] + 1 for s in pick], dtype=torch.int32, device=DEVICE)  # incl. the new token
        ref, _ = fh.attention_kvcache_ref(q[idx].float(), shadow_k[idx], shadow_v[idx], seen, causal=True,
                                          dtype=torch.float32)
        return max(rel_err(out[s], ref[i]) for i, s in enumerate(pick))

    timed: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
    prefill_ms, prefill_tokens, xerr, errs, finished = 0.0, 0, 0.0, [], 0
    for step in range(args.steps):
        joined = admit()
        if joined:
            ms, x = prefill(joined)
            prefill_ms, xerr = prefill_ms + ms, max(xerr, x)
            prefill_tokens += sum(seqs[s].prompt_len for s in joined)  # type: ignore[union-attr]
        live = [s for s in range(B) if seqs[s] is not None]
        fill(q)
        fill(kn, outliers=True)
        fill(vn)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = decode()
        e1.record()
        timed.append((e0, e1, len(live)))
        pos = lens.long()  # idle slots write their row 0: overwritten when a prompt joins there
        shadow_k[slots, pos] = kn[:, 0].float()
        shadow_v[slots, pos] = vn[:, 0].float()
        if live and ((args.check_every and step % args.check_every == 0) or step == args.steps - 1):
            errs.append(check(live, out))
        lens.add_(active)
        for s in live:
            seq = seqs[s]
            assert seq is not None
            host_lens[s] += 1
            seq.generated += 1
            if seq.generated == seq.gen_len:  # finished: pages back, slot idle (table row to scratch first)
                free.extend(seq.pages)
                table[s].fill_(SCRATCH_PAGE)
                lens[s].fill_(0)
                active[s].fill_(0)
                seqs[s] = None
                finished += 1
    torch.cuda.synchronize()
    step_ms = [a.elapsed_time(b) for a, b, _ in timed]
    tokens = sum(n for _, _, n in timed)
    return {"cache": kind, "mode": "graph" if graph else "eager", "steps": args.steps, "pages": num_pages,
            "median_us": statistics.median(step_ms) * 1e3, "decode_tokens": tokens,
            "tokens_per_s": tokens / (sum(step_ms) / 1e3), "cache_mib": cache_bytes / 2**20,
            "rel_err": max(errs) if errs else float("nan"), "prefill_ms": prefill_ms,
            "prefill_tokens": prefill_tokens, "prefill_xcheck": xerr, "finished": finished}


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"want MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return a, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=0, help="pages in the cache (default: every slot at its longest "
                    "sequence, plus the scratch page); fewer makes new prompts wait for pages")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--heads-q", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=16, help="decode slots")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-lens", type=span, default=(16, 1024), metavar="MIN:MAX")
    ap.add_argument("--gen-lens", type=span, default=(16, 160), metavar="MIN:MAX")
    ap.add_argument("--cache-dtype", choices=("bf16", "fp8", "both"), default="both")
    ap.add_argument("--no-graph", action="store_true", help="eager decode steps only")
    ap.add_argument("--hadamard-seed", type=int, default=None, help="fp8 cache: K's Hadamard transform (default off)")
    ap.add_argument("--check-every", type=int, default=50, help="accuracy check every N steps (0: last step only)")
    ap.add_argument("--check-slots", type=int, default=4, help="slots compared with the reference per check")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write the rows and the arguments there")
    args = ap.parse_args(argv)
    global HADAMARD_SEED
    HADAMARD_SEED = args.hadamard_seed
    per_seq = math.ceil((args.prompt_lens[1] + args.gen_lens[1]) / args.page_size)
    if args.pages and args.pages < per_seq + 1:
        ap.error(f"--pages {args.pages}: the longest sequence needs {per_seq} pages, plus the scratch page")
    if args.steps < 1 or args.max_batch < 1 or args.check_slots < 1:
        ap.error("--steps, --max-batch and --check-slots must be >= 1")
    if IMPORT_ERROR:
        print(f"serve_loop: cannot import torch/flashhopper ({IMPORT_ERROR}); nothing to run")
        return 0
    if not torch.cuda.is_available():
        print("serve_loop: needs a CUDA GPU and none is visible; nothing to run")
        return 0
    if not fh.has_extension():
        print(f"serve_loop: flashhopper's compiled extension is not built ({fh.extension_error()}); nothing to run "
              "(scripts/gpu.sh build)")
        return 0
    kinds = ["bf16", "fp8"] if args.cache_dtype == "both" else [args.cache_dtype]
    ok, why = fp8_status(args.headdim)
    if "fp8" in kinds and not ok:
        print(f"serve_loop: fp8 cache skipped: {why}")
        kinds.remove("fp8")
    print(f"{torch.cuda.get_device_name()}: {args.max_batch} slots, {args.heads_q}/{args.heads_kv} heads, d"
          f"{args.headdim}, pages of {args.page_size}, prompts {args.prompt_lens}, generations {args.gen_lens}")
    rows, failed = [], False
    with torch.no_grad():
        for kind in kinds:
            for graph in ([False] if args.no_graph else [False, True]):
                try:
                    rows.append(run(args, kind, graph))
                except Exception as e:  # noqa: BLE001  (a build without these kernels: said, the rest still run)
                    print(f"serve_loop: {kind} {'graph' if graph else 'eager'} failed: {type(e).__name__}: {e}")
                    failed = True
                torch.cuda.empty_cache()
    print("\n| cache | mode | steps | median attention us/step | tokens/s | cache MiB | rel err vs fp32 | "
          "prefill ms (tokens) | prefill x-check |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cache']} | {r['mode']} | {r['steps']} | {r['median_us']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['cache_mib']:.1f} | {r['rel_err']:.2e} | {r['prefill_ms']:.1f} ({r['prefill_tokens']}) | "
              f"{r['prefill_xcheck']:.2e} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "args": {
            k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()}, "results": rows}, indent=1))
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
