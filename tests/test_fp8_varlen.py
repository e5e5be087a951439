"""Packed-batch fp8 (fp8/packed.py, fp8/varlen.py) on the CPU, where the ops run the reference emulation:
the packed layout against per-sequence padded batches of one (bit for bit), the V^T conversions, the
attention against the padded fp8 path and exact attention, bad inputs, and the ops' fake implementations."""
from __future__ import annotations

import pytest
import torch

import flashhopper
from flashhopper import fp8, reference, reference_fp8
from flashhopper.fp8 import PackedFP8Tensor
from test_varlen import BAD_VALUES

LENGTHS = [5, 130, 0, 64, 200, 1]
SEED = 7


def cu(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def packed(lengths: list[int], h: int, d: int, dtype: torch.dtype = torch.bfloat16, pad: int = 0,
           spread: bool = True) -> torch.Tensor:
    """``spread``: a magnitude per (token, head), so that every scale block has its own amax (a scale read from
    the wrong block shows); else N(0, 1), the inputs of the accuracy bounds."""
    total = sum(lengths) + pad
    mag = 2.0 ** torch.randint(-4, 5, (total, h, 1)) if spread else torch.ones(total, h, 1)
    return (torch.randn(total, h, d) * mag).to(dtype)


@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("transpose,hadamard", [(False, True), (True, False)])
def test_packed_quantization_is_each_sequence_quantized_alone(headdim: int, transpose: bool, hadamard: bool) -> None:
    torch.manual_seed(0)
    x, c, block = packed(LENGTHS, 3, headdim, pad=3), cu(LENGTHS), 64
    t = flashhopper.quantize_fp8(x, block, hadamard, SEED, transpose=transpose, cu_seqlens=c)
    assert isinstance(t, PackedFP8Tensor) and t.transposed == transpose and t.total == x.shape[0]
    n = x.shape[0] // block + len(LENGTHS)
    assert t.scale.shape == (3, n)
    owned = torch.zeros(n, dtype=torch.bool)
    rows = fp8.from_vt_packed(t) if transpose else t
    for b, (s0, s1) in enumerate(zip(c.tolist(), c.tolist()[1:])):
        if s1 == s0:
            continue
        alone = flashhopper.quantize_fp8(x[None, s0:s1], block, hadamard, SEED)
        first = s0 // block + b
        assert torch.equal(t.scale[:, first:first + alone.nblocks], alone.scale[0]), b
        assert torch.equal(rows.data[s0:s1].view(torch.uint8), alone.data[0].view(torch.uint8)), b
        owned[first:first + alone.nblocks] = True
    assert (t.scale[:, ~owned] == 1).all(), "blocks of no sequence must get scale 1"
    if transpose:  # V^T: each sequence's keys at its first block's column, permuted in groups of 16
        vt = t.data.view(torch.uint8)
        for b, (s0, s1) in enumerate(zip(c.tolist(), c.tolist()[1:])):
            if s1 == s0:
                continue
            alone = fp8.to_vt(flashhopper.quantize_fp8(x[None, s0:s1], block, False))
            c0 = (s0 // block + b) * block
            assert torch.equal(vt[:, :, c0:c0 + alone.data.shape[-1]], alone.data[0].view(torch.uint8)), b
        _, column, inside = fp8.token_layout(c, x.shape[0], block)
        keys = torch.zeros(vt.shape[-1], dtype=torch.bool)
        keys[column[inside]] = True
        assert (vt[:, :, ~keys] == 0).all(), "V^T columns of no token must be zero"


def test_vt_round_trip() -> None:
    torch.manual_seed(1)
    x, c = packed(LENGTHS, 2, 64, pad=5), cu(LENGTHS)
    rows = flashhopper.quantize_fp8(x, 128, False, cu_seqlens=c)
    vt = fp8.to_vt_packed(rows)
    assert vt.data.shape == (2, 64, (x.shape[0] // 128 + len(LENGTHS)) * 128)
    back = fp8.from_vt_packed(vt)
    inside = fp8.token_layout(c, x.shape[0], 128)[2]
    assert torch.equal(back.data.view(torch.uint8)[inside], rows.data.view(torch.uint8)[inside])
    assert (back.data.view(torch.uint8)[~inside] == 0).all()
    torch.testing.assert_close(fp8.dequantize_packed(vt), fp8.dequantize_packed(rows), rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_is_each_sequence_alone(causal: bool) -> None:
    torch.manual_seed(2)
    lq, lk = [5, 130, 0, 64, 200], [9, 100, 3, 64, 257]
    q, k, v = packed(lq, 4, 64, spread=False), packed(lk, 2, 64, spread=False), packed(lk, 2, 64, spread=False)
    cq, ck = cu(lq), cu(lk)
    out, lse = flashhopper.flash_attn_varlen_fp8_func(q, k, v, cq, ck, max(lq), max(lk), causal=causal,
                                                      return_lse=True, seed=SEED, kv_block_size=128)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (4, q.shape[0])
    ref, ref_lse = reference.attention_varlen_ref(q, k, v, cq, ck, None, causal)
    # fp8's own error on these inputs (docs/fp8.md; test_fp8_gpu's REF_REL)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 8e-2
    for b in range(len(lq)):
        q0, q1, k0, k1 = cq[b].item(), cq[b + 1].item(), ck[b].item(), ck[b + 1].item()
        if q1 == q0:
            continue
        o, l = flashhopper.flash_attn_fp8_func(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal,
                                               return_lse=True, seed=SEED, kv_block_size=128)
        assert torch.equal(out[q0:q1], o[0]), b
        assert torch.equal(lse[:, q0:q1], l[0]), b


def test_prequantized_inputs_and_seqused() -> None:
    torch.manual_seed(3)
    lens = [70, 3, 150]
    x = [packed(lens, h, 128) for h in (2, 2, 2)]
    c = cu(lens)
    q8 = flashhopper.quantize_fp8(x[0], 64, True, SEED, cu_seqlens=c)
    k8 = flashhopper.quantize_fp8(x[1], 128, True, SEED, cu_seqlens=c)
    v8 = flashhopper.quantize_fp8(x[2], 128, False, cu_seqlens=c)  # rows: brought to V^T by the call
    used = torch.tensor([50, 3, 0], dtype=torch.int32)
    out = flashhopper.flash_attn_varlen_fp8_func(q8, k8, v8, c, c, 150, 150, seqused_q=used, seqused_k=used)
    want, _ = reference_fp8.attention_varlen_fp8_ref(q8, k8, fp8.to_vt_packed(v8), None, False, seqused_q=used,
                                                     seqused_k=used)
    torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), rtol=0, atol=0)
    # bf16 q attends to the pre-quantized K/V with their seed
    out2 = flashhopper.flash_attn_varlen_fp8_func(x[0], k8, v8, c, c, 150, 150)
    assert torch.equal(out2, flashhopper.flash_attn_varlen_fp8_func(q8, k8, v8, c, c, 150, 150))


def _inputs() -> dict:
    torch.manual_seed(4)
    c = cu([10, 20])
    return {"q": packed([10, 20], 2, 64), "k": packed([10, 20], 2, 64), "v": packed([10, 20], 2, 64),
            "cu_seqlens_q": c, "cu_seqlens_k": c, "max_seqlen_q": 20, "max_seqlen_k": 20}


@pytest.mark.parametrize("change,err,match", [
    ({"q": torch.randn(1, 30, 2, 64, dtype=torch.bfloat16)}, ValueError, "q must have 3 dimensions"),
    ({"q": torch.randn(30, 2, 64)}, TypeError, "q has dtype"),
    ({"k": torch.randn(30, 2, 96, dtype=torch.bfloat16)}, ValueError, "head dim 96"),
    ({"cu_seqlens_q": torch.tensor([0, 10, 30])}, TypeError, "cu_seqlens_q has dtype"),
    ({"cu_seqlens_k": torch.tensor([0, 30], dtype=torch.int32)}, ValueError, "one batch"),
    ({"max_seqlen_q": 20.0}, TypeError, "max_seqlen_q must be a Python int"),
    ({"q_block_size": 32}, ValueError, "q_block_size 32"),
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"seqused_k": torch.tensor([1], dtype=torch.int32)}, ValueError, "seqused_k must have shape"),
])
def test_bad_inputs(change: dict, err: type, match: str) -> None:
    args = _inputs()
    args.update(change)
    with pytest.raises(err, match=match):
        flashhopper.flash_attn_varlen_fp8_func(**args)


def test_bad_prequantized_inputs() -> None:
    a = _inputs()
    c2 = a["cu_seqlens_q"].clone()
    k8 = flashhopper.quantize_fp8(a["k"], 64, cu_seqlens=c2)
    with pytest.raises(ValueError, match="k.cu_seqlens is not cu_seqlens_k"):
        flashhopper.flash_attn_varlen_fp8_func(a["q"], k8, a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 20, 20)
    q8 = flashhopper.quantize_fp8(a["q"], 64, True, 1, cu_seqlens=a["cu_seqlens_q"])
    k8 = flashhopper.quantize_fp8(a["k"], 64, True, 2, cu_seqlens=a["cu_seqlens_k"])
    with pytest.raises(ValueError, match="hadamard_seed"):
        flashhopper.flash_attn_varlen_fp8_func(q8, k8, a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 20, 20)
    q8t = q8._replace(data=fp8.to_vt_packed(q8._replace(hadamard_seed=None)).data, transposed=True)
    with pytest.raises(ValueError, match="only v is transposed"):
        flashhopper.flash_attn_varlen_fp8_func(q8t, a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 20, 20)
    with pytest.raises(ValueError, match="scale has shape"):
        fp8.check_packed_fp8_tensor("q", q8._replace(scale=q8.scale[:, :-1]))
    with pytest.raises(ValueError, match="granularity 'head'"):
        flashhopper.quantize_fp8(a["q"], 64, granularity="head", cu_seqlens=a["cu_seqlens_q"])


@pytest.mark.parametrize("rows, cu_q, used_q, match", BAD_VALUES)  # test_varlen's cases
def test_cpu_checks_the_values(monkeypatch: pytest.MonkeyPatch, rows: int, cu_q: list[int],
                               used_q: list[int] | None, match: str) -> None:
    # The values (validation.check_varlen_values) are always checked on CPU tensors, no debug flag needed.
    monkeypatch.delenv(flashhopper.varlen.DEBUG_ENV, raising=False)
    batch = len(cu_q) - 1
    q, kv = packed([rows], 2, 64), packed([1] * batch, 2, 64)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), cu([1] * batch)
    used = None if used_q is None else torch.tensor(used_q, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        flashhopper.flash_attn_varlen_fp8_func(q, kv, kv, cq, ck, 8, 1, seqused_q=used)


def test_cpu_good_values_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(flashhopper.varlen.DEBUG_ENV, raising=False)
    # Empty sequences, rows past cu_seqlens_q[-1], seqused at 0 and at the whole slot: all valid.
    q, kv = packed([9], 2, 64), packed([2, 0, 3, 4], 2, 64)
    cq, ck = torch.tensor([0, 3, 3, 8, 8], dtype=torch.int32), cu([2, 0, 3, 4])
    used = torch.tensor([3, 0, 2, 0], dtype=torch.int32)
    out = flashhopper.flash_attn_varlen_fp8_func(q, kv, kv, cq, ck, 5, 4, seqused_q=used)
    assert out.shape == q.shape


def test_fake_op_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(300, 4, 128, dtype=torch.bfloat16)
        c = torch.empty(6, dtype=torch.int32)
        data, scale = torch.ops.flashhopper.varlen_quantize_fp8.default(x, c, 128, None, True)
        assert data.shape == (4, 128, (300 // 128 + 5) * 128) and scale.shape == (4, 300 // 128 + 5)
        q = torch.empty(300, 4, 128, dtype=torch.float8_e4m3fn)
        s = torch.empty(4, 300 // 64 + 5)
        out, lse = torch.ops.flashhopper.varlen_fwd_fp8.default(q, s, q, scale, data, scale, c, c, None, None, 100,
                                                               100, 64, 128, 128, 0.1, True)
        assert out.shape == (300, 4, 128) and out.dtype == torch.bfloat16 and lse.shape == (4, 300)
