"""Error measures, the assertions every kernel result goes through (forward and backward), and the GPU
tests' gate (require_backend: skip what cannot run here or was not built by choice, fail what is missing)."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any

import pytest
import torch

from flashhopper import _device, _ext, dispatch, fp8
from flashhopper.dropout import Dropout, from_rng_state, new_rng_state
from flashhopper.kernel_key import KernelKey
from flashhopper.reference import (attention_bwd_lowp, attention_bwd_ref, attention_lowp, attention_ref, sinks_grad_ref,
                                   visible)


def poison_allocator(*nbytes: int, device: torch.device | str = "cuda") -> None:
    """Fill blocks of these sizes with 0xFF (NaN as e4m3, bf16, fp16 and float32) and free them at once: the
    caching allocator hands the same memory to the next allocations of those sizes, so outputs the
    kernel leaves unwritten show up as NaN instead of as (often zero) fresh memory. Best effort: the
    allocator makes no promise which block the next tensor gets."""
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=device) for n in nbytes if n > 0]
    del blocks


@pytest.fixture
def nan_kvcache_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash_attn_with_kvcache allocates out and lse itself (kvcache._empty_outputs, on its full and fast paths):
    here they come NaN-filled, so that an element the kernel leaves unwritten fails the comparison (a module's
    tests take it with pytest.mark.usefixtures)."""
    from flashhopper import kvcache
    empty = kvcache._empty_outputs

    def filled(q: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = empty(q, v_cache)
        return out.fill_(math.nan), lse.fill_(math.nan)

    monkeypatch.setattr(kvcache, "_empty_outputs", filled)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| with norms in float64 (||out - ref|| when ref is all zeros)."""
    ref64 = ref.double()
    diff = (out.double() - ref64).norm().item()
    norm = ref64.norm().item()
    return diff / norm if norm > 0 else diff


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0


def randn_qkv(batch: int, seqlen_q: int, seqlen_k: int, nheads_q: int, nheads_kv: int, headdim: int,
              dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(batch, seqlen_q, nheads_q, headdim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, dtype=dtype, device=device)
    return q, k, v


def assert_matches_reference(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, softmax_scale: float | None, causal: bool,
                             atol: float = 1e-4, rtol: float = 1e-4, lse_atol: float = 1e-4, *,
                             window: tuple[int, int] | None = None, softcap: float = 0.0,
                             sinks: torch.Tensor | None = None, dropout: Dropout | None = None) -> None:
    """A low-precision result passes iff it is at most twice as far from exact (float64) attention
    as PyTorch's own attention in the input precision is, plus a small slack: in max-abs error
    and in relative norm error, for out and for the finite lse rows. Rows that see no key must be
    exactly 0 with lse exactly -inf (with sinks: lse is the sink). NaN never passes. ``window``,
    ``softcap``, ``sinks``, ``dropout``: the variant the result was computed with (flash_attn_func's arguments;
    dropout: the draw, flashhopper.dropout)."""
    ref, ref_lse = attention_ref(q, k, v, softmax_scale, causal, window=window, softcap=softcap, sinks=sinks,
                                 dropout=dropout, dtype=torch.float64)
    lowp, lowp_lse = attention_lowp(q, k, v, softmax_scale, causal, window=window, softcap=softcap, sinks=sinks,
                                    dropout=dropout)
    where = (f"shape q {tuple(q.shape)} k {tuple(k.shape)} {q.dtype} causal={causal} window={window} "
             f"softcap={softcap} sinks={'yes' if sinks is not None else 'no'}")

    assert not torch.isnan(out).any(), f"out has NaN (rows left unwritten?): {where}"
    assert not torch.isnan(lse).any(), f"lse has NaN (rows left unwritten?): {where}"
    err, lowp_err = max_abs_err(out, ref), max_abs_err(lowp, ref)
    assert err <= 2 * lowp_err + atol, f"out max-abs error {err:.3e} > 2 x {lowp_err:.3e} + {atol}: {where}"
    rel, lowp_rel = rel_err(out, ref), rel_err(lowp, ref)
    assert rel <= 2 * lowp_rel + rtol, f"out relative error {rel:.3e} > 2 x {lowp_rel:.3e} + {rtol}: {where}"

    no_key = rows_without_keys(q.shape[1], k.shape[1], causal, window, q.device).expand_as(lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), \
        f"lse is -inf on other rows than the reference: {where}"  # rows without keys, unless sinks
    assert (out.transpose(1, 2)[no_key] == 0).all(), f"rows that see no key are not exactly 0: {where}"
    finite = ~torch.isneginf(ref_lse)
    lse_err = max_abs_err(lse[finite], ref_lse[finite])
    lowp_lse_err = max_abs_err(lowp_lse[finite], ref_lse[finite])
    assert lse_err <= 2 * lowp_lse_err + lse_atol, \
        f"lse max-abs error {lse_err:.3e} > 2 x {lowp_lse_err:.3e} + {lse_atol}: {where}"


def rows_without_keys(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int] | None,
                      device: torch.device | str) -> torch.Tensor:
    """(seqlen_q,) bool: the query rows that see no key (their out and dq are exactly 0; their lse is -inf,
    or the sink with sinks). From each row's edges, without building the (seqlen_q, seqlen_k) mask."""
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)
    diag = seqlen_k - seqlen_q
    lo = torch.clamp(i + diag - left, min=0) if left >= 0 else torch.zeros_like(i)
    hi = torch.clamp(i + diag + right, max=seqlen_k - 1) if right >= 0 else torch.full_like(i, seqlen_k - 1)
    return hi < lo


