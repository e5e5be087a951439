"""flashhopper.integrations.transformers: tiny randomly initialised Llama and Qwen2 models (GQA: 4 query
heads, 2 kv heads) run with attn_implementation "FlashHopper" and with "sdpa", both measured against the
same weights in higher precision with sdpa (float64 for a float32 model, float32 for bf16).

The criteria are FA3's, at model level: logits and each parameter's gradient at most twice as far from
the reference as sdpa's in the same precision, plus a small slack; greedy generate() gives the same tokens
as sdpa until, possibly, a step where the two tokens are a near-tie (``greedy_agreement``). On CPU the
kernel is flashhopper's float64 reference (transformers is not a CI dependency: the file skips without
it); the `gpu` tests run the kernels in bf16 (scripts/check_transformers.py prints the same as a table).
The helpers return numbers so that the device script reports what the tests assert.
"""
from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from helpers import rel_err, require_backend
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM, StaticCache
from transformers.masking_utils import bidirectional_mask_function, sdpa_mask, sliding_window_causal_mask_function

import flashhopper.integrations.transformers as fht
from flashhopper.dispatch import runs_on

NAME = fht.register()
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
# Slack on top of twice sdpa's error: float32/float64 rounding of the reference itself.
SLACK = 1e-6


def tiny_model(family: str, hidden: int = 64, vocab: int = 128, layers: int = 2, dtype: torch.dtype = torch.float32,
               device: str = "cpu", **config: Any) -> PreTrainedModel:
    """A randomly initialised decoder (4 query heads, 2 kv heads, head dim hidden/4) in eval mode, on sdpa.
    initializer_range 0.2 (not 0.02) spreads the logits, so that greedy decoding rarely meets near-ties."""
    config_cls, model_cls = FAMILIES[family]
    cfg = config_cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096, initializer_range=0.2,
                     pad_token_id=0, bos_token_id=None, eos_token_id=None, **config)
    return model_cls(cfg).to(device=device, dtype=dtype).eval()


