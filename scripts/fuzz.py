#!/usr/bin/env python3
"""Fuzz every public entry point of this build against the reference, over random configurations.

    python scripts/fuzz.py --count 2000 --json $OUT/fuzz.json   # the device run, a few minutes on an H100
    python scripts/fuzz.py --seed S --index I                    # replay one configuration, described in full
    python scripts/fuzz.py --cpu-smoke                           # a few tiny configurations on CPU (the reference)

(flashhopper must be importable: scripts/gpu.sh puts python/ on PYTHONPATH; --minutes M stops starting new
configurations after M minutes, --quiet prints failures and progress only.) A run draws half of its
configurations from FIXED_SEEDS and half from a random seed it prints. Each configuration is drawn from
(seed, index) alone, so the line printed with a failure replays it. It names an entry point family
(FAMILIES), a dtype and head dim of the build, batch (up to 512), seqlen_q and seqlen_k (0 to 16k; odd
values and the edges of the build's tiles favoured), a GQA ratio (up to 32), causal or not, sometimes a
softmax_scale, and where each input sits in memory: contiguous, transposed storage ((b, h, s, d)
.transpose(1, 2)), padded strides, a storage offset, or q, k, v split from one packed tensor; every byte
around an input is NaN, so a kernel that reads outside it shows. Batch, kv heads or GQA ratio are halved
until batch x nheads_q x seqlen_q x seqlen_k is within --budget, which bounds the reference's work, and
every tensor within MAX_ELEMENTS (out-of-memory is caught and counted as a skip all the same).

Checks: 16-bit results by tests/helpers.py (FA3's criterion, assert_matches_reference and
assert_grads_match), the forward and the gradients of a random dout (sometimes with a dlse; where the
criterion fails on bounds, again with its baseline widened to a FlashAttention-style emulation of the
backward's roundings: judge_grads); fp8
results within the project's fp8 bound of exact attention (tests/test_fp8_gpu.py REF_REL, which
scripts/check_fwd.py's FP8_LIMIT repeats; over MIN_FP8_ROWS query rows where the sizes allow), their lse
within REF8_LSE_ATOL of the fp8 reference on the same quantized tensors. Outputs are poisoned: during
the run torch.empty fills with NaN (torch's deterministic mode with fill_uninitialized_memory), so an
output an entry point allocates and leaves partly unwritten shows; the lower-layer families (ops,
ops-window, fp8-into) write into NaN views of buffers whose other bytes hold SENTINEL, which must be
unchanged afterwards (no write out of bounds).
A kernel the build was configured with and lacks fails; a family the build lacks is skipped, and the
summary says why. A failed configuration is listed with its replay command; exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the criteria and their bounds

from flashhopper import _ext, dispatch, flash_attn_fp8_func, flash_attn_func, fp8, ops, quantize_kv
from flashhopper.kernel_key import BUILD_DTYPES, KernelKey, normalize_window
from flashhopper.reference import attention_ref
from flashhopper.reference_fp8 import attention_fp8_ref

import helpers
from helpers import assert_dsinks_match, assert_grads_match, assert_matches_reference, control_ratio, max_abs_err, rel_err, unconfigured
from test_fp8_gpu import REF8_LSE_ATOL, REF_REL, quantize_qkv

# name: (what it runs, weight: its share of the configurations)
FAMILIES: dict[str, tuple[str, int]] = {
    "dense": ("flash_attn_func, auto backend (sm90 on Hopper): forward + backward", 2),
    "sm80": ("flash_attn_func(backend='sm80'): forward + backward", 2),
    "deterministic": ("flash_attn_func(deterministic=True): backward twice, bitwise equal", 1),
    "variants": ("flash_attn_func with window_size / softcap / sinks: forward + backward (sinks too)", 2),
    "fp8": ("flash_attn_fp8_func on bf16/fp16 q, k, v (quantized inside)", 1),
    "fp8-prequantized": ("flash_attn_fp8_func on FP8Tensors (quantize_fp8; strided data)", 1),
    "fp8-into": ("fp8.fwd_fp8_into into guarded out and lse", 1),
    "kv-attend": ("quantize_kv(k, v).attend(q)", 1),
    "ops": ("ops.fwd_into / bwd_into, masks none/causal, variants: guarded outputs", 2),
    "ops-window": ("ops.fwd_into / bwd_into with window kernels: guarded outputs", 2),
}
API_FAMILIES = ("dense", "sm80", "deterministic", "variants")
FP8_FAMILIES = ("fp8", "fp8-prequantized", "fp8-into", "kv-attend")
OPS_FAMILIES = ("ops", "ops-window")
# Families in turn, each as often as its weight: configuration i of a seed is of FAMILY_CYCLE[i % len].
FAMILY_CYCLE: tuple[str, ...] = tuple(f for f, (_, w) in FAMILIES.items() for _ in range(w))

FIXED_SEEDS = (1, 17, 4099)  # half of every run, the same configurations each time; the other half is random
DEFAULT_COUNT = 2000
# Score elements (batch x nheads_q x seqlen_q x seqlen_k) per configuration. The reference materializes the
# scores (float64 for the forward check, float32 for the gradients), some 0.2 ns per element on an H100 by
# estimate; the sampled configurations average 4% of the budget, and most time goes to small ones.
DEFAULT_BUDGET = 1 << 31
MAX_ELEMENTS = 1 << 26  # per tensor (batch x nheads x seqlen x headdim): the reference's copies stay < 1 GB
MAX_SEQLEN, MAX_BATCH, MAX_NHEADS_KV, MAX_GROUP = 16384, 512, 16, 32
# fp8's bound is a relative norm error measured on the tests' grid; over a few query rows one row's scatter
# passes it (emulated, head dim 128: up to 8.8e-2 for one row, 6.6e-2 over 8, 5.6e-2 over 16 or more).
MIN_FP8_ROWS = 64
# --cpu-smoke: configurations 0 to count - 1 of the first fixed seed, small enough for a loaded CPU.
SMOKE = {"count": 2 * len(FAMILY_CYCLE), "budget": 1 << 13, "max_seqlen": 80, "max_elements": 1 << 15}
FP8_INPUT_DTYPES = (torch.bfloat16, torch.float16)
UNIT = 16  # bytes: pointers and strides of kernel operands are multiples of it (TMA)
NAN_BYTE = 0xFF  # NaN as bf16, fp16, float32 and e4m3: what lies around every input
SENTINEL = 0x5A  # what lies around every guarded output; a number in each float format, written by no one
SMEM_99K = 99 * 1024  # sm80's tiles for sm_86/sm_89's shared memory (as tests/test_fwd_gpu.py runs them)


# --- what runs here ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """What the configurations are drawn from and run on: this build and device, or --cpu-smoke's tiny set."""
    device: torch.device
    dtypes: tuple[torch.dtype, ...]  # 16-bit kernel dtypes
    headdims: tuple[int, ...]
    archs: tuple[int, ...]  # kernel families that run here (90, 80); () with --cpu-smoke: the reference stands in
    bwd: bool  # backward kernels built
    lengths: tuple[int, ...]  # drawn often: 0 to 3, the tiles' edges, the largest
    max_seqlen: int
    max_elements: int  # per tensor
    variants: dict[tuple[str, KernelKey], tuple[str, ...]]  # (mode, production key) -> named variants built
    families: tuple[str, ...]  # the ones that run
    not_run: dict[str, str]  # family -> why not
    notes: tuple[str, ...]
    windows: bool = True  # window kernels built (the variants family draws windows only then)
    softcap: bool = True  # softcap kernels built (likewise)

    @property
    def native(self) -> str | None:
        """The kernel family auto-dispatch picks here."""
        return None if not self.archs else ("sm90" if 90 in self.archs else "sm80")