def keys_seen(seqlen_q: int, seqlen_k: int, causal: bool, device: torch.device | str,
              window: tuple[int, int] | None = None) -> torch.Tensor:
    """How many keys each query row sees, (seqlen_q,)."""
    sees = visible(seqlen_q, seqlen_k, causal, device, window=window)
    if sees is None:
        return torch.full((seqlen_q,), seqlen_k, device=device)
    return sees.sum(1)


def one_key_noise_bound(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        softmax_scale: float, causal: bool, window: tuple[int, int] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise bounds on |dq| and |dk| when every row sees at most one key (and there is no dlse):
    seqlen_k 1, or a window one key wide (left 0 with causal, or (0, 0)).

    With one key the softmax is constant (P = 1 on the rows that see it), so dq and dk are 0 in
    exact arithmetic: dS = dP - D with dP = dO.v and D = dO.O = dO.v. What any implementation returns
    is rounding noise, and "twice PyTorch's error" would mean exactly 0 (PyTorch's D is rowsum(P * dP)
    of the very same dP). A float32 dot product of length d is off by at most d * u * sum|dO||v| (v of
    the row's key; u = 2^-24; doubled for truncating tensor-core sums), so |dS| <= 4 d u sum|dO||v| =: e;
    dq = scale * dS * k elementwise, bounded by scale * e * |k|. dk of a key = scale * sum over the rows
    that see it (and the GQA group) of dS * q: terms of independent signs (q's), so 6 root-sum-squares
    of the term bounds (Hoeffding: exceeded with probability < 1e-7 even if every |dS| sat at its bound,
    which it is far below); the worst case sum |.| would be looser by sqrt(rows) and hide real errors.
    Both returned twice over, for the roundings after dS (to q.dtype, the float32 sums of dk).
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv if hkv else 1
    if sk == 0:  # no key at all: the gradients are exactly 0
        return torch.zeros(b, sq, hq, d, device=q.device), torch.zeros(b, 0, hkv, d, device=q.device)
    sees = visible(sq, sk, causal, q.device, window=window)
    if sees is None:
        sees = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    key = sees.int().argmax(1)  # (sq,) the key each row sees (rows that see none: masked out below)
    seen = sees.any(1)[None, :, None]  # (1, sq, 1)
    k32 = k.float()[:, key].repeat_interleave(group, dim=2)  # (b, sq, hq, d): the key of each row
    v32 = v.float()[:, key].repeat_interleave(group, dim=2)
    ds = 4 * d * 2.0 ** -24 * (dout.float().abs() * v32.abs()).sum(-1) * seen  # (b, sq, hq)
    dq = softmax_scale * ds[..., None] * k32.abs()
    terms = (softmax_scale * ds[..., None] * q.float()).square()  # (b, sq, hq, d)
    sq_terms = torch.zeros(b, sk, hq, d, device=q.device).index_add_(1, key, terms)
    dk = 6 * sq_terms.view(b, sk, hkv, group, d).sum(3).sqrt()
    return 2 * dq, 2 * dk


def assert_grads_match(grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor], dout: torch.Tensor,
                       q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None,
                       causal: bool, dlse: torch.Tensor | None = None, ref_dtype: torch.dtype | None = None,
                       atol: float = 1e-4, rtol: float = 1e-4, *, window: tuple[int, int] | None = None,
                       softcap: float = 0.0, sinks: torch.Tensor | None = None,
                       dropout: Dropout | None = None) -> None:
    """Backward counterpart of assert_matches_reference. Low-precision gradients (dq, dk, dv) pass
    iff each is at most twice as far from the reference gradients as PyTorch's own backward in the
    input precision is (reference.attention_bwd_lowp, i.e. autograd through attention_lowp), plus a
    small slack: max-abs error <= 2 x PyTorch's + atol, and relative norm error <= 2 x PyTorch's + rtol.

    The reference: the backward formula (attention_bwd_ref) applied to exact out and lse
    (attention_ref), all in ``ref_dtype``: default float32 on the GPU (float64 there is slow at 8k
    tokens and float32's own error is ~1e-6, far below bf16/fp16's) and float64 elsewhere.
    ``dout`` and ``dlse`` are the upstream gradients the kernel was given. NaN never passes; dq rows
    that see no key must be exactly 0. When every row sees at most one key (seqlen_k 1, a window one key
    wide; without dlse) dq and dk vanish in exact arithmetic and are checked against one_key_noise_bound
    instead.
    """
    scale = 1 / q.shape[-1] ** 0.5 if softmax_scale is None else softmax_scale
    if ref_dtype is None:
        ref_dtype = torch.float32 if q.is_cuda else torch.float64
    ref_out, ref_lse = attention_ref(q, k, v, scale, causal, window=window, softcap=softcap, sinks=sinks,
                                     dropout=dropout, dtype=ref_dtype)
    ref = attention_bwd_ref(dout, q, k, v, ref_out, ref_lse, scale, causal, dlse, window=window, softcap=softcap,
                            dropout=dropout, dtype=ref_dtype)
    del ref_out
    lowp = attention_bwd_lowp(dout, q, k, v, scale, causal, dlse, window=window, softcap=softcap, sinks=sinks,
                              dropout=dropout)
    where = (f"shape q {tuple(q.shape)} k {tuple(k.shape)} {q.dtype} causal={causal} window={window} "
             f"softcap={softcap} sinks={'yes' if sinks is not None else 'no'} dlse={'yes' if dlse is not None else 'no'}")
    vanishing: dict[str, torch.Tensor] = {}
    # Only seqlen_k <= 1 or a window can leave every row at most one key: the mask is built only then.
    # (With sinks the softmax is not constant even over one key: the sink takes part.)
    if dlse is None and sinks is None and (k.shape[1] <= 1 or window is not None) \
            and bool((keys_seen(q.shape[1], k.shape[1], causal, q.device, window) <= 1).all()):
        vanishing = dict(zip(("dq", "dk"), one_key_noise_bound(dout, q, k, v, scale, causal, window)))

    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref, lowp):
        assert g.shape == r.shape, f"{name} shape {tuple(g.shape)} != {tuple(r.shape)}: {where}"
        assert not torch.isnan(g).any(), f"{name} has NaN (elements left unwritten?): {where}"
        if name in vanishing:
            excess = (g.float().abs() - vanishing[name]).max().item() if g.numel() else 0.0
            assert excess <= 0, (f"{name} should be rounding noise (every row sees at most one key: softmax is constant), but exceeds "
                                 f"its bound by {excess:.3e}: {where}")
            continue
        err, lowp_err = max_abs_err(g, r), max_abs_err(lo, r)
        assert err <= 2 * lowp_err + atol, f"{name} max-abs error {err:.3e} > 2 x {lowp_err:.3e} + {atol}: {where}"
        rel, lowp_rel = rel_err(g, r), rel_err(lo, r)
        assert rel <= 2 * lowp_rel + rtol, f"{name} relative error {rel:.3e} > 2 x {lowp_rel:.3e} + {rtol}: {where}"
    no_key = rows_without_keys(q.shape[1], k.shape[1], causal, window, q.device)[None, :, None]
    assert (grads[0][no_key.expand(*grads[0].shape[:3])] == 0).all(), f"dq rows that see no key are not exactly 0: {where}"


def control_ratio(grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor], dout: torch.Tensor, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
                  dlse: torch.Tensor | None = None, *, window: tuple[int, int] | None = None, softcap: float = 0.0,
                  sinks: torch.Tensor | None = None, dropout: Dropout | None = None,
                  slack: float = 1e-4) -> tuple[float, str]:
    """FA3's criterion with its baseline widened by a control, for gradients that failed it on bounds.

    A FlashAttention-style backward rounds where PyTorch's does not (D = rowsum(dout * out) from the 16-bit
    out; P and dS rounded to the dtype for the matmuls); with few keys dq and dk are small and those
    roundings alone can exceed the criterion's bound (2 x PyTorch's error vs the exact gradients): a
    faithful emulation of them (the control: tests/test_reference_bwd.py's emulated_kernel) fails it on
    some 7% of inputs with seqlen 2, and the kernels, rounding the same way independently, fail it on
    1-2 of 40 random inputs of 17 keys at every head dim (docs/perf-notes.md, #23 head dims). So each
    gradient is judged against 2 x the larger of the two low-precision errors, PyTorch's and the
    control's, plus the slack (relative norm error; max-abs error elementwise, with 1.5 units in the last
    place of each element on top: with few elements the largest may be a unit off by luck). A wrong
    kernel still fails (the control is faithful; tests/test_fuzz_cpu.py). Returns the worst error / bound
    ratio (pass: <= 1) and what it was."""
    from test_reference_bwd import emulated_kernel  # imports this module

    variant = {"window": window, "softcap": softcap, "sinks": sinks, "dropout": dropout}
    control = emulated_kernel(dout, q, k, v, softmax_scale, causal, dlse, **variant)
    lowp = attention_bwd_lowp(dout, q, k, v, softmax_scale, causal, dlse, **variant)
    dtype = torch.float32 if q.is_cuda else torch.float64
    ref_out, ref_lse = attention_ref(q, k, v, softmax_scale, causal, dtype=dtype, **variant)
    exact = attention_bwd_ref(dout, q, k, v, ref_out, ref_lse, softmax_scale, causal, dlse, window=window,
                              softcap=softcap, dropout=dropout, dtype=dtype)
    worst, what = 0.0, ""
    eps = torch.finfo(q.dtype).eps
    for name, g, c, lo, r in zip(("dq", "dk", "dv"), grads, control, lowp, exact):
        r = r.float()
        ulp = eps * torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(1e-30))))
        base = 2 * max(max_abs_err(c, r), max_abs_err(lo, r))
        excess = ((g.float() - r).abs() / (base + 1.5 * ulp + slack)).nan_to_num(math.inf).max().item() \
            if g.numel() else 0.0
        err, bound = rel_err(g, r), 2 * max(rel_err(c, r), rel_err(lo, r)) + slack
        for kind, ratio in (("max-abs (elementwise)", excess), ("relative", err / bound)):
            if not ratio <= worst:  # NaN counts as the worst
                worst, what = ratio, (f"{name}'s {kind} error is {ratio:.3g} x its bound (2 x max(emulation's, "
                                      f"PyTorch's) [+ 1.5 ulp] + {slack})")
    return worst, what