def reference_model(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights, one precision up (float64 for float32, float32 for bf16/fp16), on sdpa."""
    ref = copy.deepcopy(model).to(torch.float64 if model.dtype == torch.float32 else torch.float32)
    ref.set_attn_implementation("sdpa")
    return ref


@contextmanager
def attn(model: PreTrainedModel, implementation: str) -> Iterator[PreTrainedModel]:
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation("sdpa")


def logits_errors(model: PreTrainedModel, ref: PreTrainedModel, ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[float, float, float]:
    """(FlashHopper vs reference, sdpa vs reference, FlashHopper vs sdpa) relative errors of the logits."""
    with torch.no_grad():
        with attn(model, NAME):
            ours = model(ids, attention_mask=attention_mask, **kwargs).logits
        sdpa = model(ids, attention_mask=attention_mask, **kwargs).logits
        exact = ref(ids, attention_mask=attention_mask, **kwargs).logits
    return rel_err(ours, exact), rel_err(sdpa, exact), rel_err(ours, sdpa)


def greedy(model: PreTrainedModel, ids: torch.Tensor, steps: int,
           attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """generate()'s greedy tokens (batch, steps) and the logits each step chose from (batch, steps, vocab)."""
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


@dataclass
class Agreement:
    steps: int  # tokens generated per row
    agreed: list[int]  # per row: steps equal to sdpa's before the first divergence
    failures: list[str]  # empty when every row passes

    def summary(self) -> str:
        return f"{min(self.agreed)}/{self.steps} steps equal (min over rows)"

    def describe(self) -> str:
        return self.summary() + "".join(f"; {f}" for f in self.failures)


def greedy_agreement(model: PreTrainedModel, ref: PreTrainedModel, ids: torch.Tensor, steps: int) -> Agreement:
    """Greedy generate() with FlashHopper and with sdpa, judged against the reference's logits along
    FlashHopper's path (one forward over prompt + its tokens gives every step's).

    Up to each row's first divergence both runs see the same prefix, so per step: FlashHopper's logits
    must be at most twice as far (max-abs) from the reference as sdpa's, plus slack. At a divergence
    (FlashHopper picks a, sdpa picks b) the reference must nearly tie them: l_a >= l_b - 4 e - slack,
    e = sdpa's max-abs logit error at that step. With FlashHopper's error within 2 e (as required),
    only such a gap can flip; a real bug (a wrong mask, say) picks tokens far worse than that.
    After a divergence the prefixes differ and nothing more is compared."""
    with attn(model, NAME):
        ours, our_logits = greedy(model, ids, steps)
    sdpa, sdpa_logits = greedy(model, ids, steps)
    with torch.no_grad():
        exact = ref(torch.cat([ids, ours], dim=1)).logits[:, ids.shape[1] - 1:-1].double()
    agreed, failures = [], []
    for row in range(ids.shape[0]):
        differ = (ours[row] != sdpa[row]).nonzero()
        t = int(differ[0]) if len(differ) else steps
        agreed.append(t)
        for s in range(min(t + 1, steps)):
            err = (our_logits[row, s].double() - exact[row, s]).abs().max().item()
            sdpa_err = (sdpa_logits[row, s].double() - exact[row, s]).abs().max().item()
            if not within_noise(err, sdpa_err):
                failures.append(f"row {row} step {s}: logit error {err:.3e} > 2 x sdpa's {sdpa_err:.3e}")
            if s == t:
                a, b = int(ours[row, t]), int(sdpa[row, t])
                gap = (exact[row, t, b] - exact[row, t, a]).item()
                if not gap <= 4 * sdpa_err + SLACK:
                    failures.append(f"row {row} step {t}: token {a} instead of sdpa's {b}, which the reference "
                                    f"prefers by {gap:.3e} > 4 x sdpa's logit error {sdpa_err:.3e}")
    return Agreement(steps, agreed, failures)


def grads(model: PreTrainedModel, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each parameter's gradient of the language-modelling loss on ``ids`` (one training step's)."""
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_errors(model: PreTrainedModel, ref: PreTrainedModel, ids: torch.Tensor) -> dict[str, tuple[float, float]]:
    """Per parameter: (FlashHopper vs reference, sdpa vs reference) relative errors of the gradient."""
    with attn(model, NAME):
        ours = grads(model, ids)
    sdpa, exact = grads(model, ids), grads(ref, ids)
    assert ours.keys() == exact.keys() == sdpa.keys()
    return {n: (rel_err(ours[n], exact[n]), rel_err(sdpa[n], exact[n])) for n in exact}


def within_noise(err: float, sdpa_err: float) -> bool:
    return err <= 2 * sdpa_err + SLACK


def assert_within_noise(what: str, err: float, sdpa_err: float) -> None:
    assert within_noise(err, sdpa_err), f"{what}: error {err:.3e} > 2 x sdpa's {sdpa_err:.3e} + {SLACK}"


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """(q shape, k shape, causal, window_size, softcap, with sinks, dropout_p) of each flash_attn_func call the
    backend makes."""
    calls = []

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        calls.append((tuple(q.shape), tuple(k.shape), kwargs["causal"], kwargs["window_size"],
                      kwargs["softcap"], kwargs["sinks"] is not None, kwargs["dropout_p"]))
        return flash_attn_func(q, k, v, **kwargs)

    flash_attn_func = fht.flash_attn_func
    monkeypatch.setattr(fht, "flash_attn_func", spy)
    return calls


@pytest.fixture
def no_fallback() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", fht.SdpaFallbackWarning)
        yield


def left_padded(ids: torch.Tensor, pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids with the first pads[row] tokens of each row replaced by padding, and the 2D attention mask."""
    mask = torch.ones_like(ids)
    for row, n in enumerate(pads):
        mask[row, :n] = 0
    return ids.masked_fill(mask == 0, 0), mask


# CPU: the float64 reference as the kernel, a float32 model.

@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_sdpa(family: str, kernel_calls: list, no_fallback: None) -> None:
    model = tiny_model(family)
    ids = torch.randint(1, 128, (2, 13))
    assert_within_noise("logits", *logits_errors(model, reference_model(model), ids)[:2])
    # Every layer through the kernel, causal, GQA heads as they are (no repeat_kv).
    assert [c[:3] for c in kernel_calls] == [((2, 13, 4, 16), (2, 13, 2, 16), True)] * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_sdpa(family: str, kernel_calls: list, no_fallback: None) -> None:
    model = tiny_model(family)
    agreement = greedy_agreement(model, reference_model(model), torch.randint(1, 128, (2, 7)), steps=6)
    assert not agreement.failures, agreement.describe()
    # Prefill, then one token at a time against the DynamicCache (bottom-right causal).
    assert [c[:3] for c in kernel_calls[:2]] == [((2, 7, 4, 16), (2, 7, 2, 16), True)] * 2
    assert [c[:3] for c in kernel_calls[2::2]] == [((2, 1, 4, 16), (2, 8 + i, 2, 16), True) for i in range(5)]


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_gradients_match_sdpa(family: str, no_fallback: None) -> None:
    model = tiny_model(family).train()
    for name, (err, sdpa_err) in grad_errors(model, reference_model(model), torch.randint(1, 128, (2, 11))).items():
        assert_within_noise(f"{name}.grad", err, sdpa_err)


def test_tokens_against_a_cache_run_the_kernel(kernel_calls: list, no_fallback: None) -> None:
    """Several new tokens against a non-empty cache (assisted decoding, chunked prefill): bottom-right
    causal, which is what the kernel computes, so no mask and no fallback."""
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 12))
    logits = {}
    with torch.no_grad():
        for implementation in (NAME, "sdpa"):
            with attn(model, implementation):
                cache = model(ids[:, :9], use_cache=True).past_key_values
                logits[implementation] = model(ids[:, 9:], past_key_values=cache).logits
        exact = reference_model(model)(ids).logits[:, 9:]
    assert_within_noise("logits", rel_err(logits[NAME], exact), rel_err(logits["sdpa"], exact))
    assert [c[:3] for c in kernel_calls[2:]] == [((2, 3, 4, 16), (2, 12, 2, 16), True)] * 2


