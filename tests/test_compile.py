"""torch.compile traces flash_attn_func as one op, through its fake implementation; forward + backward
as the two ops fwd and bwd. Compiled results are compared with eager ones and with the reference."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_matches_reference, randn_qkv, rel_err

import flashhopper  # noqa: F401  (registers the op)
from flashhopper import flash_attn_func
from flashhopper.dropout import new_rng_state
from flashhopper.reference import attention_ref

pytestmark = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(),
                                reason="torch.compile (dynamo) is not supported on this Python/torch")


def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention=flash_attn_func) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out, lse = attention(q * 2, k, v, causal=True, return_lse=True)
    return out.sum(-1) + lse.transpose(1, 2)


def test_fake_impl_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = randn_qkv(2, 33, 17, 8, 2, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.flashhopper.fwd.default(q, k, v, 0.125, True, -1, -1, 0.0, None, False, "sm90")
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (2, 8, 33) and lse.dtype == torch.float32 and lse.is_contiguous()


def test_fake_impl_shapes_bwd() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qkv = torch.randn(2, 33, 3, 8, 64, dtype=torch.bfloat16)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1, :2], qkv[:, :, 2, :2]  # strided, GQA
        out, lse = torch.empty_like(q), torch.empty(2, 8, 33)
        grads = torch.ops.flashhopper.bwd.default(out, q, k, v, out, lse, None, 0.125, True, 16, -1, 0.0, None, False, "sm90")
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == torch.bfloat16 and g.is_contiguous()


@pytest.mark.parametrize(("window", "softcap", "with_sinks"), [((-1, -1), 0.0, False), ((3, 2), 0.0, False),
                                                              ((-1, -1), 2.5, True)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_opcheck(window: tuple[int, int], softcap: float, with_sinks: bool, dropout_p: float) -> None:
    # torch's own consistency checks of a custom op: schema, fake vs real, dispatch under tracing, and
    # (fwd) that its autograd formula is registered the way torch expects. Dropout: its (seed, offset) are an
    # input, so the op is a function of its inputs like any other.
    q, k, v = (x.requires_grad_() for x in randn_qkv(2, 9, 11, 4, 2, 16))
    sinks = torch.randn(4).requires_grad_() if with_sinks else None
    rng = new_rng_state(q.device) if dropout_p > 0 else None
    torch.library.opcheck(torch.ops.flashhopper.fwd.default,
                          (q, k, v, 0.3, True, *window, softcap, sinks, False, "reference", dropout_p, rng),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static",
                                      "test_autograd_registration", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize(("window", "softcap", "with_sinks"), [((-1, -1), 0.0, False), ((3, 2), 0.0, False),
                                                              ((-1, -1), 2.5, True)])
@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_opcheck_bwd(with_dlse: bool, window: tuple[int, int], softcap: float, with_sinks: bool,
                     dropout_p: float) -> None:
    q, k, v = randn_qkv(2, 9, 11, 4, 2, 16)
    sinks = torch.randn(4) if with_sinks else None
    rng = new_rng_state(q.device) if dropout_p > 0 else None
    out, lse = torch.ops.flashhopper.fwd.default(q, k, v, 0.3, True, *window, softcap, sinks, False, "reference",
                                                 dropout_p, rng)
    dlse = torch.randn_like(lse) if with_dlse else None
    torch.library.opcheck(torch.ops.flashhopper.bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, dlse, 0.3, True, *window, softcap, sinks, False,
                           "reference", dropout_p, rng),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_func(q * 2, k, v, causal=True, return_lse=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend: str) -> None:
    torch._dynamo.reset()
    q, k, v = randn_qkv(2, 24, 40, 4, 2, 32)
    compiled = torch.compile(block, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v))
    torch._dynamo.reset()
    out, lse = torch.compile(attn, fullgraph=True, backend=backend)(q, k, v)
    assert_matches_reference(out, lse, q * 2, k, v, None, causal=True)  # not only what eager gives


def grads_of(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):  # type: ignore[no-untyped-def]
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    y = fn(*leaves)
    return (y, *torch.autograd.grad(y.square().sum(), leaves, materialize_grads=True))  # lse: v unused


def block_lse_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention=flash_attn_func) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return attention(q, k, v, return_lse=True, deterministic=True)[1] * 3


def block_out_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention=flash_attn_func) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return attention(q, k, v, causal=True)


def exact(fn):  # type: ignore[no-untyped-def]
    """``fn`` with flash_attn_func replaced by autograd through the float64 reference."""
    def ref_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                 causal: bool = False, return_lse: bool = False, deterministic: bool = False):  # type: ignore[no-untyped-def]
        out, lse = attention_ref(q, k, v, softmax_scale, causal)
        return (out, lse) if return_lse else out

    return lambda q, k, v: fn(q, k, v, attention=ref_attn)


@pytest.mark.parametrize("fn", [block, block_lse_only, block_out_only])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_backward(backend: str, fn) -> None:  # type: ignore[no-untyped-def]
    # Forward and backward compiled (the backward through the op's autograd formula, with dlse None or
    # a tensor as the loss uses lse or not), against eager and against autograd through the exact
    # float64 reference (float32 inputs: the float32 lse is what separates them).
    torch._dynamo.reset()
    q, k, v = randn_qkv(2, 24, 40, 4, 2, 32)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got = grads_of(compiled, q, k, v)
    for g, want in zip(got, grads_of(fn, q, k, v)):
        torch.testing.assert_close(g, want)
    for name, g, want in zip(("y", "dq", "dk", "dv"), got, grads_of(exact(fn), q.double(), k.double(), v.double())):
        assert rel_err(g, want) < 1e-5, name


def test_backward_graph_holds_the_bwd_op() -> None:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graphs: dict[str, list[torch.fx.GraphModule]] = {"fwd": [], "bwd": []}

    def recorder(which: str):  # type: ignore[no-untyped-def]
        def compile_fn(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
            graphs[which].append(gm)
            return make_boxed_func(gm.forward)
        return compile_fn

    backend = aot_autograd(fw_compiler=recorder("fwd"), bw_compiler=recorder("bwd"))
    q, k, v = (x.requires_grad_() for x in randn_qkv(1, 8, 8, 2, 2, 16))
    torch.compile(block, fullgraph=True, backend=backend)(q, k, v).sum().backward()
    assert len(graphs["fwd"]) == len(graphs["bwd"]) == 1

    def targets(gm: torch.fx.GraphModule) -> list[str]:
        return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]

    assert "flashhopper.fwd.default" in targets(graphs["fwd"][0])
    assert "flashhopper.bwd.default" in targets(graphs["bwd"][0])


def test_graph_holds_the_op() -> None:
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward

    q, k, v = randn_qkv(1, 8, 8, 2, 2, 16)
    torch.compile(block, fullgraph=True, backend=record)(q, k, v)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert "flashhopper.fwd.default" in targets


def test_cuda_dispatch_is_traced_as_a_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU the backend choice queries the device, which dynamo cannot trace; it is marked
    # assume_constant_result. Exercise that path here with a pretend H100 and kernel set.
    from flashhopper import _device, _ext, dispatch

    monkeypatch.setattr(_device, "device_info", lambda index: _device.DeviceInfo("H100", (9, 0), 132))
    monkeypatch.setattr(_ext, "has_kernel", lambda mode, key: key.arch == 80)
    torch._dynamo.reset()

    def f(x: torch.Tensor) -> torch.Tensor:
        name = dispatch._select_cuda(0, torch.bfloat16, 128, "window", None)
        return x + (1.0 if name == "sm80" else -1.0)

    x = torch.zeros(3)
    assert (torch.compile(f, fullgraph=True, backend="eager")(x) == 1).all()


def test_bwd_kernel_check_is_traced_as_a_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    # flash_attn_func asks the build for a backward kernel when inputs require grad; under
    # torch.compile that question must not break the graph, and a missing kernel must still raise.
    from flashhopper import _ext, dispatch

    built = {"bwd": True}
    monkeypatch.setattr(_ext, "has_kernel", lambda mode, key: mode == "bwd" and built["bwd"])
    q, k, v = (x.requires_grad_() for x in randn_qkv(1, 4, 4, 2, 2, 128, dtype=torch.bfloat16))

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dispatch.require_bwd_kernel("sm90", q, k, v, 128, True, window=(8, -1))
        return q * 2

    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    built["bwd"] = False
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"^q requires grad, but this build has no sm90 backward kernel"):
        torch.compile(f, backend="eager")(q, k, v)  # without fullgraph: the ValueError itself
