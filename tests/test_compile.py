"""torch.compile traces flash_attn_func as one op, through its fake implementation."""
from __future__ import annotations

import pytest
import torch
from helpers import randn_qkv

import flashhopper  # noqa: F401  (registers the op)
from flashhopper import flash_attn_func

pytestmark = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(),
                                reason="torch.compile (dynamo) is not supported on this Python/torch")


def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out, lse = flash_attn_func(q * 2, k, v, causal=True, return_lse=True)
    return out.sum(-1) + lse.transpose(1, 2)


def test_fake_impl_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = randn_qkv(2, 33, 17, 8, 2, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.flashhopper.fwd.default(q, k, v, 0.125, True, "sm90")
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (2, 8, 33) and lse.dtype == torch.float32 and lse.is_contiguous()


def test_opcheck() -> None:
    # torch's own consistency checks of a custom op: schema, fake vs real, dispatch under tracing.
    # (Not test_autograd_registration: there is deliberately no backward yet.)
    q, k, v = randn_qkv(2, 9, 11, 4, 2, 16)
    torch.library.opcheck(torch.ops.flashhopper.fwd.default, (q, k, v, 0.3, True, "reference"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend: str) -> None:
    torch._dynamo.reset()
    q, k, v = randn_qkv(2, 24, 40, 4, 2, 32)
    compiled = torch.compile(block, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v))


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
    monkeypatch.setattr(_ext, "has_fwd_kernel", lambda arch, dtype, headdim, causal: arch == 80)
    torch._dynamo.reset()

    def f(x: torch.Tensor) -> torch.Tensor:
        name = dispatch._select_cuda(0, torch.bfloat16, 128, True, None)
        return x + (1.0 if name == "sm80" else -1.0)

    x = torch.zeros(3)
    assert (torch.compile(f, fullgraph=True, backend="eager")(x) == 1).all()