def test_bidirectional_runs_the_kernel_non_causal(kernel_calls: list, no_fallback: None) -> None:
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 10))
    assert_within_noise("logits", *logits_errors(model, reference_model(model), ids, is_causal=False)[:2])
    assert [c[2] for c in kernel_calls] == [False, False]


# Fallbacks to sdpa: the same computation as attn_implementation="sdpa", with the warning.

@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_falls_back_to_sdpa(family: str, kernel_calls: list) -> None:
    model = tiny_model(family)
    ids, mask = left_padded(torch.randint(1, 128, (3, 9)), [0, 3, 8])
    with torch.no_grad(), attn(model, NAME):
        with pytest.warns(fht.SdpaFallbackWarning, match="padding"):
            ours = model(ids, attention_mask=mask).logits
        with pytest.warns(fht.SdpaFallbackWarning, match="padding"):
            ours_tokens, _ = greedy(model, ids, 4, mask)
    with torch.no_grad():
        assert torch.equal(ours, model(ids, attention_mask=mask).logits)
    assert torch.equal(ours_tokens, greedy(model, ids, 4, mask)[0])
    assert kernel_calls == []


def test_packed_sequences_fall_back_to_sdpa(kernel_calls: list) -> None:
    """Sequences packed into one row, told apart by position_ids restarting at 0 (padding-free training)."""
    model = tiny_model("llama")
    ids, positions = torch.randint(1, 128, (1, 12)), torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        with pytest.warns(fht.SdpaFallbackWarning, match="packed"), attn(model, NAME):
            ours = model(ids, position_ids=positions, use_cache=False).logits
        assert torch.equal(ours, model(ids, position_ids=positions, use_cache=False).logits)
    assert kernel_calls == []


def test_all_ones_mask_runs_the_kernel(kernel_calls: list, no_fallback: None) -> None:
    model = tiny_model("qwen2")
    ids = torch.randint(1, 128, (2, 9))
    assert_within_noise("logits", *logits_errors(model, reference_model(model), ids, torch.ones_like(ids))[:2])
    assert len(kernel_calls) == 2


def test_sliding_window_layers_run_the_kernel(kernel_calls: list, no_fallback: None) -> None:
    """Qwen2 with its last layer sliding (window 4 < 12 tokens): both layers run the kernel, the sliding one
    with window_size (3, 0) (a query sees itself and the 3 keys before it), and the logits match sdpa's
    masked attention."""
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ids = torch.randint(1, 128, (2, 12))
    errors = logits_errors(model, reference_model(model), ids)
    assert_within_noise("logits", *errors[:2])
    assert [c[3] for c in kernel_calls] == [(-1, -1), (3, 0)]