def assert_grads_match_or_control(grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor], dout: torch.Tensor,
                                  q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                                  causal: bool, dlse: torch.Tensor | None = None, **variant) -> None:
    """assert_grads_match; a failure on bounds (not NaN, shapes or rows without keys) is judged again by
    control_ratio, for grids whose inputs have few keys."""
    try:
        assert_grads_match(grads, dout, q, k, v, softmax_scale, causal, dlse, **variant)
    except AssertionError as failure:
        if " > 2 x " not in str(failure):
            raise
        ratio, what = control_ratio(grads, dout, q, k, v, softmax_scale, causal, dlse, **variant)
        assert ratio <= 1, f"{failure}; against the FlashAttention-style emulation too: {what}"


def assert_dsinks_match(dsinks: torch.Tensor, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, scale: float, causal: bool, window: tuple[int, int] | None, softcap: float,
                        sinks: torch.Tensor, dlse: torch.Tensor | None = None, atol: float = 1e-3, *,
                        out: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> None:
    """d(sinks) = -sum over rows of exp(sink - lse) * (rowsum(dout * out) - dlse) (reference.sinks_grad_ref).

    With ``out`` and ``lse``, the forward's results the backward was given: first, d(sinks) must be that
    formula applied to them, up to float32 summation (a tight check of the backward's own arithmetic).
    Then FA3's criterion against the formula on exact float32 out and lse, the yardstick being the largest
    error of the low-precision alternatives: PyTorch's autograd through its low-precision attention with
    the same sinks; the formula on the exact out rounded to the input dtype (every FlashAttention-style
    backward takes D from the stored 16-bit out); and the formula on this forward's out and lse (what an
    exact backward would make of them: the forward's own error, judged by assert_matches_reference). A
    sum over all rows of the batch, so these errors add up over many rows."""
    ref_out, ref_lse = attention_ref(q, k, v, scale, causal, window=window, softcap=softcap, sinks=sinks,
                                     dtype=torch.float32)
    ref = sinks_grad_ref(dout, ref_out, ref_lse, sinks, dlse, dtype=torch.float32)
    baselines = [sinks_grad_ref(dout, ref_out.to(q.dtype), ref_lse, sinks, dlse, dtype=torch.float32)]
    s = sinks.detach().clone().requires_grad_()
    lo_out, lo_lse = attention_lowp(q, k, v, scale, causal, window=window, softcap=softcap, sinks=s)
    torch.autograd.backward([lo_out, lo_lse], [dout, dlse if dlse is not None else torch.zeros_like(lo_lse)])
    baselines.append(s.grad)
    assert not torch.isnan(dsinks).any(), "dsinks has NaN"
    if out is not None and lse is not None:
        given = sinks_grad_ref(dout, out, lse, sinks, dlse, dtype=torch.float32)
        # Per head: the sum of the terms' magnitudes, the scale of float32 summation error.
        p_sink = torch.where(torch.isneginf(lse), 0.0, torch.exp(sinks.float()[None, :, None] - lse.float()))
        d_abs = (dout.float().abs() * out.float().abs()).sum(-1).transpose(1, 2)
        if dlse is not None:
            d_abs = d_abs + dlse.float().abs()
        mags = (p_sink * d_abs).sum(dim=(0, 2))
        excess = ((dsinks.float() - given).abs() - (1e-4 * mags + 1e-5)).max().item()
        assert excess <= 0, f"dsinks differs from the formula on the forward's out and lse by {excess:.3e} over 1e-4 x the terms"
        baselines.append(given)
    err, base = max_abs_err(dsinks, ref), max(max_abs_err(b, ref) for b in baselines)
    assert err <= 2 * base + atol, f"dsinks max-abs error {err:.3e} > 2 x {base:.3e} + {atol}"
    rel, base_rel = rel_err(dsinks, ref), max(rel_err(b, ref) for b in baselines)
    assert rel <= 2 * base_rel + atol, f"dsinks relative error {rel:.3e} > 2 x {base_rel:.3e} + {atol}"


def unconfigured(mode: str, key: KernelKey) -> str:
    """Which build option lacks what ``key`` needs, as a skip reason ("" when the build was asked for
    it, or has no extension to say)."""
    info = _ext.build_info()
    if not info:
        return ""
    hdims = info["headdims"] + [f"{d}x{dv}" for d, dv in info.get("headdim_pairs", [])]
    hdim = key.headdim if key.headdim_v == key.headdim else f"{key.headdim}x{key.headdim_v}"
    wanted = [("FLASHHOPPER_ARCHS", info["archs"], key.arch), ("FLASHHOPPER_MODES", info["modes"], mode),
              ("FLASHHOPPER_DTYPES", info["dtypes"], key.short_dtype()),
              ("FLASHHOPPER_HDIMS", hdims, hdim), ("FLASHHOPPER_MASKS", info["masks"], key.mask),
              ("FLASHHOPPER_SCORE_MODS", info.get("score_mods", ["none"]), key.score_mod),
              ("FLASHHOPPER_DROPOUT", info.get("dropout", ["off"]), "on" if key.dropout else "off"),
              ("FLASHHOPPER_VARLEN", info.get("varlen", ["off"]), "on" if key.varlen else "off")]
    return "; ".join(f"configure {option} with {value}" for option, have, value in wanted if value not in have)


def require_backend(backend: str, dtype: torch.dtype, headdim: int, causal: bool,
                    device: str | torch.device = "cuda", mode: str = "fwd",
                    window: tuple[int, int] | None = None, softcap: float = 0.0,
                    headdim_v: int | None = None, dropout: bool = False, varlen: bool = False) -> None:
    """Skip when ``backend`` cannot run here (another GPU family) or the build was not configured with
    the kernel (mode "bwd": the forward's and the backward's). Fail when the build was configured with
    it and it is missing, or when dispatch refuses a kernel the build has: a broken build or a dispatch
    bug must not look like a skip. Call it before making inputs, so that a skip costs nothing."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    info = _device.device_info(index)
    if not dispatch.runs_on(backend, info.capability):
        pytest.skip(f"{backend} kernels do not run on {info.name} (compute capability "
                    f"{info.capability[0]}.{info.capability[1]})")
    key = dispatch.kernel_key(backend, dtype, headdim, causal, window, softcap=softcap, headdim_v=headdim_v,
                              dropout=dropout)
    key = dataclasses.replace(key, varlen=varlen)
    for m in ("fwd",) if mode == "fwd" else ("fwd", "bwd"):
        if _ext.kernel(m, key) is not None:
            continue
        if _ext.configured(m, key):
            pytest.fail(f"the build was configured with the {m} kernel {key.describe()}, but does not have it "
                        f"(kernels(): {len(_ext.compiled_kernels())} entries; build_info(): {_ext.build_info()})")
        reason = unconfigured(m, key)
        if not reason:
            reason = (f"not in this build's configuration {_ext.build_info()}" if _ext.has_extension()
                      else f"no compiled extension ({_ext.extension_error()})")
        pytest.skip(f"no {m} kernel {key.describe()}: {reason}")
    try:
        dispatch.select_backend(torch.empty(0, device=dev), headdim, dtype, causal, backend, window=window,
                                softcap=softcap, headdim_v=headdim_v, dropout=dropout, varlen=varlen)
    except ValueError as e:
        pytest.fail(f"dispatch refuses {backend} for {key.describe()}, which the build has: {e}")


def with_pointers(params: Any, q: int, k: int, v: int, o: int, lse: int, tile_counter: int, sinks: int,
                  dropout_rng: int, q_scale: int, k_scale: int, v_scale: int) -> SimpleNamespace:
    """What ``_C.fwd_with`` launches, for the CPU stand-ins of _C: a copy of ``params`` (a SimpleNamespace) with
    these pointers in place (the fp8 descales only in params that have them)."""
    p = dict(vars(params), q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=o, lse_ptr=lse, tile_counter=tile_counter,
             sinks_ptr=sinks, dropout_rng=dropout_rng)
    if "q_scale_ptr" in p:
        p.update(q_scale_ptr=q_scale, k_scale_ptr=k_scale, v_scale_ptr=v_scale)
    return SimpleNamespace(**p)


def seeded_dropout_runs(run: Callable[[int], tuple[torch.Tensor, ...]], p: float,
                        device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Dropout]:
    """``run(seed)`` calls an entry point with dropout ``p``, a generator seeded with ``seed`` and return_lse and
    return_dropout_mask: seed 7 twice repeats bitwise, seed 8 draws another mask. Returns seed 7's (out, lse, mask)
    and the Dropout that call drew (rebuilt from the same generator state, for the reference)."""
    out, lse, mask = run(7)
    out2, lse2, mask2 = run(7)
    out3, _, mask3 = run(8)
    assert torch.equal(out, out2) and torch.equal(lse, lse2) and torch.equal(mask, mask2)
    assert not torch.equal(mask, mask3) and not torch.equal(out, out3)
    return out, lse, mask, from_rng_state(p, new_rng_state(torch.device(device),
                                                          torch.Generator(device).manual_seed(7)))


def fp8_kernel_block_n(headdim: int, causal: bool, seqlen_k: int, k_block: int | None, v_block: int | None) -> int:
    """Keys per tile of the padded fp8 forward that runs a call with these K/V scale blocks (None: one scale per
    head): the short-key tile for rows within its reach whose blocks it reads, and for rows whose blocks only it
    reads (cpp/sm90/launch_fwd.h: use_short_keys); the kernel's block_n otherwise."""
    tiles = fp8.kernel_tiles(headdim, causal)
    assert tiles is not None
    short = fp8.ops.short_keys(headdim, causal)
    if short is None:
        return tiles[1]

    def fits(n: int) -> bool:
        return all(b is None or b >= seqlen_k or b % n == 0 for b in (k_block, v_block))

    return short[0] if fits(short[0]) and (seqlen_k <= short[1] or not fits(tiles[1])) else tiles[1]


def declared_args(name: str) -> list[str]:
    """The py::arg names of the binding m.def(name, ...) in cpp/bindings.cpp, in order (CPU tests that replace the
    extension name its positional arguments by them, so that Python's argument order cannot drift from C++'s)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "cpp" / "bindings.cpp").read_text()
    start = text.index(f'm.def("{name}",')
    end = text.find("m.def(", start + 1)
    return re.findall(r'py::arg\("(\w+)"\)', text[start:end if end >= 0 else len(text)])
