"""FP8 (e4m3) forward on the GPU (run on the H100; skipped here). Contract: docs/fp8.md.

1. The quantization kernel (``quantize_fp8(..., kernel=True)``) against ``reference_fp8.quantize_ref``:
   bf16/fp16, head dims 64/128/256, ragged seqlens, block sizes, Hadamard on/off, V^T (transpose)
   on/off, strided inputs. Without the Hadamard transform there is no arithmetic to reorder, so scales
   and fp8 bytes must match bit for bit; with it, scales to float32 rounding and the bytes up to a few
   1-ulp differences (sums in another order). The V^T key permutation is also checked against the
   docs' formula, independently of the reference.
2. The attention kernel (``fwd_fp8_into`` with NaN-poisoned out and lse) against
   (a) ``emulate_kernel`` below: the kernel's arithmetic in its own order (key blocks of block_n from
       the last, P rounded to e4m3 against the running row max): tight;
   (a') ``reference_fp8.attention_fp8_ref`` on the same fp8 tensors, which rounds P against the final
       row max: as close as two different P roundings allow;
   (b) exact float64 attention of the unquantized inputs: within fp8's own error;
   rows that see no key must be 0 with lse -inf. Then the user paths: the inference path (bf16 q +
   quantize_kv), pre-quantized non-transposed V (to_vt), per-head and per-tensor scales, q following
   k's Hadamard seed, empty inputs (which reach the kernels).
3. The accuracy table of the FlashAttention-3 paper on its outlier inputs, through the kernels
   (``pytest -s`` prints it).
4. The torch ops: ``torch.compile(flash_attn_fp8_func, fullgraph=True)`` against eager and the
   references, and a CUDA-graph capture holding the very first call of a configuration.

A test skips, with the reason, when this GPU cannot run the fp8 kernels (they are sm_90a code) or the
build was not configured with the kernel it needs; it FAILS when the build was configured with it
(``_ext.configured``; the quantization kernel comes with arch 90) and the kernel is missing.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import fp8_kernel_block_n, max_abs_err, poison_allocator, randn_qkv, rel_err, unconfigured

import flashhopper
from flashhopper import _device, _ext, fp8, reference_fp8
from flashhopper.reference import attention_ref, visible

DEV = "cuda"
HDIMS = [64, 128, 256]
SEED = 3  # a Hadamard seed other than the default, so that a seed dropped on the way shows
Q_BLOCK = 64  # the Q scale block flash_attn_fp8_func uses (one consumer warpgroup's rows)

# Tolerances of the attention checks; the numbers quoted come from running emulate_kernel and
# attention_fp8_ref on CPU (bf16 N(0, 1) inputs, d 128, block_n 128, Q/K per block with Hadamard).
# (a) kernel vs emulate_kernel: accumulation precision, exp2.approx and the bf16 output (1.7e-3) differ.
# Measured on the H100: up to 1.08e-2 where one query row sees a few hundred keys (1 x 255, causal).
EMU_REL, EMU_LSE_ATOL = 2e-2, 5e-3
# (a') kernel vs attention_fp8_ref: P rounded against another maximum; emulate_kernel vs
# attention_fp8_ref is 1e-7 while one key block is seen, up to 2.4e-2 with more (seqlen_k >= 1000);
# their lse agree to 2e-6.
REF8_REL, REF8_LSE_ATOL = 4e-2, 5e-3
# (b) kernel vs exact attention of the unquantized inputs, fp8's own error: 4.0e-2 at seqlen_k 17,
# 5.3e-2 from ~1000 keys on (non-causal; causal a little less), for both emulations.
REF_REL = 8e-2
# FA3 outlier setup: per-tensor RMSE / (per-block + Hadamard) RMSE. emulate_kernel on the very inputs
# of test_outlier_accuracy_table gives 2.03 (d 128) and 2.14 (d 256) (RMSE 1.78e-2 -> 8.75e-3 and
# 1.35e-2 -> 6.28e-3; per-block alone 1.49e-2 and 1.26e-2). The paper's 2.4e-2 -> 9.1e-3 (2.6x) is
# not what this arithmetic gives, so the bound sits under the emulated ratio, not at the paper's.
OUTLIER_MIN_RATIO = 1.8
# Kernel RMSE vs emulate_kernel's RMSE (both against float64), per scheme.
OUTLIER_EMU_RTOL = 0.05
P_OFFSET = 8  # the kernel computes 2^8 * exp(s - rowmax) (kMaxOffset), as reference_fp8.P_OFFSET


# --- what this build and GPU can run ----------------------------------------------------------------

def require_hopper() -> None:
    info = _device.device_info(torch.cuda.current_device())
    if info.capability != (9, 0):
        pytest.skip(f"the fp8 kernels are sm_90a code; this GPU is {info.name} "
                    f"(compute capability {info.capability[0]}.{info.capability[1]})")


def require_fp8_kernel(headdim: int, causal: bool) -> int:
    """Skip unless this GPU runs the fp8 kernels and the build was configured with the forward for
    (headdim, causal); fail when it was and the kernel is missing. Returns its block_n."""
    require_hopper()
    tiles = fp8.kernel_tiles(headdim, causal)
    if tiles is None:
        key = fp8.kernel_key(headdim, causal)
        if _ext.configured("fwd", key):
            pytest.fail(f"the build was configured with the fp8 forward {key.describe()}, but does not have it "
                        f"(build_info(): {_ext.build_info()})")
        pytest.skip(f"no fp8 forward {key.describe()}: "
                    + (unconfigured("fwd", key) or f"not compiled ({_ext.extension_error() or _ext.build_info()})"))
    return tiles[1]


def require_quant_kernel() -> None:
    require_hopper()
    if not _ext.has_fp8_quantize():
        archs = _ext.build_info().get("archs", [])
        if 90 in archs:  # the quantization kernel is built with every Hopper build (CMakeLists.txt)
            pytest.fail(f"the build has arch 90 but no fp8 quantization kernel (_C.quantize_fp8): {_ext.build_info()}")
        pytest.skip("this build has no fp8 quantization kernel (_C.quantize_fp8): "
                    + ("configure FLASHHOPPER_ARCHS with 90" if _ext.has_extension()
                       else f"no compiled extension ({_ext.extension_error()})"))


# --- helpers --------------------------------------------------------------------------------------

# Storage position l of each aligned group of 16 keys in V^T holds key PERM16[l] (docs/fp8.md).
PERM16 = [8 * ((l % 4) // 2) + 2 * (l // 4) + (l % 2) for l in range(16)]


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def unpermute_keys(vt: torch.Tensor) -> torch.Tensor:
    """V^T bytes (b, h, d, seqlen_pad) in storage order -> the same in key order (padding keys last)."""
    pos = torch.arange(vt.shape[-1], device=vt.device)
    key = pos // 16 * 16 + torch.tensor(PERM16, device=vt.device)[pos % 16]
    out = torch.empty_like(vt)
    out[..., key] = vt
    return out


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.float8_e4m3fn, f"fp8 data has dtype {t.dtype}"
    return t.view(torch.uint8)


def ordinal(t: torch.Tensor) -> torch.Tensor:
    """e4m3 values as integers in value order (adjacent values differ by 1; +0 and -0 are both 0)."""
    u = fp8_bytes(t).to(torch.int16)
    mag = u & 0x7F
    return torch.where(u >= 0x80, -mag, mag)


def assert_no_nan_bytes(t: torch.Tensor, where: str) -> None:
    nan = (fp8_bytes(t) & 0x7F) == 0x7F  # 0x7F, 0xFF: the only NaNs of e4m3fn; satfinite never writes them
    assert not nan.any(), f"{int(nan.sum())} NaN bytes in fp8 data (left unwritten?): {where}"


def assert_same_quantization(got: fp8.FP8Tensor, want: fp8.FP8Tensor, exact: bool, where: str) -> None:
    """Same layout, scales and fp8 values: bit for bit if ``exact``, else scales to rtol 1e-6 and
    at most 0.1% (at least 1) of the values 1 ulp apart, none further."""
    assert got.transposed == want.transposed and got.seqlen == want.seqlen, where
    assert got.data.shape == want.data.shape, f"data shape {tuple(got.data.shape)} != {tuple(want.data.shape)}: {where}"
    assert got.scale.shape == want.scale.shape, \
        f"scale shape {tuple(got.scale.shape)} != {tuple(want.scale.shape)}: {where}"
    assert got.scale.dtype == torch.float32, where
    assert torch.isfinite(got.scale).all(), f"non-finite scales (left unwritten?): {where}"
    assert_no_nan_bytes(got.data, where)
    gs, ws = got.scale.float().cpu(), want.scale.float().cpu()
    if exact:
        bad = gs != ws
        assert not bad.any(), f"{int(bad.sum())} scales differ, first at {bad.nonzero()[0].tolist()}: {where}"
    else:
        torch.testing.assert_close(gs, ws, rtol=1e-6, atol=0, msg=lambda m: f"{m}\n{where}")
    diff = (ordinal(got.data).cpu() - ordinal(want.data).cpu()).abs()
    n_diff, worst = int((diff > 0).sum()), int(diff.max()) if diff.numel() else 0
    if exact:
        assert n_diff == 0, (f"{n_diff} of {diff.numel()} fp8 values differ (worst by {worst} ulp), first at "
                             f"{(diff > 0).nonzero()[0].tolist()}: {where}")
    else:
        allowed = max(1, math.ceil(1e-3 * diff.numel()))
        assert worst <= 1, f"fp8 values differ by up to {worst} ulp: {where}"
        assert n_diff <= allowed, f"{n_diff} of {diff.numel()} fp8 values 1 ulp off (allowed {allowed}): {where}"


def quant_input(b: int, s: int, h: int, d: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """randn with a random power-of-two magnitude per (token, head), so that every scale block has its
    own amax (a scale read from the wrong block shows); "packed": the k of a packed (b, s, 3, h, d)
    qkv tensor, rows 3*h*d apart."""
    mag = 2.0 ** torch.randint(-4, 5, (b, s, h, 1), device=DEV)
    if layout == "packed":
        qkv = torch.randn(b, s, 3, h, d, device=DEV)
        qkv[:, :, 1] *= mag
        x = qkv.to(dtype)[:, :, 1]
        assert not x.is_contiguous() or s == 1
        return x
    return (torch.randn(b, s, h, d, device=DEV) * mag).to(dtype)


def poisoned(batch: int, seqlen_q: int, nheads_q: int, headdim: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((batch, seqlen_q, nheads_q, headdim), math.nan, dtype=torch.bfloat16, device=DEV)
    lse = torch.full((batch, nheads_q, seqlen_q), math.nan, dtype=torch.float32, device=DEV)
    return out, lse


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int,
                 granularity: tuple[str, str, str] = ("block", "block", "block"), hadamard: bool = True,
                 seed: int = 0, kernel: bool | None = None) -> tuple[fp8.FP8Tensor, fp8.FP8Tensor, fp8.FP8Tensor]:
    """What flash_attn_fp8_func does by default: Q per 64 rows, K and V per block_n keys, Q and K
    rotated with the same signs, V never rotated and stored as V^T (``kernel``: quantize_fp8's)."""
    def quant(x: torch.Tensor, block: int, gran: str, had: bool, transpose: bool = False) -> fp8.FP8Tensor:
        return fp8.quantize_fp8(x, block_size=block if gran == "block" else None, hadamard=had, seed=seed,
                                granularity=gran, transpose=transpose, kernel=kernel)

    gq, gk, gv = granularity
    return (quant(q, Q_BLOCK, gq, hadamard), quant(k, block_n, gk, hadamard),
            quant(v, block_n, gv, False, transpose=True))


def emulate_kernel(q8: fp8.FP8Tensor, k8: fp8.FP8Tensor, v8: fp8.FP8Tensor, softmax_scale: float,
                   causal: bool, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 kernel's arithmetic in its order, float32 on dequantized Q, K, V: per query row, key
    blocks of ``block_n`` from the last to the first; scores in log2 units; running max m;
    P = 2^(s - m + 8) rounded to e4m3 for the PV product; l summed from the unrounded P; O and l
    rescaled by 2^(m_old - m_new). Returns (out (b, sq, hq, d), lse (b, hq, sq)), float32, like
    attention_fp8_ref (which rounds P against the final max instead, and so differs by ~2e-2)."""
    q, k, v = (reference_fp8.dequantize(t) for t in (q8, k8, v8))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, 1)
    vt = v.transpose(1, 2).repeat_interleave(group, 1)
    out = torch.zeros(b, hq, sq, d, device=q.device)
    lse = torch.empty(b, hq, sq, device=q.device)
    step = max(1, (1 << 27) // max(1, b * hq * sk))  # score rows per chunk
    for m0 in range(0, sq, step):
        rows = slice(m0, min(m0 + step, sq))
        s = (qt[:, :, rows] @ kt.transpose(-1, -2)) * (softmax_scale / math.log(2))
        mask = visible(sq, sk, causal, q.device, rows=rows)
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf)
        m = torch.full(s.shape[:-1], -math.inf, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros(*s.shape[:-1], d, device=q.device)
        for n in reversed(range(math.ceil(sk / block_n))):
            keys = slice(n * block_n, (n + 1) * block_n)
            m_new = torch.maximum(m, s[..., keys].amax(-1))
            m_used = torch.where(torch.isinf(m_new), 0.0, m_new)  # no visible key yet: P = 2^-inf = 0
            p = torch.exp2(s[..., keys] - (m_used - P_OFFSET)[..., None])
            alpha = torch.exp2(m - m_used)
            l = l * alpha + p.sum(-1)
            o = o * alpha[..., None] + p.to(torch.float8_e4m3fn).float() @ vt[:, :, keys]
            m = m_new
        seen = l > 0
        l1 = torch.where(seen, l, 1.0)
        out[:, :, rows] = torch.where(seen[..., None], o / l1[..., None], 0.0)
        lse[:, :, rows] = torch.where(seen, (m + torch.log2(l1) - P_OFFSET) * math.log(2), -math.inf)
    return out.transpose(1, 2), lse


def check_attention(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    q8: fp8.FP8Tensor, k8: fp8.FP8Tensor, v8: fp8.FP8Tensor, softmax_scale: float,
                    causal: bool) -> None:
    """The fp8 forward's result (out, lse) for q, k, v quantized as q8, k8, v8 (v8 V^T): no NaN; rows
    without a visible key exactly 0 with lse -inf; (a), (a') and (b) of the module docstring."""
    where = f"q {tuple(q.shape)} k {tuple(k.shape)} causal={causal} scale={softmax_scale:.4g}"
    assert out.dtype == torch.bfloat16, f"out dtype {out.dtype}: {where}"
    assert not torch.isnan(out).any(), f"out has NaN (rows left unwritten?): {where}"
    assert not torch.isnan(lse).any(), f"lse has NaN (rows left unwritten?): {where}"
    ref, ref_lse = attention_ref(q, k, v, softmax_scale, causal, dtype=torch.float64)
    no_key = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), no_key), f"lse is -inf on other rows than the reference: {where}"
    assert (out.transpose(1, 2)[no_key] == 0).all(), f"rows that see no key are not exactly 0: {where}"
    finite = ~no_key

    block_n = fp8_kernel_block_n(q.shape[-1], causal, k.shape[1], k8.block_size, v8.block_size)
    checks = (("emulate_kernel", emulate_kernel(q8, k8, v8, softmax_scale, causal, block_n), EMU_REL, EMU_LSE_ATOL),
              ("attention_fp8_ref", reference_fp8.attention_fp8_ref(q8, k8, v8, softmax_scale, causal), REF8_REL,
               REF8_LSE_ATOL))
    for name, (emu, emu_lse), tol, lse_tol in checks:
        e = rel_err(out, emu)
        assert e < tol, f"out differs from {name} on the same fp8 tensors by {e:.3e} (>= {tol}): {where}"
        e_lse = max_abs_err(lse[finite], emu_lse.to(lse.device)[finite])
        assert e_lse < lse_tol, f"lse differs from {name}'s by {e_lse:.3e} (>= {lse_tol}): {where}"
    r = rel_err(out, ref)
    assert r < REF_REL, f"out is {r:.3e} from exact attention of the unquantized inputs (>= {REF_REL}): {where}"


# --- 1. the quantization kernel ----------------------------------------------------------------------

QUANT_SEQLENS = [1, 17, 128, 1000, 4096]
QUANT_BLOCKS = [64, 128, 256]  # those with block * headdim > fp8.QUANT_MAX_BLOCK_ELEMENTS are left out
# Rotated through the grid: (input dtype, layout).
QUANT_ROTATED = list(itertools.product([torch.bfloat16, torch.float16], ["contiguous", "packed"]))
QuantCase = tuple[int, int, int, bool, bool, torch.dtype, str]


def quant_grid() -> list[QuantCase]:
    cases = []
    for p, (s, block) in enumerate(itertools.product(QUANT_SEQLENS, QUANT_BLOCKS)):
        for j, (d, had, transpose) in enumerate(itertools.product(HDIMS, (False, True), (False, True))):
            if block * d > fp8.QUANT_MAX_BLOCK_ELEMENTS:
                continue
            dtype, layout = QUANT_ROTATED[(p + j) % len(QUANT_ROTATED)]
            cases.append((s, block, d, had, transpose, dtype, layout))
    return cases


def quant_id(c: QuantCase) -> str:
    s, block, d, had, transpose, dtype, layout = c
    return (f"s{s}-blk{block}-d{d}-{'had' if had else 'nohad'}-{'vt' if transpose else 'bshd'}-"
            f"{str(dtype)[6:]}-{layout}")


def test_quant_grid_covers_every_value() -> None:  # runs anywhere: it checks the grid, not a kernel
    cases = quant_grid()
    fitting = sum(block * d <= fp8.QUANT_MAX_BLOCK_ELEMENTS for block in QUANT_BLOCKS for d in HDIMS)
    assert len(cases) == len(QUANT_SEQLENS) * fitting * 4
    for d, had, transpose in itertools.product(HDIMS, (False, True), (False, True)):
        seen = {(dt, lay) for (_, _, dd, h, t, dt, lay) in cases if (dd, h, t) == (d, had, transpose)}
        assert seen == set(QUANT_ROTATED)


@pytest.mark.gpu
@pytest.mark.parametrize("case", quant_grid(), ids=quant_id)
def test_quantize_kernel(case: QuantCase) -> None:
    s, block, d, had, transpose, dtype, layout = case
    require_quant_kernel()
    b, h = 2, 3
    x = quant_input(b, s, h, d, dtype, layout)
    if s >= 2 * block:  # an all-zero scale block: scale 1, values 0
        x[0, block: 2 * block, 0] = 0
    where = f"x {tuple(x.shape)} strides {x.stride()} {dtype} block {block} hadamard={had} transpose={transpose}"
    s_out = round_up(s, 16) if transpose else s
    nblocks = math.ceil(s / block)
    poison_allocator(b * s_out * h * d, b * h * nblocks * 4)
    got = fp8.quantize_fp8(x, block_size=block, hadamard=had, seed=SEED, granularity="block", transpose=transpose,
                           kernel=True)
    want = reference_fp8.quantize_ref(x, block, "block", SEED if had else None, transpose)  # signs of SEED

    assert got.data.device == x.device and got.scale.device == x.device, where
    assert got.data.shape == ((b, h, d, s_out) if transpose else (b, s, h, d)), where
    assert got.scale.shape == (b, h, nblocks), where
    assert (got.block_size, got.hadamard_seed, got.transposed, got.seqlen) == \
        (block, SEED if had else None, transpose, s), f"metadata {got.block_size, got.hadamard_seed}: {where}"
    assert_same_quantization(got, want, exact=not had, where=where)
    if transpose:
        pad = unpermute_keys(fp8_bytes(got.data))[..., s:]
        assert (pad == 0).all(), f"padding keys of V^T are not 0: {where}"
    if s >= 2 * block:
        assert got.scale[0, 0, 1].item() == 1.0, f"all-zero block: scale {got.scale[0, 0, 1].item()} != 1: {where}"


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", HDIMS)
@pytest.mark.parametrize("had,transpose", [(True, False), (False, True)])  # the Q/K and the V pass
def test_quantize_kernel_many_blocks(headdim: int, had: bool, transpose: bool) -> None:
    # More blocks than CTAs fit on the GPU at once: each persistent CTA walks several blocks through its
    # two input buffers (the grid above has too few at head dim 64). Seqlen not a multiple of the block.
    require_quant_kernel()
    b, s, h, block = 1, 40000, 4, 64
    x = quant_input(b, s, h, headdim, torch.bfloat16, "contiguous")
    where = f"x {tuple(x.shape)} block {block} hadamard={had} transpose={transpose}"
    poison_allocator(b * round_up(s, 16) * h * headdim, b * h * math.ceil(s / block) * 4)
    got = fp8.quantize_fp8(x, block_size=block, hadamard=had, seed=SEED, granularity="block", transpose=transpose,
                           kernel=True)
    want = reference_fp8.quantize_ref(x, block, "block", SEED if had else None, transpose)
    assert_same_quantization(got, want, exact=not had, where=where)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", HDIMS)
@pytest.mark.parametrize("seqlen", [17, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vt_layout(headdim: int, seqlen: int, dtype: torch.dtype) -> None:
    # The kernel's V^T, un-permuted by the docs' formula, is its (b, s, h, d) output transposed, bit for
    # bit; to_vt of the (b, s, h, d) output is the kernel's V^T (the pre-quantized-V path).
    require_quant_kernel()
    v = quant_input(2, seqlen, 3, headdim, dtype, "packed")
    v8 = fp8.quantize_fp8(v, block_size=128, hadamard=False, kernel=True)
    vt8 = fp8.quantize_fp8(v, block_size=128, hadamard=False, transpose=True, kernel=True)
    assert torch.equal(v8.scale, vt8.scale)
    natural = unpermute_keys(fp8_bytes(vt8.data))
    assert torch.equal(natural[..., :seqlen], fp8_bytes(v8.data).permute(0, 2, 3, 1)), \
        "V^T is not the transposed V with keys in the order of docs/fp8.md"
    assert (natural[..., seqlen:] == 0).all(), "padding keys of V^T are not 0"

    moved = fp8.to_vt(v8)
    assert moved.transposed and moved.seqlen == seqlen and moved.block_size == 128
    assert torch.equal(fp8_bytes(moved.data), fp8_bytes(vt8.data)), "to_vt differs from the kernel's V^T"
    assert torch.equal(moved.scale, vt8.scale)
    torch.testing.assert_close(reference_fp8.dequantize(moved), reference_fp8.dequantize(v8), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", HDIMS)
def test_kernel_hadamard_signs(headdim: int) -> None:
    # The kernel's signs, read off bit for bit: token t = the unit vector e_t becomes H diag(s) e_t / sqrt(d)
    # = s_t H[t] / sqrt(d) (H is symmetric), all of magnitude 1/sqrt(d), so every value quantizes to exactly
    # +-448 with the sign of s_t H[t][i]. Seeds beyond 32 bits and negative ones: the seed's 64 bits count.
    require_quant_kernel()
    block = min(128, fp8.QUANT_MAX_BLOCK_ELEMENTS // headdim)
    x = torch.eye(headdim, dtype=torch.bfloat16, device=DEV)[None, :, None, :]  # (1, d tokens, 1 head, d)
    h = reference_fp8.hadamard_matrix(headdim)
    for seed in (0, 1, SEED, -1, 2**32, 2**63, 2**64 - 1, 0x123456789ABCDEF):
        got = fp8.quantize_fp8(x, block_size=block, seed=seed, kernel=True)
        signs = fp8.hadamard_signs(headdim, seed)
        assert torch.equal(got.data[0, :, 0].float().cpu(), 448 * signs[:, None] * h), \
            f"the kernel's Hadamard signs for seed {seed} are not hadamard_signs({headdim}, {seed})"
        want = reference_fp8.quantize_ref(x, block, "block", seed)
        assert_same_quantization(got, want, exact=True, where=f"one-hot rows, seed {seed}")


# --- 2. the attention kernel ----------------------------------------------------------------------

ATTN_SEQLENS = [1, 17, 128, 255, 1000, 4096]
# Rotated through the grid: ((nheads_q, nheads_kv), batch).
ATTN_ROTATED = list(itertools.product([(4, 4), (4, 2), (4, 1)], [1, 2]))
AttnCase = tuple[int, int, int, bool, tuple[int, int], int]
LONG_CASES: list[AttnCase] = [(8193, 8193, 128, True, (4, 2), 1), (8193, 8193, 256, False, (4, 1), 1),
                              (1000, 8193, 64, True, (4, 4), 2), (8193, 255, 128, False, (4, 2), 1),
                              # 65 query tiles in CTA pairs: the last pair's second tile lies past the rows
                              (8193, 2048, 128, False, (4, 2), 1), (8193, 2048, 256, False, (4, 1), 1)]


def attn_grid() -> list[AttnCase]:
    cases = []
    for p, (sq, sk) in enumerate(itertools.product(ATTN_SEQLENS, ATTN_SEQLENS)):
        for j, (d, causal) in enumerate(itertools.product(HDIMS, (False, True))):
            heads, batch = ATTN_ROTATED[(p + j) % len(ATTN_ROTATED)]
            cases.append((sq, sk, d, causal, heads, batch))
    return cases + LONG_CASES


def attn_id(c: AttnCase) -> str:
    sq, sk, d, causal, (hq, hkv), batch = c
    return f"{sq}x{sk}-d{d}-{'causal' if causal else 'full'}-h{hq}kv{hkv}-b{batch}"


def test_attn_grid_covers_every_value() -> None:  # runs anywhere
    cases = attn_grid()[: len(ATTN_SEQLENS) ** 2 * len(HDIMS) * 2]
    for d, causal in itertools.product(HDIMS, (False, True)):
        assert {(hs, b) for (_, _, dd, c, hs, b) in cases if (dd, c) == (d, causal)} == set(ATTN_ROTATED)


@pytest.mark.gpu
@pytest.mark.parametrize("case", attn_grid(), ids=attn_id)
def test_fwd_fp8(case: AttnCase) -> None:
    sq, sk, d, causal, (hq, hkv), batch = case
    require_fp8_kernel(d, causal)
    q, k, v = randn_qkv(batch, sq, sk, hq, hkv, d, torch.bfloat16, DEV)
    # The call's default blocks: the short-key tile's where the call is within its reach (test_short_keys_kernel).
    q8, k8, v8 = quantize_qkv(q, k, v, fp8.default_kv_block_size(d, causal, sk))
    out, lse = poisoned(batch, sq, hq, d)
    scale = 1 / math.sqrt(d)
    fp8.fwd_fp8_into(q8, k8, v8, out, lse, scale, causal)
    check_attention(out, lse, q, k, v, q8, k8, v8, scale, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", HDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_fp8_func(headdim: int, causal: bool) -> None:
    # bf16 q, k, v quantized inside with the defaults = quantize_qkv + fwd_fp8_into, bit for bit;
    # fp16 inputs too; return_lse; a softmax scale other than the default.
    require_fp8_kernel(headdim, causal)
    q, k, v = randn_qkv(2, 300, 1000, 8, 2, headdim, torch.bfloat16, DEV)
    scale = 0.7 / math.sqrt(headdim)
    out, lse = fp8.flash_attn_fp8_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (2, 8, 300)
    q8, k8, v8 = quantize_qkv(q, k, v, fp8.default_kv_block_size(headdim, causal, 1000))
    into, into_lse = poisoned(2, 300, 8, headdim)
    fp8.fwd_fp8_into(q8, k8, v8, into, into_lse, scale, causal)
    assert torch.equal(out, into) and torch.equal(lse, into_lse), \
        "flash_attn_fp8_func(bf16 q, k, v) differs from quantize_fp8 (Q 64, K/V block_n, Hadamard) + the kernel"
    check_attention(out, lse, q, k, v, q8, k8, v8, scale, causal)
    assert torch.equal(fp8.flash_attn_fp8_func(q, k, v, softmax_scale=scale, causal=causal), out)

    q16, k16, v16 = (x.half() for x in (q, k, v))
    out16 = fp8.flash_attn_fp8_func(q16, k16, v16, causal=causal)
    assert out16.dtype == torch.bfloat16
    assert rel_err(out16, attention_ref(q16, k16, v16, None, causal)[0]) < REF_REL


# (seqlen_k, K/V block: None one scale per head); 384 is read by both tiles, 256 only by the short one, 192 only by
# the long one (but where one block covers the row), 128 by the short one.
SHORT_KEYS_CASES = [(129, 192), (129, 128), (640, 128), (640, 192), (640, None), (1000, 384), (1024, 128),
                    (1025, 128), (1025, 384), (2048, 256), (2048, 192), (1500, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_short_keys_kernel(causal: bool) -> None:
    # The padded e4m3 d128 forward's short-key tile (128 keys) beside its 192-key one: each call runs the tile that
    # reads its scale blocks (tests/helpers.py: fp8_kernel_block_n), checked against the emulation in that tile's
    # order and the references; blocks that neither tile reads, or K and V in blocks of different tiles, refused.
    require_fp8_kernel(128, causal)
    short = fp8.ops.short_keys(128, causal)
    if short is None:
        pytest.skip("no short-key tile beside the e4m3 d128 forward in this build")
    assert short == (128, 1024), short
    assert fp8.default_kv_block_size(128, causal, 1024) == 128
    assert fp8.default_kv_block_size(128, causal, 1025) == fp8.kernel_tiles(128, causal)[1]
    ran = set()
    for i, (sk, block) in enumerate(SHORT_KEYS_CASES):
        torch.manual_seed(i)
        q, k, v = randn_qkv(2, 300, sk, 4, 2, 128, torch.bfloat16, DEV)
        gran = ("block", "head", "head") if block is None else ("block",) * 3
        q8, k8, v8 = quantize_qkv(q, k, v, block or 0, gran, kernel=False if block == 384 else None)
        ran.add(fp8_kernel_block_n(128, causal, sk, k8.block_size, v8.block_size))
        out, lse = poisoned(2, 300, 4, 128)
        fp8.fwd_fp8_into(q8, k8, v8, out, lse, 1 / math.sqrt(128), causal)
        check_attention(out, lse, q, k, v, q8, k8, v8, 1 / math.sqrt(128), causal)
    assert ran == {128, fp8.kernel_tiles(128, causal)[1]}, ran
    q, k, v = randn_qkv(1, 64, 1000, 4, 2, 128, torch.bfloat16, DEV)
    q8, k8, v8 = quantize_qkv(q, k, v, 128)
    with pytest.raises(ValueError, match="multiple of 192 or 128"):
        fp8.flash_attn_fp8_func(q, k, v, causal=causal, kv_block_size=96)
    with pytest.raises(ValueError, match="both must be multiples of the same one"):
        fp8.flash_attn_fp8_func(q8, fp8.quantize_fp8(k, block_size=192), v8, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", HDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_inference_path(headdim: int, causal: bool) -> None:
    # A quantized KV cache (quantize_kv: K and V per block_n keys, V^T) attended by bf16 queries.
    block_n = require_fp8_kernel(headdim, causal)
    q, k, v = randn_qkv(2, 300, 1000, 8, 2, headdim, torch.bfloat16, DEV)
    kv = fp8.quantize_kv(k, v, causal=causal)
    assert kv.k.block_size == block_n and kv.v.block_size == block_n, (kv.k.block_size, kv.v.block_size, block_n)
    assert kv.v.transposed  # V^T, the layout the kernels read
    assert not kv.k.transposed and kv.k.hadamard_seed == 0 and kv.v.hadamard_seed is None
    out = kv.attend(q, causal=causal)
    q8 = fp8.quantize_fp8(q, block_size=Q_BLOCK, hadamard=True, seed=0)
    into, lse = poisoned(2, 300, 8, headdim)
    scale = 1 / math.sqrt(headdim)
    fp8.fwd_fp8_into(q8, kv.k, kv.v, into, lse, scale, causal)
    assert torch.equal(out, into), "kv.attend(q) differs from quantize_fp8(q, 64, seed of k) + the kernel"
    assert torch.equal(fp8.flash_attn_fp8_func(q, kv.k, kv.v, causal=causal), out)
    check_attention(into, lse, q, k, v, q8, kv.k, kv.v, scale, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_seed", [None, 0, 7], ids=["no-hadamard", "seed0", "seed7"])
def test_bf16_q_follows_k_seed(kv_seed: int | None) -> None:
    # flash_attn_fp8_func's own hadamard/seed arguments (defaults: on, 0) do not apply to a bf16 q met with
    # a pre-quantized k: q is rotated as k was (or not at all), else QK^T would be garbage.
    block_n = require_fp8_kernel(128, False)
    q, k, v = randn_qkv(2, 256, 700, 8, 2, 128, torch.bfloat16, DEV)
    had = kv_seed is not None
    kv = fp8.quantize_kv(k, v, hadamard=had, seed=kv_seed or 0, causal=False)
    assert kv.k.hadamard_seed == kv_seed
    out = fp8.flash_attn_fp8_func(q, kv.k, kv.v)
    q8 = fp8.quantize_fp8(q, block_size=Q_BLOCK, hadamard=had, seed=kv_seed or 0)
    assert q8.hadamard_seed == kv_seed
    into, lse = poisoned(2, 256, 8, 128)
    fp8.fwd_fp8_into(q8, kv.k, kv.v, into, lse, 1 / math.sqrt(128), False)
    assert torch.equal(out, into), f"bf16 q was not quantized with k's Hadamard seed {kv_seed}"
    check_attention(into, lse, q, k, v, q8, kv.k, kv.v, 1 / math.sqrt(128), False)
    assert kv.k.block_size == block_n
    # Two pre-quantized tensors with different seeds cannot be reconciled: refused.
    other = fp8.quantize_fp8(q, block_size=Q_BLOCK, hadamard=True, seed=(kv_seed or 0) + 1)
    with pytest.raises(ValueError, match="hadamard_seed"):
        fp8.flash_attn_fp8_func(other, kv.k, kv.v)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", HDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_prequantized_v_not_transposed(headdim: int, causal: bool) -> None:
    # An fp8 V in (b, s, h, d) layout goes through to_vt; same result as V quantized straight to V^T.
    block_n = require_fp8_kernel(headdim, causal)
    q, k, v = randn_qkv(1, 500, 777, 4, 2, headdim, torch.bfloat16, DEV)
    q8, k8, vt8 = quantize_qkv(q, k, v, block_n)
    v8 = fp8.quantize_fp8(v, block_size=block_n, hadamard=False)
    assert not v8.transposed
    out_vt = fp8.flash_attn_fp8_func(q8, k8, vt8, causal=causal)
    out_v = fp8.flash_attn_fp8_func(q8, k8, v8, causal=causal)
    out_moved = fp8.flash_attn_fp8_func(q8, k8, fp8.to_vt(v8), causal=causal)
    assert torch.equal(out_v, out_vt) and torch.equal(out_moved, out_vt)
    out, lse = poisoned(1, 500, 4, headdim)
    fp8.fwd_fp8_into(q8, k8, fp8.to_vt(v8), out, lse, 1 / math.sqrt(headdim), causal)
    check_attention(out, lse, q, k, v, q8, k8, vt8, 1 / math.sqrt(headdim), causal)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", HDIMS)
def test_from_vt_inverts_the_quantized_vt(headdim: int) -> None:
    # from_vt of the quantization kernel's V^T is its row-major output, bit for bit (padding dropped).
    require_quant_kernel()
    v = quant_input(2, 1000, 3, headdim, torch.bfloat16, "packed")
    v8 = fp8.quantize_fp8(v, block_size=128, hadamard=False, kernel=True)
    vt8 = fp8.quantize_fp8(v, block_size=128, hadamard=False, transpose=True, kernel=True)
    back = fp8.from_vt(vt8)
    assert not back.transposed and back.seqlen == 1000 and back.data.is_contiguous()
    assert torch.equal(fp8_bytes(back.data), fp8_bytes(v8.data)), "from_vt(V^T) is not the row-major V"
    assert torch.equal(fp8_bytes(fp8.to_vt(back).data), fp8_bytes(vt8.data))
    assert fp8.from_vt(v8) is v8


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", HDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_vt_views(headdim: int, causal: bool) -> None:
    # The kernel reads V^T through its strides: a V^T cut from a wider buffer of NaN bytes (head-dim rows
    # 32 keys further apart than they need) gives the output of the contiguous V^T, bit for bit; one whose
    # rows are not 16 bytes apart (TMA) is refused before the launch, and out is left alone.
    block_n = require_fp8_kernel(headdim, causal)
    b, sq, sk, hq, hkv = 2, 200, 300, 4, 2
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, headdim, torch.bfloat16, DEV)
    q8, k8, v8 = quantize_qkv(q, k, v, block_n)
    sp = v8.data.shape[-1]
    scale = 1 / math.sqrt(headdim)
    want, want_lse = poisoned(b, sq, hq, headdim)
    fp8.fwd_fp8_into(q8, k8, v8, want, want_lse, scale, causal)
    for extra, ok in ((32, True), (8, False)):
        buf = torch.full((b, hkv, headdim, sp + extra), 0x7F, dtype=torch.uint8, device=DEV)  # e4m3 NaN
        buf[..., :sp] = fp8_bytes(v8.data)
        view = v8._replace(data=buf[..., :sp].view(torch.float8_e4m3fn))
        got, got_lse = poisoned(b, sq, hq, headdim)
        if ok:
            assert fp8.fwd_fp8_into(q8, k8, view, got, got_lse, scale, causal) > 0
            assert torch.equal(got, want) and torch.equal(got_lse, want_lse), "a strided V^T changed the result"
        else:
            with pytest.raises(ValueError, match=r"^v \(V\^T\) dim stride"):
                fp8.fwd_fp8_into(q8, k8, view, got, got_lse, scale, causal)
            assert torch.isnan(got).all() and torch.isnan(got_lse).all(), "a refused call wrote to out"
    check_attention(want, want_lse, q, k, v, q8, k8, v8, scale, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", HDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_v_view_with_nan_around(headdim: int, causal: bool) -> None:
    # A row-major fp8 V that is a view into a larger buffer of NaN bytes: its rows 2 x heads x headdim apart
    # and more rows past seqlen_k. fwd_fp8_into brings it to V^T (to_vt copies what the view shows, none of
    # the NaN around it): the output of a contiguous V, bit for bit.
    block_n = require_fp8_kernel(headdim, causal)
    b, sq, sk, hq, hkv = 2, 300, 777, 4, 2
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, headdim, torch.bfloat16, DEV)
    q8, k8, _ = quantize_qkv(q, k, v, block_n)
    v8 = fp8.quantize_fp8(v, block_size=block_n, hadamard=False)
    buf = torch.full((b, sk + 2 * block_n, 2, hkv, headdim), 0x7F, dtype=torch.uint8, device=DEV)  # e4m3 NaN
    buf[:, :sk, 0] = fp8_bytes(v8.data)
    view = v8._replace(data=buf[:, :sk, 0].view(torch.float8_e4m3fn))
    assert not view.data.is_contiguous()
    scale = 1 / math.sqrt(headdim)
    want, want_lse = poisoned(b, sq, hq, headdim)
    fp8.fwd_fp8_into(q8, k8, v8, want, want_lse, scale, causal)
    got, got_lse = poisoned(b, sq, hq, headdim)
    fp8.fwd_fp8_into(q8, k8, view, got, got_lse, scale, causal)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse), "a strided V view changed the result"
    check_attention(got, got_lse, q, k, v, q8, k8, v8, scale, causal)


def head_scaled_qkv(batch: int, seqlen_q: int, seqlen_k: int, hq: int, hkv: int, d: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """randn q, k, v whose heads have different magnitudes (per-head scales differ) and the same
    scores: query heads of kv head j times c_j, k head j divided by c_j; v head j times its own factor."""
    q, k, v = randn_qkv(batch, seqlen_q, seqlen_k, hq, hkv, d, torch.float32, DEV)
    c = 2.0 ** torch.arange(-2, hkv - 2, device=DEV, dtype=torch.float32)  # (hkv,)
    q = q * c.repeat_interleave(hq // hkv)[:, None]
    k = k / c[:, None]
    v = v * c.flip(0)[:, None] * 3
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", [("tensor",) * 3, ("head",) * 3, ("block", "head", "tensor"),
                                         ("head", "tensor", "block")], ids="-".join)
@pytest.mark.parametrize("causal", [False, True])
def test_scale_granularities(granularity: tuple[str, str, str], causal: bool) -> None:
    # Per-head and per-tensor scales (strided / broadcast scale tensors) through the kernel.
    block_n = require_fp8_kernel(128, causal)
    q, k, v = head_scaled_qkv(2, 700, 1000, 8, 4, 128)
    q8, k8, v8 = quantize_qkv(q, k, v, block_n, granularity)
    for x8, gran in zip((q8, k8, v8), granularity):
        scales = x8.scales()  # (batch, nheads, nblocks), broadcast where the scale is shared
        if gran != "block":
            assert scales.shape[2] == 1, (gran, tuple(x8.scale.shape))
            distinct = scales.unique().numel()
            assert distinct == 1 if gran == "tensor" else distinct > 1, (gran, scales.flatten().tolist())
    out, lse = poisoned(2, 700, 8, 128)
    fp8.fwd_fp8_into(q8, k8, v8, out, lse, 1 / math.sqrt(128), causal)
    check_attention(out, lse, q, k, v, q8, k8, v8, 1 / math.sqrt(128), causal)


@pytest.mark.gpu
def test_scale_blocks_the_kernel_cannot_use_are_refused() -> None:
    # One Q scale per 64 rows and one K/V scale per block_n keys at least (docs/fp8.md): finer blocks
    # are refused before launch, not read wrongly.
    block_n = require_fp8_kernel(128, False)
    q, k, v = randn_qkv(1, 256, 512, 4, 4, 128, torch.bfloat16, DEV)
    q8, k8, v8 = quantize_qkv(q, k, v, block_n)
    out, lse = poisoned(1, 256, 4, 128)
    bad_q = fp8.quantize_fp8(q, block_size=32, seed=0)
    bad_k = fp8.quantize_fp8(k, block_size=16, seed=0)
    bad_v = fp8.quantize_fp8(v, block_size=16, hadamard=False, transpose=True)
    for args in ((bad_q, k8, v8), (q8, bad_k, v8), (q8, k8, bad_v)):
        with pytest.raises(ValueError):
            fp8.fwd_fp8_into(*args, out, lse, 1 / math.sqrt(128), False)
    assert torch.isnan(out).all(), "a refused call wrote to out"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_empty_inputs_reach_the_kernels(causal: bool) -> None:
    # No Python short cut: with no query row, batch or head the launchers are called and report an empty
    # grid (0 CTAs); with no key the kernel runs and writes O = 0, LSE = -inf over the NaN poison.
    # flash_attn_fp8_func goes the same way, through the quantization kernel (empty there too).
    block_n = require_fp8_kernel(128, causal)
    require_quant_kernel()
    for b, sq, sk, hq, hkv, runs in ((2, 0, 300, 4, 2, False), (0, 100, 300, 4, 2, False),
                                     (2, 100, 300, 0, 0, False), (2, 100, 0, 4, 2, True), (1, 1, 0, 2, 1, True)):
        where = f"b {b} sq {sq} sk {sk} hq {hq} hkv {hkv} causal={causal}"
        q, k, v = randn_qkv(b, sq, sk, hq, hkv, 128, torch.bfloat16, DEV)
        q8, k8, v8 = quantize_qkv(q, k, v, block_n)
        out, lse = poisoned(b, sq, hq, 128)
        ctas = fp8.fwd_fp8_into(q8, k8, v8, out, lse, 0.1, causal)
        assert (ctas > 0) == runs, f"{ctas} CTAs launched: {where}"
        if runs:
            assert (out == 0).all() and torch.isneginf(lse).all(), f"no key: out must be 0 and lse -inf: {where}"
        got, got_lse = fp8.flash_attn_fp8_func(q, k, v, causal=causal, return_lse=True)
        assert got.shape == q.shape and torch.equal(got, out) and torch.equal(got_lse, lse), where


# --- 3. accuracy on the FlashAttention-3 outlier setup ---------------------------------------------

def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(reference_fp8.rmse(a.double(), b.double()))


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [128, 256])
def test_outlier_accuracy_table(headdim: int) -> None:
    # FA3 paper, section 4.3: Q, K, V ~ N(0, 1) with 0.1% of the entries N(0, 10^2); RMSE of the
    # output against float64 attention of the same (bf16) inputs.
    block_n = require_fp8_kernel(headdim, False)
    gen = torch.Generator().manual_seed(0)
    shape = (2, 2048, 8, headdim)
    q, k, v = (reference_fp8.outlier_inputs(shape, gen).to(DEV, torch.bfloat16) for _ in range(3))
    ref, _ = attention_ref(q, k, v, None, False, dtype=torch.float64)
    scale = 1 / math.sqrt(headdim)
    rows: dict[str, tuple[float, float | None]] = {}
    try:
        rows["bf16 kernel (baseline)"] = (rmse(flashhopper.flash_attn_func(q, k, v), ref), None)
    except ValueError:  # no bf16 kernel in this build: the table goes without the baseline
        pass
    schemes = {"fp8 per-tensor": (("tensor",) * 3, False), "fp8 per-block": (("block",) * 3, False),
               "fp8 per-block + Hadamard": (("block",) * 3, True)}
    for name, (gran, had) in schemes.items():
        q8, k8, v8 = quantize_qkv(q, k, v, block_n, gran, hadamard=had)
        out = fp8.flash_attn_fp8_func(q8, k8, v8, softmax_scale=scale)
        emu, _ = emulate_kernel(q8, k8, v8, scale, False, block_n)
        rows[name] = (rmse(out, ref), rmse(emu.to(out.device), ref))

    print(f"\nFA3 outlier setup, b=2 s=2048 h=8 d={headdim}: RMSE against float64 attention\n")
    print("| scheme | RMSE kernel | RMSE emulate_kernel |\n|---|---|---|")
    for name, (kern, emu_rmse) in rows.items():
        print(f"| {name} | {kern:.2e} | {'' if emu_rmse is None else f'{emu_rmse:.2e}'} |")
    tensor, best = rows["fp8 per-tensor"][0], rows["fp8 per-block + Hadamard"][0]
    print(f"\nper-tensor / (per-block + Hadamard) = {tensor / best:.2f}")

    for name in schemes:
        kern, emu_rmse = rows[name]
        assert emu_rmse is not None and abs(kern - emu_rmse) <= OUTLIER_EMU_RTOL * emu_rmse, \
            f"{name}: kernel RMSE {kern:.3e} vs emulation {emu_rmse:.3e}"
    assert best <= tensor / OUTLIER_MIN_RATIO, \
        f"per-block + Hadamard RMSE {best:.3e} is not {OUTLIER_MIN_RATIO}x below per-tensor {tensor:.3e}"


# --- 4. the torch ops: torch.compile and CUDA graphs -----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_compile_fullgraph(causal: bool) -> None:
    # One graph (fullgraph=True raises on a break) holding the quantization and attention ops: bit for bit
    # the eager result, and that result checked against the emulations and exact attention.
    require_fp8_kernel(128, causal)
    block_n = fp8.default_kv_block_size(128, causal, 700)  # what the call quantizes with (its short-key tile's)
    torch._dynamo.reset()
    q, k, v = randn_qkv(2, 300, 700, 8, 2, 128, torch.bfloat16, DEV)

    def attend(q: torch.Tensor, k: torch.Tensor | fp8.FP8Tensor, v: torch.Tensor | fp8.FP8Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8.flash_attn_fp8_func(q, k, v, causal=causal, return_lse=True, seed=SEED)

    compiled = torch.compile(attend, fullgraph=True)
    out, lse = compiled(q, k, v)
    want, want_lse = attend(q, k, v)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "compiled flash_attn_fp8_func differs from eager"
    q8, k8, v8 = quantize_qkv(q, k, v, block_n, seed=SEED)
    check_attention(out, lse, q, k, v, q8, k8, v8, 1 / math.sqrt(128), causal)
    # Pre-quantized K and a row-major fp8 V (to_vt inside the graph).
    v_rows = fp8.quantize_fp8(v, block_size=block_n, hadamard=False)
    out2, _ = compiled(q, k8, v_rows)
    assert torch.equal(out2, attend(q, k8, v_rows)[0]) and torch.equal(out2, out)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_graph_capture_of_a_first_call(causal: bool) -> None:
    # The capture holds the very first call for its configuration (head dim 64, shapes and Hadamard seeds
    # no other test uses): nothing on the way may copy host to device or synchronize, first calls
    # included (the signs are hashed in the kernel, the V^T index is made on the device, the tile counter
    # is zeroed by a graph node). The inputs then change in place and the graph replays: eager's output
    # on the new inputs, bit for bit, and within fp8's error of exact attention.
    block_n = require_fp8_kernel(64, causal)
    require_quant_kernel()
    b, sq, sk, hq, hkv, d = 1, 333, 517, 6, 3, 64
    seed, kv_seed = 0x5EED_0000_0001 + causal, -0x5EED - causal
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, d, torch.bfloat16, DEV)
    k8 = fp8.quantize_fp8(k, block_size=block_n, seed=kv_seed)  # static fp8 inputs, refilled below
    v_rows = fp8.quantize_fp8(v, block_size=block_n, hadamard=False)  # row-major: to_vt runs in the graph

    def attend() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, lse = fp8.flash_attn_fp8_func(q, k, v, causal=causal, seed=seed, return_lse=True)
        return out, lse, fp8.flash_attn_fp8_func(q, k8, v_rows, causal=causal)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attend()
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    for static, new in ((k8, fp8.quantize_fp8(k, block_size=block_n, seed=kv_seed)),
                        (v_rows, fp8.quantize_fp8(v, block_size=block_n, hadamard=False))):
        fp8_bytes(static.data).copy_(fp8_bytes(new.data))
        static.scale.copy_(new.scale)
    graph.replay()
    torch.cuda.synchronize()
    want = attend()
    for name, got, w in zip(("out", "lse", "out (fp8 k, row-major v)"), captured, want):
        assert torch.equal(got, w), f"{name} of the replayed graph differs from eager on the new inputs"
    q8, k8e, v8 = quantize_qkv(q, k, v, block_n, seed=seed)
    check_attention(captured[0], captured[1], q, k, v, q8, k8e, v8, 1 / math.sqrt(d), causal)