def test_dropout_runs_the_kernel(kernel_calls: list, no_fallback: None) -> None:
    """Training with attention dropout goes to flash_attn_func(dropout_p=): repeatable under one seed, other
    draws under another, none in eval mode."""
    model = tiny_model("llama", attention_dropout=0.5).train()
    ids = torch.randint(1, 128, (2, 10))
    with attn(model, NAME):
        torch.manual_seed(1)
        first = model(ids).logits
        torch.manual_seed(1)
        again = model(ids).logits
        torch.manual_seed(2)
        other = model(ids).logits
        model.eval()
        plain = model(ids).logits
    assert torch.equal(first, again) and not torch.equal(first, other) and not torch.equal(first, plain)
    assert {c[6] for c in kernel_calls} == {0.5, 0.0}
    with attn(model, NAME):
        torch.manual_seed(1)
        model.train()
        model(ids).logits.sum().backward()  # through the op's backward with the same draws
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_static_cache_falls_back_to_sdpa(kernel_calls: list) -> None:
    """A StaticCache's keys include its empty slots, which only a mask excludes: prefill, then a step."""
    def prefill_and_step(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
        cache = StaticCache(config=model.config, max_cache_len=16)
        return torch.cat([model(ids[:, :9], past_key_values=cache).logits,
                          model(ids[:, 9:], past_key_values=cache).logits], dim=1)

    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 10))
    with torch.no_grad():
        with pytest.warns(fht.SdpaFallbackWarning, match="static cache"), attn(model, NAME):
            ours = prefill_and_step(model, ids)
        sdpa = prefill_and_step(model, ids)
        exact = reference_model(model)(ids).logits
    assert_within_noise("logits", rel_err(ours, exact), rel_err(sdpa, exact))
    assert kernel_calls == []


def test_fallback_keeps_bottom_right_causal() -> None:
    """A fallback without a mask (here for a position bias) gives sdpa the bottom-right causal mask:
    build_mask's None means queries at the end of the keys, where sdpa alone would align them top-left."""
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    module = torch.nn.Module()
    with pytest.warns(fht.SdpaFallbackWarning, match="position_bias"):
        out, _ = fht.attention_forward(module, q, k, v, None, position_bias=torch.zeros(1, 2, 3, 5))
    ref = fht.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("option, kwargs", [
    ("softcap", {"softcap": 30.0}),
    ("s_aux", {"s_aux": torch.zeros(4)}),
])
def test_options_sdpa_cannot_run_raise_on_fallback(option: str, kwargs: dict[str, Any]) -> None:
    """Softcap and sinks reach the kernel; where a call must fall back (here: a padding mask) sdpa would
    ignore them, so it raises instead."""
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    with pytest.raises(NotImplementedError, match=option):
        fht.attention_forward(torch.nn.Module(), q, k, v, mask, **kwargs)


def test_packed_sequences_without_a_mask_raise() -> None:
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(NotImplementedError, match="cu_seq_lens_q"):
        fht.attention_forward(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=torch.tensor([0, 3, 5]))


