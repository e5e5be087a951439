"""The e4m3 KV cache's format and API on the CPU (the kernels: test_kvcache_fp8_gpu.py): quantization of rows and
its error bound, the Hadamard transform q gets, quantized appends at the right places, the reference path against
float64 attention over the dequantized cache, and every bad argument refused before anything runs."""
from __future__ import annotations

import math

import pytest
import torch

from flashhopper import append_kvcache, attention_kvcache_ref, flash_attn_with_kvcache, kvcache_fp8
from flashhopper.reference import kvcache_entry

E4M3 = torch.float8_e4m3fn


def test_quantize_rows_bound_and_zero_rows() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 7, 3, 64, dtype=torch.float64) * torch.logspace(-3, 3, 7, dtype=torch.float64)[None, :, None, None]
    x[0, 0, 0] = 0
    data, scale = kvcache_fp8.quantize_rows(x)
    assert data.dtype == E4M3 and data.shape == x.shape and scale.shape == x.shape[:-1] and scale.dtype == torch.float32
    amax = x.abs().amax(-1)
    assert torch.allclose(scale.double()[amax > 0], (amax / 448)[amax > 0], rtol=1e-6)
    assert scale[0, 0, 0] == 1 and (data[0, 0, 0].float() == 0).all()
    back = kvcache_fp8.dequantize_rows(data, scale, dtype=torch.float64)
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormal steps of 2^-9 in the scaled units
    bound = x.abs() * 2.0**-4 + scale.double()[..., None] * 2.0**-9 * 1.001
    assert ((back - x).abs() <= bound).all()
    assert (data.float().abs().amax(-1)[amax > 0] == 448).all()  # the row's largest element lands on 448


def test_hadamard_keeps_dot_products() -> None:
    torch.manual_seed(1)
    q = torch.randn(3, 128, dtype=torch.float64)
    k = torch.randn(9, 128, dtype=torch.float64)
    qt = kvcache_fp8.transform_q(q, 1234)
    kt = kvcache_fp8.transform_q(k, 1234)
    assert torch.allclose(qt @ kt.T, q @ k.T, atol=1e-4)
    assert not torch.allclose(qt, q)
    assert kvcache_fp8.transform_q(q, None) is q
    data, scale = kvcache_fp8.quantize_rows(k, 1234)
    back = kvcache_fp8.dequantize_rows(data, scale, 1234, torch.float64)  # the inverse transform applied
    assert ((back - k).norm() / k.norm()).item() < 0.05


def paged(batch: int, per: int, page: int, hkv: int, d: int, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(batch * per + 2, page, hkv, d, generator=g).bfloat16()
    vc = torch.randn(batch * per + 2, page, hkv, d, generator=g).bfloat16()
    table = torch.randperm(batch * per + 2, generator=g)[:batch * per].view(batch, per).to(torch.int32)
    return kc, vc, table


@pytest.mark.parametrize("seed", [None, 77])
def test_reference_path_and_append(seed: int | None) -> None:
    """Append 3 tokens across a page boundary into an e4m3 cache, attend (reference backend): the cache holds the
    quantized rows at their places, and out matches float64 attention over the dequantized original-domain values."""
    torch.manual_seed(2)
    b, hq, hkv, d, page = 2, 8, 2, 64, 16
    kc, vc, table = paged(b, 4, page, hkv, d)
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc, seed)
    lens = torch.tensor([14, 30], dtype=torch.int32)
    q = torch.randn(b, 2, hq, d).bfloat16()
    k = torch.randn(b, 3, hkv, d).bfloat16()
    v = torch.randn(b, 3, hkv, d).bfloat16()
    out, lse = flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=lens, page_table=table, return_lse=True,
                                       k_cache_scale=ks, v_cache_scale=vs, hadamard_seed=seed)
    kq, kqs = kvcache_fp8.quantize_rows(k, seed)
    vq, vqs = kvcache_fp8.quantize_rows(v)
    for i, n in enumerate(lens.tolist()):
        assert torch.equal(kvcache_entry(k8, i, n + 3, table)[n:].view(torch.uint8), kq[i].view(torch.uint8))
        assert torch.equal(kvcache_entry(v8, i, n + 3, table)[n:].view(torch.uint8), vq[i].view(torch.uint8))
        assert torch.equal(kvcache_entry(ks.transpose(1, 2), i, n + 3, table)[n:], kqs[i])
        assert torch.equal(kvcache_entry(vs.transpose(1, 2), i, n + 3, table)[n:], vqs[i])
    kd = kvcache_fp8.dequantize_kv_cache(k8, ks, seed, torch.float64)
    vd = kvcache_fp8.dequantize_kv_cache(v8, vs, None, torch.float64)
    ref, ref_lse = attention_kvcache_ref(q.double(), kd, vd, lens + 3, table, dtype=torch.float64)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err  # q's transform rounded to bf16, out rounded to bf16
    assert torch.allclose(lse.double(), ref_lse, atol=2e-2)