def edge_lengths(tiles: Sequence[int], max_seqlen: int) -> tuple[int, ...]:
    near = {m * t + e for t in tiles for m in (1, 2, 3) for e in (-1, 0, 1)}
    return tuple(sorted(n for n in near | {0, 1, 2, 3, max_seqlen - 1, max_seqlen} if 0 <= n <= max_seqlen))


def device_target() -> Target:
    """The build's dtypes, head dims, kernel families and masks on this GPU; why a family cannot run."""
    info = _ext.build_info()
    if not info:
        raise SystemExit(f"flashhopper has no compiled extension here ({_ext.extension_error()}): nothing to fuzz")
    cap = torch.cuda.get_device_capability()
    gpu = f"{torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]})"
    archs = tuple(a for a in (90, 80) if a in info["archs"] and dispatch.runs_on(f"sm{a}", cap))
    dtypes = tuple(getattr(torch, BUILD_DTYPES[d]) for d in info["dtypes"] if d != "e4m3")
    bwd = "bwd" in info["modes"]
    kernels = _ext.compiled_kernels()
    variants: dict[tuple[str, KernelKey], list[str]] = {}
    for k in kernels:
        if k["variant"]:
            key = KernelKey(k["arch"], k["dtype"], k["headdim"], k["headdim_v"], k["mask"])
            variants.setdefault((k["mode"], key), []).append(k["variant"])
    not_run: dict[str, str] = {}
    if not archs:
        for family in API_FAMILIES + OPS_FAMILIES:
            not_run[family] = f"no kernel family of the build (FLASHHOPPER_ARCHS {info['archs']}) runs on {gpu}"
    elif not dtypes:
        for family in API_FAMILIES + OPS_FAMILIES:
            not_run[family] = f"the build has no 16-bit dtype (FLASHHOPPER_DTYPES {info['dtypes']})"
    if "sm80" not in not_run and 80 not in archs:
        not_run["sm80"] = ("the build has no sm80 kernels (FLASHHOPPER_ARCHS without 80)" if 80 not in info["archs"]
                           else f"sm80 kernels do not run on {gpu}")
    if "deterministic" not in not_run and not bwd:
        not_run["deterministic"] = "the build has no backward kernels (FLASHHOPPER_MODES without bwd)"
    if "ops-window" not in not_run and "window" not in info["masks"]:
        not_run["ops-window"] = "the build has no window kernels (FLASHHOPPER_MASKS without window)"
    fp8_why = ("the build has no fp8 kernels (FLASHHOPPER_DTYPES without e4m3)" if "e4m3" not in info["dtypes"]
               else "" if 90 in archs else f"the fp8 kernels are sm_90a code: the build has no arch 90 or {gpu} "
               "cannot run it")
    if fp8_why:
        for family in FP8_FAMILIES:
            not_run[family] = fp8_why
    notes = []
    if not bwd:
        notes.append("no backward kernels in the build: the flash_attn_func and ops families run the forward only")
    if "e4m3" in info["dtypes"] and "window" in info["masks"]:
        notes.append("the build's fp8 window kernels are reachable from no public entry point (fp8 takes no window)")
    return Target(torch.device("cuda", torch.cuda.current_device()), dtypes, tuple(info["headdims"]), archs, bwd,
                  edge_lengths(sorted({k[t] for k in kernels for t in ("block_m", "block_n")}), MAX_SEQLEN),
                  MAX_SEQLEN, MAX_ELEMENTS, {key: tuple(v) for key, v in variants.items()},
                  tuple(f for f in FAMILIES if f not in not_run), not_run, tuple(notes),
                  "window" in info["masks"], "softcap" in info.get("score_mods", ()))


def smoke_target() -> Target:
    """Tiny configurations on CPU: the reference runs where the kernels would (flash_attn_func's backend
    "reference", the fp8 ops' CPU emulation, the reference ops writing into the guarded views)."""
    max_seqlen = SMOKE["max_seqlen"]
    return Target(torch.device("cpu"), (torch.bfloat16, torch.float16), (64, 128), (), True,
                  edge_lengths((64,), max_seqlen), max_seqlen, SMOKE["max_elements"], {}, tuple(FAMILIES), {},
                  ("--cpu-smoke: the reference stands in for every kernel",))