def tiny_variant_model(family: str) -> PreTrainedModel:
    """Gemma 2 (softcap 50 on the attention logits, sliding window 4 on alternate layers) or gpt-oss (sinks,
    sliding window 4), tiny and random, float32, eval mode."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

    common = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "sliding_window": 4,
              "initializer_range": 0.2, "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}
    if family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**common, attn_logit_softcapping=5.0, query_pre_attn_scalar=16))
    else:
        model = GptOssForCausalLM(GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2))
        with torch.no_grad():  # sinks start at zero: make them matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 2)
    return model.eval()


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_sinks_and_windows_reach_the_kernel(family: str, kernel_calls: list, no_fallback: None) -> None:
    """Gemma 2's softcap and gpt-oss's sinks, with their sliding layers, against transformers' eager
    attention (which has both; sdpa ignores them): logits within FA3's criterion of the float64 model (Gemma
    2), or within float32 noise of eager (gpt-oss: its MoE has no float64 kernel), and the gradients."""
    model = tiny_variant_model(family)
    ids = torch.randint(1, 128, (2, 12))
    ref = copy.deepcopy(model)
    if family == "gemma2":
        ref = ref.to(torch.float64)
    ref.set_attn_implementation("eager")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids).logits
        exact = ref(ids).logits
    model.set_attn_implementation(NAME)  # not attn(): gpt-oss refuses sdpa, which it would switch back to
    ours = model(ids).logits
    ours.float().square().mean().backward()
    if family == "gemma2":
        assert_within_noise("logits", rel_err(ours.detach(), exact), rel_err(eager, exact))
    else:
        assert rel_err(ours.detach(), eager) < 1e-5
    windows = [c[3] for c in kernel_calls]
    assert windows == [(3, 0), (-1, -1)]  # layer 0 sliding, layer 1 full
    if family == "gemma2":
        assert all(c[4] == 5.0 for c in kernel_calls)
    else:
        assert all(c[5] for c in kernel_calls)
        sinks = model.model.layers[0].self_attn.sinks
        assert sinks.grad is not None and sinks.grad.abs().sum() > 0
    ref.zero_grad()
    ref(ids).logits.float().square().mean().backward()
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
        if p.grad is not None and p_ref.grad is not None and p_ref.grad.abs().sum() > 0:
            assert rel_err(p.grad, p_ref.grad) < 1e-4, name
PAD = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
SLIDING, FULL = sliding_window_causal_mask_function(3), bidirectional_mask_function


@pytest.mark.parametrize("none, args", [
    (True, {"q_length": 8, "kv_length": 8}),                                        # training, prefill
    (True, {"q_length": 1, "kv_length": 8, "q_offset": 7}),                         # a decoding step
    (True, {"q_length": 3, "kv_length": 8, "q_offset": 5}),                         # tokens against a cache
    (True, {"q_length": 8, "kv_length": 8, "attention_mask": PAD[:1]}),             # an all-ones mask
    (True, {"q_length": 8, "kv_length": 8, "mask_function": FULL, "allow_is_bidirectional_skip": True}),
    (False, {"q_length": 8, "kv_length": 8, "attention_mask": PAD}),                # padding
    (False, {"q_length": 1, "kv_length": 9, "q_offset": 8, "attention_mask": PAD[:1]}),  # ones, short of the keys
    (False, {"q_length": 8, "kv_length": 16}),                                      # a static cache's empty slots
    (False, {"q_length": 8, "kv_length": 8, "allow_is_causal_skip": False}),        # the caller wants a mask
    (False, {"q_length": 8, "kv_length": 8, "mask_function": FULL}),                # ... bidirectional too
    (False, {"q_length": 8, "kv_length": 8, "mask_function": SLIDING}),             # another pattern
])
def test_build_mask(none: bool, args: dict[str, Any]) -> None:
    """None exactly where the kernel computes the pattern itself; otherwise sdpa's full boolean mask."""
    mask = fht.build_mask(batch_size=2 if "attention_mask" not in args else len(args["attention_mask"]), **args)
    if none:
        assert mask is None
    else:
        sdpa_args = {**args, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False}
        assert torch.equal(mask, sdpa_mask(batch_size=mask.shape[0], **sdpa_args))


# Entry points and the optional dependency.

def test_from_pretrained_and_register_idempotent(tmp_path: Any, kernel_calls: list) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    assert fht.register() == NAME
    model = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME)
    assert model.config._attn_implementation == NAME
    model(torch.randint(1, 128, (1, 5)))
    assert len(kernel_calls) == 2


def test_clear_error_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "flashhopper.integrations.transformers")
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'transformers>=5'"):
        import flashhopper.integrations.transformers  # noqa: F401


def test_import_flashhopper_does_not_import_transformers() -> None:
    code = "import sys, flashhopper, flashhopper.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# GPU: the kernels in bf16, head dim 128 (the CI build's), against sdpa in bf16 and the float32 reference.

def gpu_model(family: str) -> PreTrainedModel:
    """The device family's causal kernels (forward and backward) must be in the build."""
    cap = torch.cuda.get_device_capability()
    require_backend(next(b for b in ("sm90", "sm80") if runs_on(b, cap)), torch.bfloat16, 128, True, mode="bwd")
    return tiny_model(family, hidden=512, vocab=1024, dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_logits_generate_and_gradients(family: str, no_fallback: None) -> None:
    model = gpu_model(family)
    ref = reference_model(model)
    ids = torch.randint(1, 1024, (2, 300), device="cuda")
    assert_within_noise("logits", *logits_errors(model, ref, ids)[:2])
    agreement = greedy_agreement(model, ref, ids[:, :100], steps=8)
    assert not agreement.failures, agreement.describe()
    model.train()
    for name, (err, sdpa_err) in grad_errors(model, ref.train(), ids).items():
        assert_within_noise(f"{name}.grad", err, sdpa_err)