def as_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


@pytest.mark.parametrize("seed", [None, 77])
@pytest.mark.parametrize("paged_cache", [True, False], ids=["paged16", "contiguous"])
def test_append_kvcache_writes_what_the_attention_call_appends(paged_cache: bool, seed: int | None) -> None:
    """append_kvcache into an e4m3 cache (3 tokens across a page boundary; K with the Hadamard seed's transform):
    data and scales bit for bit what flash_attn_with_kvcache's quantizing append writes into a clone; cache_seqlens
    unchanged."""
    torch.manual_seed(4)
    b, hkv, d = 2, 2, 64
    kc, vc, table = paged(b, 4, 16, hkv, d)
    if not paged_cache:  # (batch_cache, max_seqlen, ...): entry b's pages in order
        kc, vc, table = kc[table.long()].flatten(1, 2), vc[table.long()].flatten(1, 2), None
    cache = kvcache_fp8.quantize_kv_cache(kc, vc, seed)
    lens = torch.tensor([14, 30], dtype=torch.int32)
    q = torch.randn(b, 1, 8, d).bfloat16()
    k, v = torch.randn(b, 3, hkv, d).bfloat16(), torch.randn(b, 3, hkv, d).bfloat16()
    mine, theirs = [x.clone() for x in cache], [x.clone() for x in cache]
    append_kvcache(mine[0], mine[1], k, v, lens, table, k_cache_scale=mine[2], v_cache_scale=mine[3],
                   hadamard_seed=seed)
    flash_attn_with_kvcache(q, theirs[0], theirs[1], k, v, cache_seqlens=lens, page_table=table,
                            k_cache_scale=theirs[2], v_cache_scale=theirs[3], hadamard_seed=seed)
    for a, x, before in zip(mine, theirs, cache):
        assert torch.equal(as_bits(a), as_bits(x))
        assert not torch.equal(as_bits(a), as_bits(before))  # data and scales written
    assert lens.tolist() == [14, 30]


def test_contiguous_cache() -> None:
    torch.manual_seed(3)
    kc = torch.randn(3, 32, 1, 128).half()
    vc = torch.randn(3, 32, 1, 128).half()
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc)
    assert ks.shape == (3, 1, 32)
    q = torch.randn(3, 1, 4, 128).half()
    lens = torch.tensor([0, 5, 32], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, k_cache_scale=ks, v_cache_scale=vs)
    assert out.dtype == torch.float16 and (out[0] == 0).all()
    ref, _ = attention_kvcache_ref(q.double(), kc.double(), vc.double(), lens, dtype=torch.float64)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.1  # e4m3's error over the original values


def bad_calls() -> list[tuple[type[Exception], str, object]]:
    kc, vc, table = paged(1, 2, 16, 2, 64)
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc)
    q = torch.randn(1, 1, 4, 64).bfloat16()
    lens = torch.tensor([3], dtype=torch.int32)

    def call(**kw: object) -> object:
        args: dict[str, object] = dict(q=q, k_cache=k8, v_cache=v8, cache_seqlens=lens, page_table=table,
                                       k_cache_scale=ks, v_cache_scale=vs)
        args.update(kw)
        return lambda: flash_attn_with_kvcache(**args)  # type: ignore[arg-type]

    return [
        (ValueError, "k_cache_scale is required", call(k_cache_scale=None)),
        (TypeError, "must be torch.float32", call(v_cache_scale=vs.double())),
        (ValueError, "must have shape", call(k_cache_scale=ks[:, :1])),
        (ValueError, "same strides", call(v_cache_scale=torch.zeros(vs.shape[0], vs.shape[1], 32)[..., :16])),
        (TypeError, "needs both k_cache and v_cache e4m3", call(v_cache=vc)),
        (ValueError, "are for e4m3 caches", call(k_cache=kc, v_cache=vc)),
        (TypeError, "q's dtype", call(k=torch.randn(1, 1, 2, 64), v=torch.randn(1, 1, 2, 64))),
        (TypeError, "hadamard_seed must be an int", call(hadamard_seed=1.5)),
        (ValueError, "multiple of 16 rows", call(k_cache=k8[:1, :8], v_cache=v8[:1, :8], k_cache_scale=ks[:1, :, :8],
                                                   v_cache_scale=vs[:1, :, :8], page_table=None)),
        (ValueError, "power-of-two head dim", lambda: kvcache_fp8.quantize_rows(torch.randn(2, 96), 3)),
        (ValueError, "not e4m3", lambda: kvcache_fp8.quantize_kv_cache(k8, v8)),
    ]


