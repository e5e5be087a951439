"""The eager fast path's bookkeeping (flashhopper._plans) without a GPU: call keys tell apart what validation tells
apart, and a call that needs the op's dispatch (a mode, a transform, a subclass, dropout) has no key. Its launches
and results: test_plans_gpu.py."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from flashhopper import _plans, interface, varlen
from flashhopper.fp8 import attention as fp8_attention
from flashhopper.fp8 import quantized_kv
from flashhopper.fp8.format import FP8Tensor


def qkv(d: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(2, 16, 4, d, dtype=torch.bfloat16) for _ in range(3))  # type: ignore[return-value]


def key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> object:
    args = dict(softmax_scale=None, causal=False, return_lse=False, backend=None, deterministic=False,
                window_size=(-1, -1), softcap=0.0, sinks=None, dropout_p=0.0, generator=None, return_dropout_mask=False)
    args.update(kw)
    return interface._call_key(q, k, v, **args)  # type: ignore[arg-type]


def test_keys_tell_apart_what_validation_does() -> None:
    q, k, v = qkv()
    base = key(q, k, v)
    assert base is not None and base == key(*qkv())  # same metadata, other tensors: one plan
    assert hash(base) == hash(key(*qkv()))
    # Values that compare equal across types, which validation accepts for one and refuses for the other.
    assert key(q, k, v, causal=True) != key(q, k, v, causal=1)
    assert key(q, k, v, softmax_scale=1.0) != key(q, k, v, softmax_scale=True)
    assert key(q, k, v, softcap=0.0) != key(q, k, v, softcap=False)
    assert key(q, k, v, window_size=(1, -1)) != key(q, k, v, window_size=(True, -1))
    assert key(q, k, v, dropout_p=0.0) != key(q, k, v, dropout_p=False)
    # Metadata: strides, dtype, shapes, sinks.
    assert key(q.transpose(1, 2).contiguous().transpose(1, 2), k, v) != base
    assert key(q.half(), k.half(), v.half()) != base
    assert key(q[:, :8], k, v) != base
    sinks = torch.zeros(4)
    assert key(q, k, v, sinks=sinks) not in (None, base)


def test_calls_that_need_the_op_have_no_key() -> None:
    q, k, v = qkv()
    assert key(torch.nn.Parameter(q), k, v) is None  # a subclass: its __torch_function__ must run
    assert key(q, k, v, dropout_p=0.1) is None  # a seed per call
    assert key(q, k, v, generator=torch.Generator()) is None
    assert key(q, k, v, return_dropout_mask=True) is None
    assert key(q, k, v, window_size=[-1, -1]) is None  # (valid, but not a tuple: the full path takes it)
    assert key(q, k, v, dropout_p=torch.tensor([0.1, 0.2])) is None  # no truth value: validation's TypeError says so

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    assert _plans.direct()
    with Functions():
        assert not _plans.direct()
    with Dispatch():
        assert not _plans.direct()
    seen: list[bool] = []
    torch.vmap(lambda x: (seen.append(_plans.direct()), x)[1])(torch.ones(2, 3))
    assert seen == [False]
    seen.clear()
    torch.jit.trace(lambda x: (seen.append(_plans.direct()), x * 2)[1], torch.ones(2), check_trace=False)
    assert seen == [False]  # a jit trace records ops: a launch behind its back would be missing from it
    assert _plans.direct()


def test_views_whose_pointer_hides_their_values_have_no_plan() -> None:
    # A lazily negated view shares its base's data_ptr(); only the op dispatcher applies the negation, so a raw-pointer
    # launch from the fast path would attend with -q's base, +q. Such keys must miss, and never be stored.
    q, k, v = qkv()
    neg = torch._neg_view(q)
    assert neg.is_neg() and neg.data_ptr() == q.data_ptr()
    plans = _plans.Plans()
    plans.put(key(q, k, v), "plain")
    assert plans.get(key(neg, k, v)) is None
    plans.put(key(neg, k, v), "neg")
    assert len(plans) == 1 and plans.get(key(q, k, v)) == "plain"
    sparse = torch.zeros(4).to_sparse()
    assert plans.get((_plans.meta(sparse),)) is None  # no strides to read: the full path says what is wrong


def test_unhashable_arguments_and_the_bound() -> None:
    plans = _plans.Plans()
    assert plans.get(([1], 2)) is None  # the full path names the bad argument
    plans.put(([1], 2), "x")
    assert len(plans) == 0
    for i in range(plans.LIMIT + 5):
        plans.put(i, i)
    assert len(plans) == plans.LIMIT and plans.get(0) is None and plans.get(plans.LIMIT + 4) == plans.LIMIT + 4
    _plans.clear()
    assert len(plans) == 0


def test_alignment_and_grad() -> None:
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert _plans.pointers(x, x[8:]) == (x.data_ptr(), x.data_ptr() + 16)  # 16 bytes in
    assert _plans.pointers(x, x[1:]) is None
    y = torch.zeros(4, requires_grad=True)
    assert _plans.needs_grad(None, y) and not _plans.needs_grad(None, y.detach())
    with torch.no_grad():
        assert not _plans.needs_grad(y)


def test_fp8_keys() -> None:
    def fp8(transposed: bool = False, seed: int | None = 0, block: int | None = 64) -> FP8Tensor:
        data = torch.zeros(1, 4, 64, 32 if transposed else 64, dtype=torch.float8_e4m3fn) if transposed else \
            torch.zeros(1, 32, 4, 64, dtype=torch.float8_e4m3fn)
        return FP8Tensor(data, torch.ones(1, 4, 1), block, seed, transposed, 32)

    scalars = (None, False, False, True, 0, None, None)
    q, k, v = fp8(), fp8(), fp8(True, None)
    base = fp8_attention._call_key(q, k, v, *scalars)
    assert base is not None and base == fp8_attention._call_key(fp8(), fp8(), fp8(True, None), *scalars)
    assert fp8_attention._call_key(q, k, fp8(False, None), *scalars) is None  # row-major v: converted per call
    assert fp8_attention._call_key(q, k, v, None, 1, False, True, 0, None, None) != base  # causal=1 is no bool
    assert fp8_attention._call_key(fp8(seed=1), k, v, *scalars) != base  # the seeds are checked against each other
    assert fp8_attention._call_key(q._replace(transposed=1), k, v, *scalars) != base  # type: ignore[arg-type]
    assert fp8_attention._call_key(q._replace(data=torch.nn.Parameter(q.data, requires_grad=False)), k, v,
                                   *scalars) is None
    # bf16/fp16 q, k, v (quantized in the call) have keys of their own; a mix of tensors and FP8Tensors has none.
    x = torch.zeros(1, 32, 4, 64, dtype=torch.bfloat16)
    assert fp8_attention._call_key(x, x, x, *scalars) not in (None, base)
    assert fp8_attention._call_key(x, x, x, *scalars) != fp8_attention._call_key(x, x, x.half(), *scalars)
    assert fp8_attention._call_key(x, x, x, None, False, False, True, 1, None, None) != \
        fp8_attention._call_key(x, x, x, *scalars)  # another seed
    assert fp8_attention._call_key(x, k, v, *scalars) is None
    kv = quantized_kv.QuantizedKV(k, v)
    qb = torch.zeros(1, 32, 4, 64, dtype=torch.bfloat16)
    assert quantized_kv._call_key(kv, qb, None, False) is not None
    assert quantized_kv._call_key(kv, qb, None, False) != quantized_kv._call_key(kv, qb.half(), None, False)
    assert quantized_kv._call_key(kv, qb, None, False) != quantized_kv._call_key(kv, qb, None, 0)
    assert quantized_kv._call_key(quantized_kv.QuantizedKV(k, fp8(False, None)), qb, None, False) is None
    assert quantized_kv._call_key(kv, q, None, False) is None  # an FP8Tensor q: flash_attn_fp8_func's own path


def varlen_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cq: torch.Tensor, ck: torch.Tensor,
               **kw: object) -> object:
    args = dict(max_seqlen_q=16, max_seqlen_k=16, softmax_scale=None, causal=False, seqused_q=None, seqused_k=None,
                return_lse=False, deterministic=False, backend=None, window_size=(-1, -1), softcap=0.0, sinks=None,
                dropout_p=0.0, generator=None, return_dropout_mask=False)
    args.update(kw)
    return varlen._call_key(q, k, v, cq, ck, **args)  # type: ignore[arg-type]


def test_varlen_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    def packed() -> tuple[torch.Tensor, ...]:
        q, k, v = (torch.randn(32, 4, 64, dtype=torch.bfloat16) for _ in range(3))
        return q, k, v, torch.tensor([0, 16, 32], dtype=torch.int32), torch.tensor([0, 16, 32], dtype=torch.int32)

    q, k, v, cq, ck = packed()
    base = varlen_key(q, k, v, cq, ck)
    assert base is not None and base == varlen_key(*packed())  # other tensors, same metadata: one plan
    used = torch.tensor([3, 16], dtype=torch.int32)
    others = [varlen_key(q, k, v, cq, ck, max_seqlen_q=17), varlen_key(q, k, v, cq, ck, max_seqlen_k=True),
              varlen_key(q, k, v, cq, ck, causal=1), varlen_key(q, k, v, cq, ck, seqused_q=used),
              varlen_key(q, k, v, cq, ck, seqused_k=used), varlen_key(q, k, v, cq, ck, sinks=torch.zeros(4)),
              varlen_key(q, k, v, cq.long(), ck), varlen_key(q, k, v, torch.tensor([0, 32], dtype=torch.int32), ck),
              varlen_key(q, k, v, cq, ck, window_size=(8, 0)), varlen_key(q, k, v, cq, ck, softcap=5.0)]
    assert None not in others and base not in others
    assert len(set(others)) == len(others)
    assert varlen_key(q, k, v, cq, ck, max_seqlen_q=16.0) != base  # validation refuses a float: no hit
    # What must take the full path: dropout (a seed per call), the opt-in value checks, copies the launch would need.
    assert varlen_key(q, k, v, cq, ck, dropout_p=0.1) is None
    assert varlen_key(q, k, v, cq, ck, generator=torch.Generator()) is None
    assert varlen_key(q, k, v, cq, ck, return_dropout_mask=True) is None
    strided = torch.zeros(6, dtype=torch.int32)[::2]
    assert varlen_key(q, k, v, strided, ck) is None and varlen_key(q, k, v, cq, ck, seqused_q=strided[:2]) is None
    assert varlen_key(q, k, v, cq, ck, sinks=torch.zeros(8)[::2]) is None
    assert varlen_key(torch.nn.Parameter(q), k, v, cq, ck) is None
    assert varlen_key(q, k, v, cq, ck, seqused_q=[3, 16]) is None  # not a tensor: the full path says so
    monkeypatch.setenv(varlen.DEBUG_ENV, "1")
    assert varlen_key(q, k, v, cq, ck) is None
    monkeypatch.delenv(varlen.DEBUG_ENV)
    neg = torch._neg_view(q)
    plans = _plans.Plans()
    plans.put(base, "plain")
    assert plans.get(varlen_key(neg, k, v, cq, ck)) is None


def test_varlen_cpu_calls_keep_no_plan() -> None:
    # CPU tensors run the reference (and read cu_seqlens' values each call): no plan is stored, so a repeat takes the
    # full path, whose value checks still refuse bad lengths.
    import flashhopper as fh

    _plans.clear()
    q, k, v = (torch.randn(12, 2, 64) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    first = fh.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
    assert torch.equal(fh.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True), first)
    assert len(varlen._PLANS) == 0
    with pytest.raises(ValueError):
        fh.flash_attn_varlen_func(q, k, v, torch.tensor([0, 9, 5], dtype=torch.int32), cu, 7, 7, causal=True)