# --- configurations -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Where a tensor sits in its buffer, in 16-byte units: its last dim contiguous, the others stored in
    ``order`` (outermost first; None: natural), each stride padded by ``pads`` (of ``order``'s dims), with
    ``front`` and ``back`` margins (a storage offset, and room after)."""
    order: tuple[int, ...] | None = None
    pads: tuple[int, ...] | None = None
    front: int = 0
    back: int = 0

    def __str__(self) -> str:
        parts = []
        if self.order is not None and self.order != tuple(sorted(self.order)):
            parts.append("order" + "".join(map(str, self.order)))
        if self.pads and any(self.pads):
            parts.append("pad" + ".".join(map(str, self.pads)))
        if self.front or self.back:
            parts.append(f"margin{self.front}/{self.back}")
        return ",".join(parts) or "contiguous"


@dataclass(frozen=True)
class Config:
    seed: int
    index: int
    family: str
    data_seed: int  # torch.manual_seed of the inputs
    dtype: torch.dtype  # of q, k, v (bf16/fp16 also for the fp8 families, which quantize them)
    headdim: int
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads_kv: int
    group: int  # GQA ratio: nheads_q = group * nheads_kv
    causal: bool
    softmax_scale: float | None
    packed: bool  # q, k, v split along heads from one (b, s, nheads_q + 2 nheads_kv, d) tensor at layouts[0]
    layouts: tuple[Layout, Layout, Layout]  # q, k, v (their fp8 data in fp8-prequantized / fp8-into)
    backend: str | None = None  # flash_attn_func's
    arch: int | None = None  # ops families' kernel family; None: the reference stands in (--cpu-smoke)
    deterministic: bool = False
    use_dlse: bool = False  # the loss uses lse too
    dout_layout: Layout = Layout()
    out_layouts: tuple[Layout, ...] = ()  # guarded outputs: out, lse[, dq, dk, dv]
    window: tuple[int, int] | None = None
    variant: str = ""
    bwd_variant: str = ""
    max_smem_bytes: int = 0
    hadamard_seed: int | None = None  # fp8: Q and K's Hadamard signs (None: no transform)
    granularity: tuple[str, str, str] = ("block", "block", "block")  # fp8 scales of q, k, v
    v_row_major: bool = False  # fp8: V handed over as (b, s, h, d), brought to V^T on the way
    q_prequantized: bool = False  # kv-attend: q an FP8Tensor too
    softcap: float = 0.0  # variants: flash_attn_func's softcap
    sinks: bool = False  # variants: random sink logits (nheads_q,), drawn from data_seed after q, k, v

    @property
    def nheads_q(self) -> int:
        return self.group * self.nheads_kv

    @property
    def scale(self) -> float:
        return 1 / math.sqrt(self.headdim) if self.softmax_scale is None else self.softmax_scale

    def summary(self) -> str:
        """One line: the sizes, then what differs from the plain case."""
        parts = [self.family, str(self.dtype).removeprefix("torch."), f"d{self.headdim}", f"b{self.batch}",
                 f"sq{self.seqlen_q}", f"sk{self.seqlen_k}", f"h{self.nheads_q}/{self.nheads_kv}",
                 "causal" if self.causal else "full"]
        if self.softmax_scale is not None:
            parts.append(f"scale={self.softmax_scale:.4g}")
        if self.packed:
            parts.append(f"packed[{self.layouts[0]}]")
        else:
            parts += [f"{n}[{lay}]" for n, lay in zip("qkv", self.layouts) if str(lay) != "contiguous"]
        for name in ("backend", "arch", "window", "softcap", "variant", "bwd_variant", "max_smem_bytes"):
            value = getattr(self, name)
            if value not in (None, "", 0):
                parts.append(f"{name}={value}")
        parts += [flag for flag, on in (("sinks", self.sinks), ("deterministic", self.deterministic), ("dlse", self.use_dlse),
                                        ("v-row-major", self.v_row_major), ("q-fp8", self.q_prequantized)) if on]
        if self.family in FP8_FAMILIES:
            parts.append(f"hadamard={self.hadamard_seed}")
            if self.granularity != ("block",) * 3:
                parts.append("scales=" + "/".join(self.granularity))
        return " ".join(parts)

    def describe(self) -> str:
        """Every field, one per line (a replayed configuration)."""
        return "\n".join(f"  {f.name} = {getattr(self, f.name)!s}" for f in dataclasses.fields(self))


def log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, int(2 ** rng.uniform(math.log2(lo), math.log2(hi + 1))))


def sample_length(rng: random.Random, target: Target) -> int:
    """0 to max_seqlen: an edge value (35%), else log-uniform, made odd 3 times in 4."""
    if rng.random() < 0.35:
        return rng.choice(target.lengths)
    n = log_uniform_int(rng, 1, target.max_seqlen)
    return min(n | 1, target.max_seqlen) if rng.random() < 0.75 else n


def sample_layout(rng: random.Random, guard: bool = False) -> Layout:
    """A (b, s, h, d) tensor's place: contiguous, transposed ((b, h, s, d) storage) or padded strides;
    margins small or up to 1 MB, at least one unit on each side of a guarded output."""
    kind = rng.choices(("contiguous", "transposed", "padded"), (2, 1, 1))[0]
    order = (0, 2, 1) if kind == "transposed" else (0, 1, 2)
    pads = tuple(rng.choice((0, 1, 3)) for _ in range(3)) if kind == "padded" else (0, 0, 0)

    def margin() -> int:
        return rng.randint(int(guard), 3) if rng.random() < 0.8 else rng.randint(1 << 10, 1 << 16)

    return Layout(order, pads, margin(), margin())


def sample_margins(rng: random.Random, guard: bool = False) -> Layout:
    """A contiguous tensor (lse, dlse) at an offset in its buffer."""
    return Layout(front=rng.randint(int(guard), 3), back=rng.randint(int(guard), 3))


def fit(rng: random.Random, batch: int, nheads_kv: int, group: int, seqlen_q: int, seqlen_k: int, headdim: int,
        budget: int, max_elements: int, packed: bool) -> tuple[int, int, int, int, int]:
    """Halve batch, kv heads or GQA ratio (one at random) until the score elements are within ``budget``
    and every tensor within ``max_elements``; the lengths, the interesting part, only when those are all 1."""
    while True:
        heads = batch * group * nheads_kv
        if (heads * max(seqlen_q, 1) * max(seqlen_k, 1) <= budget
                and heads * max(seqlen_q, seqlen_k, 1) * headdim <= max_elements):
            return batch, nheads_kv, group, seqlen_q, seqlen_k
        cuttable = [i for i, n in enumerate((batch, nheads_kv, group)) if n > 1]
        if cuttable:
            sizes = [batch, nheads_kv, group]
            i = rng.choice(cuttable)
            sizes[i] = (sizes[i] + 1) // 2
            batch, nheads_kv, group = sizes
        elif packed or seqlen_q == seqlen_k:
            seqlen_q = seqlen_k = (seqlen_q + 1) // 2
        elif seqlen_q > seqlen_k:
            seqlen_q = (seqlen_q + 1) // 2
        else:
            seqlen_k = (seqlen_k + 1) // 2


def fp8_batch(batch: int, nheads_q: int, seqlen_q: int, seqlen_k: int, headdim: int, budget: int,
              max_elements: int) -> int:
    """A batch large enough for MIN_FP8_ROWS query rows, as far as budget and max_elements allow; empty
    shapes stay as they are."""
    rows = nheads_q * seqlen_q
    if batch * rows * seqlen_k == 0 or batch * rows >= MIN_FP8_ROWS:
        return batch
    most = min(MAX_BATCH, budget // (rows * seqlen_k), max_elements // (nheads_q * max(seqlen_q, seqlen_k) * headdim))
    return max(batch, min(-(-MIN_FP8_ROWS // rows), most))


def sample_window(rng: random.Random, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """flash-attn's (left, right), -1 unbounded, never both: 0, a short odd reach, or one past the sequences."""
    def edge() -> int:
        far = log_uniform_int(rng, 1, 2 * max(seqlen_q, seqlen_k) + 2)
        return rng.choice((-1, -1, 0, rng.randint(1, 200) | 1, far))

    left, right = edge(), edge()
    if left == right == -1:
        left = rng.randint(0, 300)
    return left, right


def pick_variant(rng: random.Random, target: Target, mode: str, key: KernelKey) -> str:
    """A named variant of the build for this kernel, one time in three (else production)."""
    names = target.variants.get((mode, key), ())
    return rng.choice(names) if names and rng.random() < 1 / 3 else ""


def sample_hadamard_seed(rng: random.Random) -> int | None:
    return rng.choice((None, 0, 3, rng.getrandbits(64), -rng.getrandbits(63)))


def sample(seed: int, index: int, target: Target, budget: int) -> Config:
    """Configuration ``index`` of ``seed``: a function of those two (and the target and budget) alone."""
    rng = random.Random(f"{seed}/{index}")
    cycle = [f for f in FAMILY_CYCLE if f in target.families]
    family = cycle[index % len(cycle)]
    data_seed = rng.getrandbits(63)
    is_fp8 = family in FP8_FAMILIES
    dtype = rng.choice(FP8_INPUT_DTYPES if is_fp8 else target.dtypes)
    headdim = rng.choice(target.headdims)
    # fp8-prequantized / fp8-into place the quantized data, which is made per tensor.
    packed = family not in ("fp8-prequantized", "fp8-into") and rng.random() < 0.2
    seqlen_q = sample_length(rng, target)
    seqlen_k = seqlen_q if packed else sample_length(rng, target)
    batch = 0 if rng.random() < 0.02 else log_uniform_int(rng, 1, MAX_BATCH)
    nheads_kv = log_uniform_int(rng, 1, MAX_NHEADS_KV)
    group = 1 if rng.random() < 0.4 else log_uniform_int(rng, 2, MAX_GROUP)
    batch, nheads_kv, group, seqlen_q, seqlen_k = fit(rng, batch, nheads_kv, group, seqlen_q, seqlen_k, headdim,
                                                      budget, target.max_elements, packed)
    if is_fp8:
        batch = fp8_batch(batch, group * nheads_kv, seqlen_q, seqlen_k, headdim, budget, target.max_elements)
    causal = rng.random() < 0.5
    # fp8's bound was measured at scales up to the default; the 16-bit criterion is relative to PyTorch's error.
    span = (-1.0, 0.0) if is_fp8 else (-3.0, 2.0)
    softmax_scale = 2 ** rng.uniform(*span) / math.sqrt(headdim) if rng.random() < 0.3 else None
    layouts = (sample_layout(rng), sample_layout(rng), sample_layout(rng))
    base = Config(seed, index, family, data_seed, dtype, headdim, batch, seqlen_q, seqlen_k, nheads_kv, group, causal,
                  softmax_scale, packed, layouts)

    if family in API_FAMILIES:
        backend: str | None
        if not target.archs:
            backend = "reference"
        elif family == "sm80":
            backend = "sm80"
        elif family == "deterministic" and 80 in target.archs and 90 in target.archs:
            backend = rng.choice((None, "sm80"))
        else:
            backend = None
        extra: dict[str, Any] = {}
        if family == "variants":  # each of what the build has, half the time; sinks when nothing else is drawn
            if target.archs and 80 in target.archs and rng.random() < 0.3:
                backend = "sm80"
            window = sample_window(rng, seqlen_q, seqlen_k) if target.windows and rng.random() < 0.5 else None
            softcap = 2 ** rng.uniform(0, 6) if target.softcap and rng.random() < 0.5 else 0.0
            sinks = rng.random() < 0.5 or (window is None and softcap == 0.0)
            extra = {"window": window, "softcap": softcap, "sinks": sinks}
        return dataclasses.replace(base, backend=backend, deterministic=family == "deterministic",
                                   use_dlse=rng.random() < 0.3, dout_layout=sample_layout(rng), **extra)
    if family in OPS_FAMILIES:
        arch = rng.choice(target.archs) if target.archs else None
        window = sample_window(rng, seqlen_q, seqlen_k) if family == "ops-window" else None
        variant = bwd_variant = ""
        if arch is not None:
            key = dispatch.kernel_key(f"sm{arch}", dtype, headdim, causal, window)
            variant, bwd_variant = pick_variant(rng, target, "fwd", key), pick_variant(rng, target, "bwd", key)
        smem = SMEM_99K if arch == 80 and rng.random() < 0.25 else 0
        outs = (sample_layout(rng, guard=True), sample_margins(rng, guard=True),
                *(sample_layout(rng, guard=True) for _ in range(3)))
        return dataclasses.replace(base, arch=arch, window=window, variant=variant, bwd_variant=bwd_variant,
                                   max_smem_bytes=smem, deterministic=rng.random() < 0.25, use_dlse=rng.random() < 0.3,
                                   dout_layout=sample_layout(rng), out_layouts=outs)
    granularity = ("block",) * 3
    if family in ("fp8-prequantized", "fp8-into") and rng.random() < 0.5:
        granularity = tuple(rng.choice(fp8.GRANULARITIES) for _ in range(3))  # type: ignore[assignment]
    outs = (sample_layout(rng, guard=True), sample_margins(rng, guard=True)) if family == "fp8-into" else ()
    return dataclasses.replace(base, hadamard_seed=sample_hadamard_seed(rng), granularity=granularity,
                               v_row_major=family in ("fp8-prequantized", "fp8-into") and rng.random() < 0.3,
                               q_prequantized=family == "kv-attend" and rng.random() < 0.3, out_layouts=outs)


# --- memory: placed inputs and guarded outputs ---------------------------------------------------------------

def placement(shape: Sequence[int], itemsize: int, layout: Layout) -> tuple[tuple[int, ...], int, int]:
    """(strides, storage offset, buffer length) in elements of a tensor of ``shape`` placed by ``layout``.
    Strides of empty dims are as torch's contiguous ones (computed over max(size, 1))."""
    unit = UNIT // itemsize
    outer = len(shape) - 1
    order = layout.order or tuple(range(outer))
    pads = layout.pads or (0,) * outer
    strides = [1] * len(shape)
    span = shape[-1]
    for dim, pad in zip(reversed(order), reversed(pads)):
        strides[dim] = span + pad * unit
        span = max(shape[dim], 1) * strides[dim]
    extent = 0 if math.prod(shape) == 0 else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    front = layout.front * unit
    return tuple(strides), front, front + extent + layout.back * unit


def placed(shape: Sequence[int], dtype: torch.dtype, layout: Layout, device: torch.device,
           fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, buffer): a view of ``shape`` at ``layout`` in a flat buffer whose bytes are all ``fill``."""
    strides, offset, length = placement(shape, dtype.itemsize, layout)
    buffer = torch.empty(length, dtype=dtype, device=device)
    buffer.view(torch.uint8).fill_(fill)
    return buffer.as_strided(tuple(shape), strides, offset), buffer


def randn_at(shape: Sequence[int], dtype: torch.dtype, layout: Layout, device: torch.device) -> torch.Tensor:
    """Random normal values at ``layout``, NaN around them."""
    view, _ = placed(shape, dtype, layout, device, NAN_BYTE)
    view.copy_(torch.randn(tuple(shape), dtype=dtype, device=device))
    return view


def fp8_at(t: fp8.FP8Tensor, layout: Layout) -> fp8.FP8Tensor:
    """``t`` with its data copied to ``layout``, NaN bytes around it."""
    view, _ = placed(t.data.shape, torch.uint8, layout, t.data.device, NAN_BYTE)
    view.copy_(t.data.view(torch.uint8))
    return t._replace(data=view.view(fp8.FP8_DTYPE))


@dataclass
class Guarded:
    """An output: a NaN view into a buffer whose other bytes are SENTINEL, to be left as they are."""
    name: str
    view: torch.Tensor
    buffer: torch.Tensor

    @classmethod
    def make(cls, name: str, shape: Sequence[int], dtype: torch.dtype, layout: Layout,
             device: torch.device) -> Guarded:
        view, buffer = placed(shape, dtype, layout, device, SENTINEL)
        view.fill_(math.nan)
        return cls(name, view, buffer)

    def check(self) -> None:
        """AssertionError when an element outside the view is not SENTINEL bytes any more."""
        inside = torch.zeros(self.buffer.numel(), dtype=torch.bool, device=self.buffer.device)
        inside.as_strided(self.view.shape, self.view.stride(), self.view.storage_offset()).fill_(True)
        kept = (self.buffer.view(torch.uint8).view(-1, self.buffer.element_size()) == SENTINEL).all(1)
        bad = (~kept & ~inside).nonzero().flatten()
        if bad.numel():
            start = self.view.storage_offset()
            raise AssertionError(
                f"{self.name}: {bad.numel()} elements outside the output were overwritten, the first "
                f"{int(bad[0]) - start:+d} elements from its start (shape {tuple(self.view.shape)}, strides "
                f"{self.view.stride()}, buffer of {self.buffer.numel()} from {start} on)")


def check_guards(*outputs: Guarded) -> None:
    for g in outputs:
        g.check()


def make_qkv(cfg: Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, sq, sk, hq, hkv, d = cfg.batch, cfg.seqlen_q, cfg.seqlen_k, cfg.nheads_q, cfg.nheads_kv, cfg.headdim
    if cfg.packed:  # seqlen_q == seqlen_k
        x = randn_at((b, sq, hq + 2 * hkv, d), cfg.dtype, cfg.layouts[0], device)
        return x[:, :, :hq], x[:, :, hq:hq + hkv], x[:, :, hq + hkv:]
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))
    q, k, v = (randn_at(s, cfg.dtype, lay, device) for s, lay in zip(shapes, cfg.layouts))
    return q, k, v


# --- checks ----------------------------------------------------------------------------------------------

class CheckFailed(AssertionError):
    """A failed check that knows how far past its bound the result was (ratio > 1)."""

    def __init__(self, message: str, ratio: float) -> None:
        super().__init__(message)
        self.ratio = ratio


SLACK = 1e-4  # helpers' default atol / rtol / lse_atol


def criterion(check: Callable[..., None], *args: Any, **kwargs: Any) -> float:
    """Run one of helpers' assertions and return how close the result came to failing it: the largest
    ratio of an error to its bound, 2 x PyTorch's error of the same measure + the default slack. The
    assertions return nothing, so the (kernel, PyTorch) error pairs they compute, in that order, are
    recorded on the way through helpers.max_abs_err / rel_err. A failure is re-raised with its ratio."""
    values: list[float] = []
    originals = helpers.max_abs_err, helpers.rel_err

    def recording(measure: Callable[[torch.Tensor, torch.Tensor], float]) -> Callable[..., float]:
        def record(out: torch.Tensor, ref: torch.Tensor) -> float:
            values.append(measure(out, ref))
            return values[-1]
        return record

    helpers.max_abs_err, helpers.rel_err = (recording(m) for m in originals)
    try:
        check(*args, **kwargs)
    except AssertionError as e:
        worst = max((err / (2 * lowp + SLACK) for err, lowp in zip(values[::2], values[1::2])), default=0.0)
        raise CheckFailed(str(e), worst if worst > 1 else math.inf) from None
    finally:
        helpers.max_abs_err, helpers.rel_err = originals
    return max((err / (2 * lowp + SLACK) for err, lowp in zip(values[::2], values[1::2])), default=0.0)


class Outcome(NamedTuple):
    """What a passing configuration's checks found: the worst error / bound, and whether a gradient check
    was judged against the FlashAttention-style emulation (judge_grads)."""
    ratio: float
    by_control: bool = False

    def __or__(self, other: Outcome) -> Outcome:  # type: ignore[override]
        return Outcome(max(self.ratio, other.ratio), self.by_control or other.by_control)


def judge_grads(grads: Sequence[torch.Tensor], dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, dlse: torch.Tensor | None, cfg: Config, sinks: torch.Tensor | None = None) -> Outcome:
    """helpers.assert_grads_match, where a failure on bounds is judged again against a FlashAttention-style
    emulation (helpers.control_ratio says why and how); NaN, non-zero rows without keys and the like fail
    as before."""
    variant = {"window": cfg.window, "softcap": cfg.softcap, "sinks": sinks}
    try:
        return Outcome(criterion(assert_grads_match, grads, dout, q, k, v, cfg.scale, cfg.causal, dlse, **variant))
    except CheckFailed as failure:
        if math.isinf(failure.ratio):  # NaN, a row without keys not 0, ...: no matter of bounds
            raise
        ratio, what = control_ratio(tuple(grads), dout, q, k, v, cfg.scale, cfg.causal, dlse, slack=SLACK,
                                    **variant)
        if not ratio <= 1:  # NaN fails too
            raise CheckFailed(f"{failure}; against the FlashAttention-style emulation too: {what}", ratio) from None
        return Outcome(ratio, by_control=True)


def check_fp8(out: torch.Tensor, lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cfg: Config, quantized: tuple[fp8.FP8Tensor, fp8.FP8Tensor, fp8.FP8Tensor] | None) -> Outcome:
    """An fp8 forward's result for bf16/fp16 q, k, v (quantized as ``quantized``): bfloat16, no NaN, rows
    that see no key exactly 0 (lse -inf), out within REF_REL (relative norm) of exact attention and lse
    within REF8_LSE_ATOL of the fp8 reference's. Returns the larger error / bound ratio."""
    where = cfg.summary()
    assert out.dtype == torch.bfloat16 and out.shape == q.shape, f"out is {out.dtype} {tuple(out.shape)}: {where}"
    assert not torch.isnan(out).any(), f"out has NaN (rows left unwritten?): {where}"
    ref, ref_lse = attention_ref(q, k, v, cfg.scale, cfg.causal, dtype=reference_dtype(q))
    no_key = torch.isneginf(ref_lse)
    assert (out.transpose(1, 2)[no_key] == 0).all(), f"rows that see no key are not exactly 0: {where}"
    err = rel_err(out, ref)
    if not err < REF_REL:
        raise CheckFailed(f"out is {err:.3e} from exact attention (>= {REF_REL}): {where}", err / REF_REL)
    ratio = err / REF_REL
    if lse is not None and quantized is not None:
        assert not torch.isnan(lse).any(), f"lse has NaN (rows left unwritten?): {where}"
        assert torch.equal(torch.isneginf(lse), no_key), f"lse is -inf on other rows than the reference: {where}"
        _, lse8 = attention_fp8_ref(*quantized, cfg.scale, cfg.causal)
        lse_err = max_abs_err(lse[~no_key], lse8[~no_key])
        if not lse_err < REF8_LSE_ATOL:
            raise CheckFailed(f"lse is {lse_err:.3e} from the fp8 reference's (>= {REF8_LSE_ATOL}): {where}",
                              lse_err / REF8_LSE_ATOL)
        ratio = max(ratio, lse_err / REF8_LSE_ATOL)
    return Outcome(ratio)


def reference_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 on the GPU, float64 elsewhere (as helpers.assert_grads_match)."""
    return torch.float32 if x.is_cuda else torch.float64


def assert_same_bits(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor], where: str) -> None:
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
            f"{name} differs between two deterministic backward runs: {where}"


# --- runners, one per kind of entry point --------------------------------------------------------------------

class Skipped(Exception):
    """The configuration cannot run on this build, by its configuration (the message says why)."""


def required_kernels(cfg: Config, target: Target) -> list[tuple[str, KernelKey]]:
    """(mode, key) of every kernel the configuration runs (none with the reference standing in)."""
    if cfg.family in FP8_FAMILIES:
        return [("fwd", fp8.kernel_key(cfg.headdim, cfg.causal))] if target.archs else []
    backend = f"sm{cfg.arch}" if cfg.family in OPS_FAMILIES else (cfg.backend or target.native)
    if backend not in dispatch.ARCH:
        return []
    window, causal = effective_mask(cfg) if cfg.family in API_FAMILIES else (cfg.window, cfg.causal)
    key = dispatch.kernel_key(backend, cfg.dtype, cfg.headdim, causal, window, softcap=cfg.softcap)
    need = [("fwd", dataclasses.replace(key, variant=cfg.variant))]
    if target.bwd:
        need.append(("bwd", dataclasses.replace(key, variant=cfg.bwd_variant)))
    return need


def require_kernels(cfg: Config, target: Target) -> None:
    """Skipped when the build was not configured with a kernel the configuration needs; AssertionError
    when it was and the kernel is missing (a broken build must not look like a skip), or when auto-dispatch
    picks another family than the native one."""
    for mode, key in required_kernels(cfg, target):
        if _ext.kernel(mode, key) is not None:
            continue
        if _ext.configured(mode, key):
            raise AssertionError(f"the build was configured with the {mode} kernel {key.describe()}, but does not "
                                 f"have it (build_info(): {_ext.build_info()})")
        raise Skipped(f"no {mode} kernel {key.describe()}: {unconfigured(mode, key) or 'not in this build'}")
    if cfg.family in FP8_FAMILIES and target.archs and not _ext.has_fp8_quantize():
        raise AssertionError("the build has arch 90 but no fp8 quantization kernel (_C.quantize_fp8)")
    if cfg.family in API_FAMILIES and target.archs:  # auto must pick the native family, never fall back quietly
        window, causal = effective_mask(cfg)
        chosen = dispatch.select_backend(torch.empty(0, device=target.device), cfg.headdim, cfg.dtype, causal,
                                         cfg.backend, window=window, softcap=cfg.softcap)
        assert chosen == (cfg.backend or target.native), f"dispatch picks {chosen} for {cfg.summary()}"


def effective_mask(cfg: Config) -> tuple[tuple[int, int] | None, bool]:
    """(window, causal) as flash_attn_func runs them (kernel_key.normalize_window)."""
    causal, window = normalize_window(cfg.causal, cfg.window)
    return window, causal


def run_api(cfg: Config, target: Target) -> Outcome:
    """dense, sm80, deterministic, variants: flash_attn_func, then its backward through autograd (twice,
    bitwise equal, when deterministic), on leaf views of the placed inputs; variants pass window_size,
    softcap and sinks, and judge the sinks' gradient too."""
    q, k, v = make_qkv(cfg, target.device)
    sinks = None
    if cfg.sinks:  # around the rows' log-sum-exp, as the GPU tests draw them
        sinks = torch.randn(cfg.nheads_q, device=target.device) * 2 + math.log(max(cfg.seqlen_k, 1))
    if target.bwd:
        for x in (q, k, v, sinks):
            if x is not None:
                x.requires_grad_()
    window, causal = effective_mask(cfg)
    out, lse = flash_attn_func(q, k, v, cfg.softmax_scale, cfg.causal, return_lse=True, backend=cfg.backend,
                               deterministic=cfg.deterministic, window_size=cfg.window or (-1, -1),
                               softcap=cfg.softcap, sinks=sinks)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    sd = None if sinks is None else sinks.detach()
    outcome = Outcome(criterion(assert_matches_reference, out.detach(), lse.detach(), qd, kd, vd, cfg.scale,
                                causal, window=window, softcap=cfg.softcap, sinks=sd))
    if not target.bwd:
        return outcome
    dout = randn_at(q.shape, cfg.dtype, cfg.dout_layout, target.device)
    dlse = torch.randn(lse.shape, device=target.device) if cfg.use_dlse else None
    outputs, upstream = ((out, lse), (dout, dlse)) if dlse is not None else ((out,), (dout,))
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    grads = torch.autograd.grad(outputs, leaves, upstream, retain_graph=cfg.deterministic)
    outcome |= judge_grads(grads[:3], dout, qd, kd, vd, dlse, dataclasses.replace(cfg, window=window, causal=causal),
                           sd)
    if sinks is not None:
        try:
            assert_dsinks_match(grads[3], dout, qd, kd, vd, cfg.scale, causal, window, cfg.softcap, sd, dlse,
                                out=out.detach(), lse=lse.detach())
        except AssertionError as e:
            raise CheckFailed(f"{e}: {cfg.summary()}", math.inf) from None
    if cfg.deterministic:
        assert_same_bits(grads, torch.autograd.grad(outputs, (q, k, v), upstream), cfg.summary())
    return outcome


def launch_fwd(cfg: Config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor) -> None:
    if cfg.arch is None:  # --cpu-smoke: the reference op, written into the same views
        ref_out, ref_lse = ops.fwd(q, k, v, cfg.scale, cfg.causal, *(cfg.window or (-1, -1)), 0.0, None, False, "reference")
        out.copy_(ref_out)
        lse.copy_(ref_lse)
    else:
        ops.fwd_into(q, k, v, out, lse, cfg.scale, cfg.causal, cfg.arch, window=cfg.window, variant=cfg.variant,
                     max_smem_bytes=cfg.max_smem_bytes)


def launch_bwd(cfg: Config, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
               grads: Sequence[torch.Tensor]) -> None:
    if cfg.arch is None:
        ref = ops.bwd(dout, q, k, v, out, lse, dlse, cfg.scale, cfg.causal, *(cfg.window or (-1, -1)), 0.0, None,
                      cfg.deterministic, "reference")
        for g, r in zip(grads, ref):
            g.copy_(r)
    else:
        ops.bwd_into(dout, q, k, v, out, lse, *grads, cfg.scale, cfg.causal, cfg.deterministic, cfg.arch, dlse,
                     window=cfg.window, variant=cfg.bwd_variant, max_smem_bytes=cfg.max_smem_bytes)


def run_ops(cfg: Config, target: Target) -> Outcome:
    """ops, ops-window: fwd_into, then bwd_into (twice, bitwise equal, when deterministic), into guarded
    outputs; the backward takes the forward's out and lse."""
    dev = target.device
    q, k, v = make_qkv(cfg, dev)
    lse_shape = (cfg.batch, cfg.nheads_q, cfg.seqlen_q)
    out = Guarded.make("out", q.shape, cfg.dtype, cfg.out_layouts[0], dev)
    lse = Guarded.make("lse", lse_shape, torch.float32, cfg.out_layouts[1], dev)
    launch_fwd(cfg, q, k, v, out.view, lse.view)
    check_guards(out, lse)
    outcome = Outcome(criterion(assert_matches_reference, out.view, lse.view, q, k, v, cfg.scale, cfg.causal,
                                window=cfg.window))
    if not target.bwd:
        return outcome
    dout = randn_at(q.shape, cfg.dtype, cfg.dout_layout, dev)
    dlse = randn_at(lse_shape, torch.float32, cfg.out_layouts[1], dev) if cfg.use_dlse else None

    def backward() -> tuple[torch.Tensor, ...]:
        grads = [Guarded.make(name, x.shape, cfg.dtype, layout, dev)
                 for name, x, layout in zip(("dq", "dk", "dv"), (q, k, v), cfg.out_layouts[2:])]
        launch_bwd(cfg, dout, q, k, v, out.view, lse.view, dlse, [g.view for g in grads])
        check_guards(*grads)
        return tuple(g.view for g in grads)

    grads = backward()
    outcome |= judge_grads(grads, dout, q, k, v, dlse, cfg)
    if cfg.deterministic:
        assert_same_bits(grads, backward(), cfg.summary())
    return outcome


def hadamard_args(cfg: Config) -> dict[str, Any]:
    return {"hadamard": cfg.hadamard_seed is not None, "seed": cfg.hadamard_seed or 0}


def run_fp8(cfg: Config, target: Target) -> Outcome:
    """fp8: flash_attn_fp8_func quantizing q, k, v itself; the lse is compared with the fp8 reference on
    the same quantization, done here the way flash_attn_fp8_func does it (tests/test_fp8_gpu.py checks the
    two agree bitwise)."""
    q, k, v = make_qkv(cfg, target.device)
    out, lse = flash_attn_fp8_func(q, k, v, cfg.softmax_scale, cfg.causal, return_lse=True, **hadamard_args(cfg))
    quantized = quantize_qkv(q, k, v, fp8.default_kv_block_size(cfg.headdim, cfg.causal), **hadamard_args(cfg))
    return check_fp8(out, lse, q, k, v, cfg, quantized)


def prequantized_inputs(cfg: Config, device: torch.device
                        ) -> tuple[tuple[torch.Tensor, ...], tuple[fp8.FP8Tensor, fp8.FP8Tensor, fp8.FP8Tensor]]:
    """Contiguous q, k, v and their quantization (scales of cfg.granularity), the fp8 data placed at
    cfg.layouts; V row-major or V^T."""
    q, k, v = helpers.randn_qkv(cfg.batch, cfg.seqlen_q, cfg.seqlen_k, cfg.nheads_q, cfg.nheads_kv, cfg.headdim,
                                cfg.dtype, device)
    q8, k8, v8 = quantize_qkv(q, k, v, fp8.default_kv_block_size(cfg.headdim, cfg.causal), cfg.granularity,
                              **hadamard_args(cfg))
    if cfg.v_row_major:
        v8 = fp8.from_vt(v8)
    placed8 = tuple(fp8_at(t, layout) for t, layout in zip((q8, k8, v8), cfg.layouts))
    return (q, k, v), placed8  # type: ignore[return-value]


def run_fp8_prequantized(cfg: Config, target: Target) -> Outcome:
    (q, k, v), quantized = prequantized_inputs(cfg, target.device)
    out, lse = flash_attn_fp8_func(*quantized, cfg.softmax_scale, cfg.causal, return_lse=True)
    return check_fp8(out, lse, q, k, v, cfg, quantized)


def run_fp8_into(cfg: Config, target: Target) -> Outcome:
    (q, k, v), quantized = prequantized_inputs(cfg, target.device)
    out = Guarded.make("out", q.shape, torch.bfloat16, cfg.out_layouts[0], target.device)
    lse = Guarded.make("lse", (cfg.batch, cfg.nheads_q, cfg.seqlen_q), torch.float32, cfg.out_layouts[1],
                       target.device)
    if target.archs:
        fp8.fwd_fp8_into(*quantized, out.view, lse.view, cfg.softmax_scale, cfg.causal)
    else:  # --cpu-smoke: the emulation, written into the same views
        ref_out, ref_lse = flash_attn_fp8_func(*quantized, cfg.softmax_scale, cfg.causal, return_lse=True)
        out.view.copy_(ref_out)
        lse.view.copy_(ref_lse)
    check_guards(out, lse)
    return check_fp8(out.view, lse.view, q, k, v, cfg, quantized)


def run_kv_attend(cfg: Config, target: Target) -> Outcome:
    """quantize_kv(k, v).attend(q): the KV cache path (out only: attend returns no lse)."""
    q, k, v = make_qkv(cfg, target.device)
    kv = quantize_kv(k, v, causal=cfg.causal, **hadamard_args(cfg))
    query = fp8.quantize_fp8(q, fp8.Q_BLOCK, **hadamard_args(cfg)) if cfg.q_prequantized else q
    return check_fp8(kv.attend(query, cfg.softmax_scale, cfg.causal), None, q, k, v, cfg, None)


RUNNERS: dict[str, Callable[[Config, Target], Outcome]] = {
    "dense": run_api, "sm80": run_api, "deterministic": run_api, "variants": run_api, "fp8": run_fp8,
    "fp8-prequantized": run_fp8_prequantized, "fp8-into": run_fp8_into, "kv-attend": run_kv_attend,
    "ops": run_ops, "ops-window": run_ops,
}


# --- the run ---------------------------------------------------------------------------------------------

@dataclass
class Result:
    status: str  # "ok", "failed", "skipped"
    ratio: float = 0.0  # the worst error / bound (inf: a check without a ratio failed)
    by_control: bool = False  # gradients judged against the FlashAttention-style emulation (judge_grads)
    message: str = ""
    seconds: float = 0.0


def run_one(cfg: Config, target: Target) -> tuple[Result, bool]:
    """(result, whether the device is still usable: a CUDA error other than OOM leaves the context broken)."""
    torch.manual_seed(cfg.data_seed)
    start = time.perf_counter()
    alive = True
    try:
        require_kernels(cfg, target)
        outcome = RUNNERS[cfg.family](cfg, target)
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        result = Result("ok", outcome.ratio, outcome.by_control)
    except Skipped as e:
        result = Result("skipped", message=str(e))
    except torch.OutOfMemoryError:
        result = Result("skipped", message="OOM")
    except AssertionError as e:
        result = Result("failed", getattr(e, "ratio", math.inf), message=str(e))
    except Exception as e:  # an entry point refusing a valid configuration, or a CUDA error
        result = Result("failed", math.inf, message=f"{type(e).__name__}: {e}")
        if target.device.type == "cuda":
            try:
                torch.cuda.synchronize()
            except Exception:
                alive = False
    if result.message == "OOM":
        torch.cuda.empty_cache()
    result.seconds = time.perf_counter() - start
    return result, alive


@dataclass
class Stats:
    run: int = 0
    failed: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> configurations
    by_control: int = 0  # passed with gradients judged against the control (judge_grads)
    worst: float = 0.0
    seconds: float = 0.0


@dataclass
class Failure:
    seed: int
    index: int
    summary: str
    ratio: float | None  # None: a check without a bound failed
    message: str
    replay: str


def schedule(count: int, seeds: Sequence[int], random_seed: int | None) -> list[tuple[int, int]]:
    """(seed, index) of each configuration: with a random seed, every other one is its next, the others
    the fixed seeds' in turn; else those of ``seeds`` in turn."""
    if random_seed is None:
        return [(seeds[j % len(seeds)], j // len(seeds)) for j in range(count)]
    out = []
    for j in range(count):
        half = j // 2
        out.append((random_seed, half) if j % 2 else (seeds[half % len(seeds)], half // len(seeds)))
    return out


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """torch.empty (and every output allocated through it, inside the entry points too) filled with NaN
    (integers with their maximum) while the run lasts: torch's deterministic mode with
    fill_uninitialized_memory, warnings only for what has no deterministic implementation. cuBLAS asks for
    this workspace setting in that mode."""
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas or ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
        if cublas is None:
            del os.environ["CUBLAS_WORKSPACE_CONFIG"]


def replay_command(seed: int, index: int, args: argparse.Namespace) -> str:
    extra = (" --cpu-smoke" if args.cpu_smoke else "") + (f" --budget {args.budget}" if args.budget_given else "")
    return f"python scripts/fuzz.py --seed {seed} --index {index}{extra}"


def fmt_ratio(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3f}"


def summarize(stats: dict[str, Stats], failures: list[Failure], target: Target, done: int, count: int,
              elapsed: float, aborted: str, max_listed: int) -> str:
    lines = [f"\n{'family':<17} {'run':>5} {'failed':>6} {'skipped':>7} {'control':>7} {'worst':>7} {'seconds':>8}"
             "  entry point"]
    for name, s in stats.items():
        lines.append(f"{name:<17} {s.run:>5} {s.failed:>6} {sum(s.skipped.values()):>7} {s.by_control:>7} "
                     f"{fmt_ratio(s.worst):>7} {s.seconds:>8.1f}  {FAMILIES[name][0]}")
    total = Stats(sum(s.run for s in stats.values()), sum(s.failed for s in stats.values()))
    skipped = sum(sum(s.skipped.values()) for s in stats.values())
    control = sum(s.by_control for s in stats.values())
    lines.append(f"{'total':<17} {total.run:>5} {total.failed:>6} {skipped:>7} {control:>7}")
    lines.append("worst: the largest error / bound of a configuration (> 1 fails; inf: a check without a bound "
                 "failed, e.g. NaN, a guard, bitwise determinism, an exception)")
    lines.append("control: passed once the criterion's baseline was widened to a FlashAttention-style emulation of "
                 "the backward's roundings (few keys: see judge_grads)")
    for name, s in stats.items():
        for reason, n in s.skipped.items():
            lines.append(f"skipped {name}: {n} x {reason}")
    for name, why in target.not_run.items():
        lines.append(f"not run: {name}: {why}")
    lines += [f"note: {n}" for n in target.notes]
    if failures:
        listed = f" (the first {max_listed})" if len(failures) > max_listed else ""
        lines.append(f"\n{len(failures)} failed configurations{listed}:")
        for f in failures[:max_listed]:
            first_line = f.message.splitlines()[0] if f.message else ""
            lines += [f"  {f.seed}/{f.index} {f.summary}", f"    {first_line}", f"    replay: {f.replay}"]
    if aborted:
        lines.append(f"\nABORTED: {aborted}")
    elif done < count:
        lines.append(f"\nINCOMPLETE: the time limit stopped the run after {done} of {count} configurations")
    lines.append(f"\n{done} configurations in {elapsed:.1f} s ({total.failed} failed)")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, help=f"configurations (default {DEFAULT_COUNT}; --cpu-smoke {SMOKE['count']})")
    ap.add_argument("--seed", type=int, help="draw every configuration from this seed only (replay)")
    ap.add_argument("--index", type=int, help="with --seed: run this one configuration, described in full")
    ap.add_argument("--random-seed", type=int, help="this run's random seed (default: a fresh one; repeats a run)")
    ap.add_argument("--budget", type=int, help=f"score elements per configuration (default {DEFAULT_BUDGET}; "
                    "part of a configuration: replays need the same)")
    ap.add_argument("--minutes", type=float, help="start no configuration after this many minutes (the summary "
                    "says INCOMPLETE)")
    ap.add_argument("--json", type=Path, help="write the summary here as JSON")
    ap.add_argument("--list-failures", type=int, default=30, help="failed configurations listed (default 30)")
    ap.add_argument("--quiet", action="store_true", help="print failures and a progress line per 100, not every one")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny configurations on CPU, the reference for kernels")
    args = ap.parse_args(argv)
    if args.index is not None and args.seed is None:
        ap.error("--index needs --seed")
    args.budget_given = args.budget is not None
    if args.budget is None:
        args.budget = SMOKE["budget"] if args.cpu_smoke else DEFAULT_BUDGET
    if args.count is None:
        args.count = SMOKE["count"] if args.cpu_smoke else DEFAULT_COUNT
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        target = smoke_target()
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke, or on the GPU machine")
    else:
        target = device_target()
    if not target.families:
        print("nothing to fuzz:", "; ".join(f"{f}: {why}" for f, why in target.not_run.items()))
        return 1
    random_seed = None
    if args.seed is not None:
        plan = [(args.seed, args.index)] if args.index is not None else schedule(args.count, (args.seed,), None)
    elif args.cpu_smoke:
        plan = schedule(args.count, FIXED_SEEDS[:1], None)
    else:
        random_seed = args.random_seed if args.random_seed is not None else random.SystemRandom().randrange(1 << 32)
        plan = schedule(args.count, FIXED_SEEDS, random_seed)
        print(f"seeds: fixed {FIXED_SEEDS}, random {random_seed} (--random-seed {random_seed} repeats this run)")
    print(f"device: {target.device}" + (f" ({torch.cuda.get_device_name()})" if target.device.type == "cuda" else "")
          + f"; build: {_ext.build_info() or 'none'}")
    print(f"families: {', '.join(target.families)}; budget {args.budget} score elements per configuration")

    stats = {f: Stats() for f in target.families}
    failures: list[Failure] = []
    start = time.perf_counter()
    aborted = ""
    done = 0
    with poisoned_allocations():
        for n, (seed, index) in enumerate(plan):
            if args.minutes is not None and time.perf_counter() - start > 60 * args.minutes:
                break
            cfg = sample(seed, index, target, args.budget)
            if args.index is not None:
                print(f"configuration {seed}/{index}:\n{cfg.describe()}")
            if not args.quiet:
                print(f"[{n:4d}] {seed}/{index} {cfg.summary()}", end=" ", flush=True)
            result, alive = run_one(cfg, target)
            done += 1
            s = stats[cfg.family]
            s.seconds += result.seconds
            if result.status == "skipped":
                s.skipped[result.message] = s.skipped.get(result.message, 0) + 1
            else:
                s.run += 1
                s.worst = max(s.worst, result.ratio)
                s.by_control += result.by_control
            if result.status == "failed":
                s.failed += 1
                failures.append(Failure(seed, index, cfg.summary(), None if math.isinf(result.ratio) else result.ratio,
                                        result.message, replay_command(seed, index, args)))
            if not args.quiet:
                print(f"-> {result.status}{' (control)' if result.by_control else ''} {fmt_ratio(result.ratio)} "
                      f"{1000 * result.seconds:.0f} ms"
                      + (f": {result.message}" if result.status != "ok" else ""), flush=True)
            elif result.status == "failed":
                print(f"FAILED {seed}/{index} {cfg.summary()}: {result.message}", flush=True)
            if args.quiet and (n + 1) % 100 == 0:
                print(f"{n + 1} of {len(plan)} in {time.perf_counter() - start:.0f} s, {len(failures)} failed",
                      flush=True)
            if not alive:
                aborted = f"the CUDA context broke at {seed}/{index}; the configurations after it did not run"
                break
    elapsed = time.perf_counter() - start
    print(summarize(stats, failures, target, done, len(plan), elapsed, aborted, args.list_failures))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "count": len(plan), "done": done, "complete": done == len(plan) and not aborted, "aborted": aborted,
            "elapsed_s": elapsed, "budget": args.budget, "fixed_seeds": FIXED_SEEDS, "random_seed": random_seed,
            "device": str(target.device) + (f" {torch.cuda.get_device_name()}" if target.device.type == "cuda" else ""),
            "torch": torch.__version__, "build_info": _ext.build_info(),
            "families": {name: {"entry_point": FAMILIES[name][0], "run": s.run, "failed": s.failed,
                                "skipped": s.skipped, "judged_by_control": s.by_control,
                                "worst_ratio": None if math.isinf(s.worst) else s.worst,
                                "seconds": s.seconds} for name, s in stats.items()},
            "not_run": target.not_run, "notes": target.notes,
            "failures": [dataclasses.asdict(f) for f in failures],
        }, indent=1))
    return 1 if failures or aborted or done == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