@pytest.mark.parametrize("case", range(11))
def test_bad_arguments_raise(case: int) -> None:
    exc, match, fn = bad_calls()[case]
    with pytest.raises(exc, match=match):
        fn()  # type: ignore[operator]


def append_bad_calls() -> list[tuple[type[Exception], str, dict[str, object]]]:
    kc, vc, table = paged(1, 2, 16, 2, 64)
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc)
    k = torch.randn(1, 2, 2, 64).bfloat16()
    base: dict[str, object] = dict(k_cache=k8, v_cache=v8, k=k, v=k.clone(), cache_seqlens=torch.tensor([15],
                                   dtype=torch.int32), page_table=table, k_cache_scale=ks, v_cache_scale=vs)
    return [(exc, match, {**base, **kw}) for exc, match, kw in [
        (ValueError, "k_cache_scale is required", dict(k_cache_scale=None)),
        (TypeError, "must be torch.float32", dict(v_cache_scale=vs.double())),
        (ValueError, "must have shape", dict(k_cache_scale=ks[:, :1])),
        (ValueError, "same strides", dict(v_cache_scale=torch.zeros(vs.shape[0], vs.shape[1], 32)[..., :16])),
        (TypeError, "needs both k_cache and v_cache e4m3", dict(v_cache=vc)),
        (TypeError, "v has dtype torch.float32 but k has torch.bfloat16", dict(v=torch.randn(1, 2, 2, 64))),
        (TypeError, "hadamard_seed must be an int", dict(hadamard_seed=1.5)),
        (ValueError, "power-of-two head dim", dict(k_cache=k8[..., :48], v_cache=v8[..., :48], k=k[..., :48],
                                                   v=k[..., :48], hadamard_seed=3)),
    ]]


@pytest.mark.parametrize("case", range(8))
def test_append_kvcache_bad_arguments_raise(case: int) -> None:
    """append_kvcache refuses them with flash_attn_with_kvcache's errors, before the data or scales change."""
    exc, match, args = append_bad_calls()[case]
    held = [x for x in args.values() if isinstance(x, torch.Tensor) and x.dtype in (E4M3, torch.float32)]
    before = [as_bits(x.clone()) for x in held]
    with pytest.raises(exc, match=match):
        append_kvcache(**args)  # type: ignore[arg-type]
    for x, b in zip(held, before):
        assert torch.equal(as_bits(x), b)


def test_cache_memory_is_about_half() -> None:
    kc = torch.zeros(10, 16, 8, 128, dtype=torch.bfloat16)
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, kc)
    fp8 = sum(x.numel() * x.element_size() for x in (k8, v8, ks, vs))
    assert math.isclose(fp8 / (2 * kc.numel() * 2), (128 + 4) / 256)


def test_first_transform_inside_graph_capture_asks_for_a_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # The matrix is copied from the host on its first use; inside capture that copy cannot happen: a clear error,
    # not cached, so that the eager warm-up builds it.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cuda = torch.device("cuda")
    for cache in (kvcache_fp8._transform_matrix, kvcache_fp8._signs):
        cached = cache.cache_info().currsize
        for _ in range(2):  # the error is not cached: the next call (eager, in real use) builds the matrix
            with pytest.raises(RuntimeError, match="warm-up"):
                cache(64, 987654321, cuda)
        assert cache.cache_info().currsize == cached


@pytest.mark.parametrize("d", [64, 128, 256])
def test_butterflies_are_the_transform(d: int) -> None:
    # quantize_rows computes K's transform as the append kernel does (signs, butterflies, the norm folded in): the
    # same transform as transform_q's matrix, to float32 rounding; and the float64 values exactly H s x.
    torch.manual_seed(d)
    x = torch.randn(6, d, dtype=torch.float64)
    signs = kvcache_fp8._signs(d, 77, torch.device("cpu")).double()
    y = kvcache_fp8._butterflies(x * signs) / math.sqrt(d)
    assert torch.allclose(y, x @ kvcache_fp8._transform_matrix(d, 77, torch.device("cpu")).double(), atol=1e-12)
    data, scale = kvcache_fp8.quantize_rows(x.float(), 77)
    back = kvcache_fp8.dequantize_rows(data, scale, 77, torch.float64)
    assert ((back - x).norm() / x.norm()).item() < 0.05
    amax = y.abs().amax(-1)
    assert torch.allclose(scale.double(), amax / 448, rtol=1e-6)
