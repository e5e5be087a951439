"""flashhopper.integrations.transformers: tiny randomly initialised Llama and Qwen2 models (GQA: 4 query
heads, 2 kv heads) run with attn_implementation "FlashHopper" and with "sdpa", both measured against the
same weights in higher precision with sdpa (float64 for a float32 model, float32 for bf16).

The criteria are FA3's, at model level: logits and each parameter's gradient at most twice as far from
the reference as sdpa's in the same precision, plus a small slack; greedy generate() gives the same tokens
as sdpa until, possibly, a step where the two tokens are a near-tie (``greedy_agreement``). Padded batches
are judged on their real positions (the loss ignores the padding); packed sequences against each document
run on its own through the reference. On CPU the kernels are flashhopper's float64 reference
(transformers is not a CI dependency: the file skips without it); the `gpu` tests run the kernels in bf16
(scripts/check_transformers.py prints the same as a table). The helpers return numbers so that the device
script reports what the tests assert.
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
from transformers.masking_utils import (and_masks, bidirectional_mask_function, causal_mask_function,
                                        find_packed_sequence_indices, packed_sequence_mask_function, sdpa_mask,
                                        sliding_window_causal_mask_function)

try:
    from transformers.masking_utils import remap_positions_for_packed_sequence
except ImportError:  # transformers 5.17: packed sequences' base pattern reads token indices, unwrapped
    def remap_positions_for_packed_sequence(mask_function: Any, position_ids: torch.Tensor) -> Any:
        return mask_function

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
    """(FlashHopper vs reference, sdpa vs reference, FlashHopper vs sdpa) relative errors of the logits, at
    the real positions of a padded batch (the others' logits mean nothing: sdpa and FlashHopper differ there)."""
    real = (slice(None) if attention_mask is None else attention_mask.bool())
    with torch.no_grad():
        with attn(model, NAME):
            ours = model(ids, attention_mask=attention_mask, **kwargs).logits[real]
        sdpa = model(ids, attention_mask=attention_mask, **kwargs).logits[real]
        exact = ref(ids, attention_mask=attention_mask, **kwargs).logits[real]
    return rel_err(ours, exact), rel_err(sdpa, exact), rel_err(ours, sdpa)


def documents(cu_seqlens: list[int], seqlen: int) -> list[tuple[int, int, int]]:
    """(row, start, end) of each document of packed rows of ``seqlen`` tokens, from cumulative lengths over
    the rows flattened (a document does not cross rows)."""
    spans = [(a // seqlen, a % seqlen, a % seqlen + (b - a)) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    assert all(end <= seqlen for _, _, end in spans)
    return spans


def restarting_positions(spans: list[tuple[int, int, int]], batch: int, seqlen: int) -> torch.Tensor:
    """position_ids (batch, seqlen) restarting at 0 at the start of each document."""
    positions = torch.zeros(batch, seqlen, dtype=torch.long)
    for row, a, b in spans:
        positions[row, a:b] = torch.arange(b - a)
    return positions


def packed_logits_errors(model: PreTrainedModel, ref: PreTrainedModel, ids: torch.Tensor,
                         spans: list[tuple[int, int, int]], **inputs: Any) -> tuple[float, float]:
    """Documents packed into rows (``spans``: (row, start, end) of each) in one forward with FlashHopper and
    ``inputs`` (position_ids, cu_seq_lens_q/_k, ...), against each document run on its own through the
    reference, at the positions the packed forward gave it (its position_ids, else the row's); and sdpa's
    error doing the same, each document on its own: (FlashHopper vs reference, sdpa vs reference)."""
    positions = inputs.get("position_ids")

    def one_by_one(m: PreTrainedModel) -> torch.Tensor:
        out = []
        for row, a, b in spans:
            pos = (positions[row:row + 1, a:b] if positions is not None
                   else torch.arange(a, b, device=ids.device)[None])
            out.append(m(ids[row:row + 1, a:b], position_ids=pos, use_cache=False).logits[0])
        return torch.cat(out)

    with torch.no_grad():
        with attn(model, NAME):
            packed = model(ids, use_cache=False, **inputs).logits
        ours = torch.cat([packed[row, a:b] for row, a, b in spans])
        sdpa, exact = one_by_one(model), one_by_one(ref)
    return rel_err(ours, exact), rel_err(sdpa, exact)


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


def greedy_agreement(model: PreTrainedModel, ref: PreTrainedModel, ids: torch.Tensor, steps: int,
                     attention_mask: torch.Tensor | None = None) -> Agreement:
    """Greedy generate() with FlashHopper and with sdpa, judged against the reference's logits along
    FlashHopper's path (one forward over prompt + its tokens gives every step's; with a padded prompt,
    under its mask and the position_ids that generate() derives from it).

    Up to each row's first divergence both runs see the same prefix, so per step: FlashHopper's logits
    must be at most twice as far (max-abs) from the reference as sdpa's, plus slack. At a divergence
    (FlashHopper picks a, sdpa picks b) the reference must nearly tie them: l_a >= l_b - 4 e - slack,
    e = sdpa's max-abs logit error at that step. With FlashHopper's error within 2 e (as required),
    only such a gap can flip; a real bug (a wrong mask, say) picks tokens far worse than that.
    After a divergence the prefixes differ and nothing more is compared."""
    with attn(model, NAME):
        ours, our_logits = greedy(model, ids, steps, attention_mask)
    sdpa, sdpa_logits = greedy(model, ids, steps, attention_mask)
    inputs = {}
    if attention_mask is not None:
        mask = torch.cat([attention_mask, torch.ones_like(ours)], dim=1)
        inputs = {"attention_mask": mask, "position_ids": (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)}
    with torch.no_grad():
        exact = ref(torch.cat([ids, ours], dim=1), **inputs).logits[:, ids.shape[1] - 1:-1].double()
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


def grads(model: PreTrainedModel, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
          **inputs: Any) -> dict[str, torch.Tensor]:
    """Each parameter's gradient of the language-modelling loss on ``ids`` (one training step's; padding
    excluded from the loss, as a padded batch's labels do)."""
    labels = ids if attention_mask is None else ids.masked_fill(attention_mask == 0, -100)
    model.zero_grad(set_to_none=True)
    model(ids, attention_mask=attention_mask, labels=labels, use_cache=False, **inputs).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_errors(model: PreTrainedModel, ref: PreTrainedModel, ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, **inputs: Any) -> dict[str, tuple[float, float]]:
    """Per parameter: (FlashHopper vs reference, sdpa vs reference) relative errors of the gradient."""
    with attn(model, NAME):
        ours = grads(model, ids, attention_mask, **inputs)
    sdpa, exact = grads(model, ids, attention_mask, **inputs), grads(ref, ids, attention_mask, **inputs)
    assert ours.keys() == exact.keys() == sdpa.keys()
    return {n: (rel_err(ours[n], exact[n]), rel_err(sdpa[n], exact[n])) for n in exact}


def within_noise(err: float, sdpa_err: float) -> bool:
    return err <= 2 * sdpa_err + SLACK


def assert_within_noise(what: str, err: float, sdpa_err: float) -> None:
    assert within_noise(err, sdpa_err), f"{what}: error {err:.3e} > 2 x sdpa's {sdpa_err:.3e} + {SLACK}"


def padded_and_packed_checks(model: PreTrainedModel, ref: PreTrainedModel, vocab: int,
                             seqlen: int) -> tuple[dict[str, str], list[str]]:
    """The padded and packed cases (flash_attn_varlen_func) at model level, for the gpu test and
    scripts/check_transformers.py: each check's numbers as a printable cell, and the failures (empty when
    all pass). Logits of 3 rows of ``seqlen`` tokens, left and right padded (none, an eighth, two thirds);
    generate() on left-padded prompts of seqlen / 3 tokens; 2 rows of 5 packed documents, told apart by
    position_ids or by cu_seq_lens (documents then at the row's positions), against each document alone;
    the gradients of a training step on the left-padded batch and on the packed rows (worst parameter:
    error / sdpa's). ``model`` is left in eval mode."""
    device = model.device
    cells: dict[str, str] = {}
    failures: list[str] = []

    def judge(name: str, err: float, sdpa_err: float) -> None:
        cells[name] = f"{err:.2e} / {sdpa_err:.2e}"
        if not within_noise(err, sdpa_err):
            failures.append(f"{name}: error {err:.3e} > 2 x sdpa's {sdpa_err:.3e}")

    ids = torch.randint(1, vocab, (3, seqlen), device=device)
    pads = [0, seqlen // 8, 2 * seqlen // 3]
    for side in ("left", "right"):
        judge(f"{side}-padded logits", *logits_errors(model, ref, *padded(ids, pads, side))[:2])
    prompt = seqlen // 3
    prompt_ids, prompt_mask = left_padded(ids[:, :prompt], [0, prompt // 8, prompt // 2])
    agreement = greedy_agreement(model, ref, prompt_ids, steps=8, attention_mask=prompt_mask)
    cells["left-padded greedy"] = agreement.summary()
    failures += [f"left-padded greedy: {f}" for f in agreement.failures]

    cu = [0, seqlen // 3, seqlen - seqlen // 5, seqlen, seqlen + seqlen // 4, 2 * seqlen]
    spans = documents(cu, seqlen)
    packed_ids, positions = ids[:2], restarting_positions(spans, 2, seqlen).to(device)
    judge("packed logits (position_ids)", *packed_logits_errors(model, ref, packed_ids, spans, position_ids=positions))
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    judge("packed logits (cu_seq_lens)", *packed_logits_errors(
        model, ref, packed_ids, spans, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest,
        max_length_k=longest))

    model.train()
    ref.train()
    left_ids, left_mask = padded(ids, pads, "left")
    for name, g in (("left-padded grads", grad_errors(model, ref, left_ids, left_mask)),
                    ("packed grads", grad_errors(model, ref, packed_ids, position_ids=positions))):
        worst, (err, sdpa_err) = max(g.items(), key=lambda kv: kv[1][0] / max(kv[1][1], 1e-30))
        cells[name] = f"{err / max(sdpa_err, 1e-30):.2f} ({worst})"
        failures += [f"{name}: {n}: error {e:.3e} > 2 x sdpa's {se:.3e}" for n, (e, se) in g.items()
                     if not within_noise(e, se)]
    model.eval()
    ref.eval()
    return cells, failures


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
def varlen_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """(q shape, k shape, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size) of each
    flash_attn_varlen_func call the backend makes (cu_seqlens as lists, checked int32 on q's device)."""
    calls = []

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
            max_k: int, **kwargs: Any) -> torch.Tensor:
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.device == cu_k.device == q.device
        assert type(max_q) is int and type(max_k) is int
        calls.append((tuple(q.shape), tuple(k.shape), cu_q.tolist(), cu_k.tolist(), max_q, max_k, kwargs["causal"],
                      kwargs["window_size"]))
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    flash_attn_varlen_func = fht.flash_attn_varlen_func
    monkeypatch.setattr(fht, "flash_attn_varlen_func", spy)
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


def padded(ids: torch.Tensor, pads: list[int], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """left_padded, or the same with the padding at the end of each row (side "right")."""
    if side == "left":
        return left_padded(ids, pads)
    ids, mask = left_padded(ids.flip(-1), pads)
    return ids.flip(-1), mask.flip(-1)


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


# Padded batches and packed sequences: flash_attn_varlen_func.

PADS = [0, 3, 8]  # per row of a (3, 11) batch: none, some, all but three


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_runs_varlen(family: str, side: str, kernel_calls: list, varlen_calls: list,
                                  no_fallback: None) -> None:
    """Logits at the real positions within FA3's criterion; every layer unpads to the real tokens (the rows'
    cumulative lengths), causal, GQA heads as they are."""
    model = tiny_model(family)
    ids, mask = padded(torch.randint(1, 128, (3, 11)), PADS, side)
    assert_within_noise("logits", *logits_errors(model, reference_model(model), ids, mask)[:2])
    assert kernel_calls == []
    assert varlen_calls == [((22, 4, 16), (22, 2, 16), [0, 11, 19, 22], [0, 11, 19, 22], 11, 11, True, (-1, -1))] * 2


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_gradients_match_sdpa(family: str, side: str, varlen_calls: list, no_fallback: None) -> None:
    """A training step on a padded batch (padding out of the loss): each parameter's gradient within FA3's
    criterion, through flash_attn_varlen_func's backward."""
    model = tiny_model(family).train()
    ids, mask = padded(torch.randint(1, 128, (3, 11)), PADS, side)
    for name, (err, sdpa_err) in grad_errors(model, reference_model(model), ids, mask).items():
        assert_within_noise(f"{name}.grad", err, sdpa_err)
    assert len(varlen_calls) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_left_padded_matches_sdpa(family: str, kernel_calls: list, varlen_calls: list,
                                                  no_fallback: None) -> None:
    """generate() on left-padded prompts with the DynamicCache: prefill and every decoding step unpad (one
    query per row against its real keys), and the tokens are sdpa's (near-ties aside)."""
    model = tiny_model(family)
    ids, mask = left_padded(torch.randint(1, 128, (3, 7)), [0, 2, 5])
    agreement = greedy_agreement(model, reference_model(model), ids, steps=6, attention_mask=mask)
    assert not agreement.failures, agreement.describe()
    assert kernel_calls == []
    lengths = [7, 5, 2]
    assert varlen_calls[:2] == [((14, 4, 16), (14, 2, 16), [0, 7, 12, 14], [0, 7, 12, 14], 7, 7, True, (-1, -1))] * 2
    for step in range(1, 6):
        k = [n + step for n in lengths]
        cu_k = [0, k[0], k[0] + k[1], sum(k)]
        assert varlen_calls[2 * step][:6] == ((3, 4, 16), (sum(k), 2, 16), [0, 1, 2, 3], cu_k, 1, k[0])


def test_tokens_against_a_padded_cache_run_varlen(varlen_calls: list, no_fallback: None) -> None:
    """Several new tokens against a left-padded DynamicCache (chunked prefill): the queries are the last real
    tokens of each row, bottom-right causal against its real keys."""
    model = tiny_model("llama")
    ids, mask = left_padded(torch.randint(1, 128, (2, 12)), [0, 4])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = {}
    with torch.no_grad():
        for implementation in (NAME, "sdpa"):
            with attn(model, implementation):
                cache = model(ids[:, :9], attention_mask=mask[:, :9], position_ids=positions[:, :9],
                              use_cache=True).past_key_values
                logits[implementation] = model(ids[:, 9:], attention_mask=mask, position_ids=positions[:, 9:],
                                               past_key_values=cache).logits
        exact = reference_model(model)(ids, attention_mask=mask, position_ids=positions).logits[:, 9:]
    assert_within_noise("logits", rel_err(logits[NAME], exact), rel_err(logits["sdpa"], exact))
    assert [c[:6] for c in varlen_calls[2:]] == [((6, 4, 16), (20, 2, 16), [0, 3, 6], [0, 12, 20], 3, 12)] * 2


def test_sliding_window_over_padding_runs_varlen(varlen_calls: list, no_fallback: None) -> None:
    """Qwen2 with its last layer sliding (window 4): over left or right padding (each row's real tokens in one
    run) both layers unpad, the sliding one with window_size (3, 0) counted in real tokens."""
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ref = reference_model(model)
    for side in ("left", "right"):
        ids, mask = padded(torch.randint(1, 128, (3, 12)), [0, 5, 9], side)
        assert_within_noise(f"{side} logits", *logits_errors(model, ref, ids, mask)[:2])
    assert [c[7] for c in varlen_calls] == [(-1, -1), (3, 0)] * 2


def test_sliding_window_over_holes_falls_back_to_sdpa(varlen_calls: list) -> None:
    """Padding between real tokens: a sliding window counts positions, the kernel would count real tokens, so
    the sliding layer falls back to sdpa (the full one still unpads)."""
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ids = torch.randint(1, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 3:6] = 0
    with pytest.warns(fht.SdpaFallbackWarning, match="holes"):
        errors = logits_errors(model, reference_model(model), ids.masked_fill(mask == 0, 0), mask)
    assert_within_noise("logits", *errors[:2])
    assert [c[7] for c in varlen_calls] == [(-1, -1)]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sequences_run_varlen(family: str, kernel_calls: list, varlen_calls: list, no_fallback: None) -> None:
    """Documents packed into two rows, told apart by position_ids restarting at 0 (padding-free training):
    each attends within itself, as each document run on its own; the cumulative lengths are the
    documents' over the rows flattened."""
    model = tiny_model(family)
    cu = [0, 5, 8, 12, 14, 24]
    spans = documents(cu, 12)
    ids, positions = torch.randint(1, 128, (2, 12)), restarting_positions(spans, 2, 12)
    assert_within_noise("logits", *packed_logits_errors(model, reference_model(model), ids, spans,
                                                        position_ids=positions))
    assert kernel_calls == []
    assert varlen_calls == [((24, 4, 16), (24, 2, 16), cu, cu, 10, 10, True, (-1, -1))] * 2


def test_packed_sequences_gradients_match_sdpa(varlen_calls: list, no_fallback: None) -> None:
    model = tiny_model("qwen2").train()
    spans = documents([0, 4, 11, 16], 16)
    ids, positions = torch.randint(1, 128, (1, 16)), restarting_positions(spans, 1, 16)
    for name, (err, sdpa_err) in grad_errors(model, reference_model(model), ids, position_ids=positions).items():
        assert_within_noise(f"{name}.grad", err, sdpa_err)
    assert [c[2] for c in varlen_calls] == [[0, 4, 11, 16]] * 2


@pytest.mark.parametrize("with_positions", [True, False])
def test_cu_seq_lens_run_varlen(with_positions: bool, kernel_calls: list, varlen_calls: list,
                                no_fallback: None) -> None:
    """flash-attn's varlen arguments (DataCollatorWithFlattening(return_flash_attn_kwargs=True)): with
    position_ids restarting, as that collator gives them, or alone (the documents then keep the row's
    positions): each document as if run on its own."""
    model = tiny_model("llama")
    cu = [0, 6, 9, 15]
    spans = documents(cu, 15)
    ids = torch.randint(1, 128, (1, 15))
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    inputs = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": 6, "max_length_k": 6}
    if with_positions:
        inputs["position_ids"] = restarting_positions(spans, 1, 15)
    assert_within_noise("logits", *packed_logits_errors(model, reference_model(model), ids, spans, **inputs))
    assert kernel_calls == []
    assert varlen_calls == [((15, 4, 16), (15, 2, 16), cu, cu, 6, 6, True, (-1, -1))] * 2


def test_cu_seq_lens_gradients_match_sdpa(varlen_calls: list, no_fallback: None) -> None:
    """A training step with cu_seq_lens and position_ids (sdpa and the reference read the position_ids)."""
    model = tiny_model("llama").train()
    cu = [0, 7, 9, 14]
    spans = documents(cu, 14)
    ids = torch.randint(1, 128, (1, 14))
    inputs = {"position_ids": restarting_positions(spans, 1, 14), "cu_seq_lens_q": torch.tensor(cu, dtype=torch.int32),
              "cu_seq_lens_k": torch.tensor(cu, dtype=torch.int32), "max_length_q": 7, "max_length_k": 7}
    for name, (err, sdpa_err) in grad_errors(model, reference_model(model), ids, **inputs).items():
        assert_within_noise(f"{name}.grad", err, sdpa_err)
    assert [c[2] for c in varlen_calls] == [cu] * 2


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_and_sinks_over_padding_reach_varlen(family: str, varlen_calls: list, no_fallback: None) -> None:
    """Gemma 2's softcap and gpt-oss's sinks with their sliding layers over a left-padded batch, against
    transformers' eager attention with the same mask (at the real positions); Gemma 2 within FA3's criterion
    of the float64 model run on each row's real tokens alone (its eager attention over padding gives NaNs in
    float64)."""
    model = tiny_variant_model(family)
    pads = [0, 3, 7]
    ids, mask = left_padded(torch.randint(1, 128, (3, 12)), pads)
    real = mask.bool()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits[real]
        if family == "gemma2":
            ref = copy.deepcopy(model).to(torch.float64)
            exact = torch.cat([ref(ids[row:row + 1, n:], position_ids=torch.arange(n, 12)[None]).logits[0]
                               for row, n in enumerate(pads)])
        model.set_attn_implementation(NAME)
        ours = model(ids, attention_mask=mask).logits[real]
    if family == "gemma2":
        assert_within_noise("logits", rel_err(ours, exact), rel_err(eager, exact))
    else:
        assert rel_err(ours, eager) < 1e-5
    assert [c[7] for c in varlen_calls] == [(3, 0), (-1, -1)]


def test_attention_forward_unpads_each_row() -> None:
    """attention_forward with build_mask's padding mask, against flash_attn_func on each row's real tokens
    alone: causal with the queries the last q_length tokens (prefill, one and several tokens against a
    cache; left, right and inner padding), and bidirectional (every query, cross-attention lengths too);
    padded query rows give zeros."""
    masks = torch.tensor([[1] * 10, [0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
                          [1, 1, 0, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    k, v = torch.randn(4, 2, 10, 8, dtype=torch.float64), torch.randn(4, 2, 10, 8, dtype=torch.float64)
    for causal, q_length in [(True, 10), (True, 1), (True, 4), (False, 10), (False, 3)]:
        q = torch.randn(4, 4, q_length, 8, dtype=torch.float64)
        out, _ = fht.attention_forward(torch.nn.Module(), q, k, v, masks, is_causal=causal, scaling=0.3)
        for row, real in enumerate(masks):
            queries = real[10 - q_length:] if causal else torch.ones(q_length, dtype=torch.bool)
            if queries.any():
                expect = fht.flash_attn_func(q[row:row + 1, :, queries].transpose(1, 2),
                                             k[row:row + 1, :, real].transpose(1, 2),
                                             v[row:row + 1, :, real].transpose(1, 2), softmax_scale=0.3, causal=causal)
                torch.testing.assert_close(out[row, queries], expect[0], rtol=1e-12, atol=1e-12)
            assert not out[row, ~queries].any()


def test_cu_seq_lens_leave_no_garbage_past_the_last_sequence() -> None:
    q, k, v = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    out, _ = fht.attention_forward(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    t = (lambda x: x.transpose(1, 2))
    for a, b in ((0, 3), (3, 5)):
        torch.testing.assert_close(out[:, a:b], fht.flash_attn_func(t(q)[:, a:b], t(k)[:, a:b], t(v)[:, a:b],
                                                                    causal=True))
    assert not out[:, 5:].any()


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_and_packed_checks(family: str, kernel_calls: list, varlen_calls: list, no_fallback: None) -> None:
    """The gpu test's (and scripts/check_transformers.py's) checks, small, on the CPU."""
    model = tiny_model(family)
    cells, failures = padded_and_packed_checks(model, reference_model(model), vocab=128, seqlen=24)
    assert not failures, "; ".join(failures)
    assert len(cells) == 7 and kernel_calls == [] and varlen_calls


# Fallbacks to sdpa: the same computation as attn_implementation="sdpa", with the warning.

def test_dropout_with_padding_runs_the_varlen_kernel(varlen_calls: list, kernel_calls: list,
                                                     no_fallback: None) -> None:
    """A padded batch in training with attention dropout goes to flash_attn_varlen_func(dropout_p=): repeatable
    under one seed, other draws under another, none in eval mode; gradients flow through the op's backward."""
    model = tiny_model("llama", attention_dropout=0.5).train()
    ids, mask = left_padded(torch.randint(1, 128, (2, 10)), [0, 4])
    with attn(model, NAME):
        torch.manual_seed(1)
        first = model(ids, attention_mask=mask).logits
        torch.manual_seed(1)
        again = model(ids, attention_mask=mask).logits
        torch.manual_seed(2)
        other = model(ids, attention_mask=mask).logits
        model.eval()
        plain = model(ids, attention_mask=mask).logits
        model.train()
        torch.manual_seed(1)
        model(ids, attention_mask=mask).logits.sum().backward()
    real = mask.bool()
    assert torch.equal(first, again) and not torch.equal(first[real], other[real])
    assert not torch.equal(first[real], plain[real])
    assert len(varlen_calls) == 10 and kernel_calls == []  # 2 layers x 5 forwards
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


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


def test_cu_seq_lens_that_sdpa_would_ignore_raise() -> None:
    """cu_seq_lens and a call that must fall back (a position bias): sdpa would ignore them. (Dropout runs the
    packed kernel.)"""
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    cu = {"cu_seq_lens_q": torch.tensor([0, 3, 5]), "cu_seq_lens_k": torch.tensor([0, 3, 5])}
    out, _ = fht.attention_forward(torch.nn.Module(), q, k, v, None, dropout=0.5, **cu)
    assert out.shape == (1, 5, 4, 8) and torch.isfinite(out).all()
    with pytest.raises(NotImplementedError, match="cu_seq_lens_q"):
        fht.attention_forward(torch.nn.Module(), q, k, v, None, position_bias=torch.zeros(1, 4, 5, 5), **cu)
    with pytest.raises(ValueError, match="go together"):
        fht.attention_forward(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu["cu_seq_lens_q"])


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
RIGHT_PAD = PAD.flip(-1)
HOLES = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
SLIDING, FULL = sliding_window_causal_mask_function(3), bidirectional_mask_function


@pytest.mark.parametrize("expect, args", [
    ("none", {"q_length": 8, "kv_length": 8}),                                      # training, prefill
    ("none", {"q_length": 1, "kv_length": 8, "q_offset": 7}),                       # a decoding step
    ("none", {"q_length": 3, "kv_length": 8, "q_offset": 5}),                       # tokens against a cache
    ("none", {"q_length": 8, "kv_length": 8, "attention_mask": PAD[:1]}),           # an all-ones mask
    ("none", {"q_length": 8, "kv_length": 8, "mask_function": FULL, "allow_is_bidirectional_skip": True}),
    ("padding", {"q_length": 8, "kv_length": 8, "attention_mask": PAD}),            # left padding
    ("padding", {"q_length": 8, "kv_length": 8, "attention_mask": RIGHT_PAD}),      # right padding
    ("padding", {"q_length": 8, "kv_length": 8, "attention_mask": HOLES}),          # causal counts real tokens
    ("padding", {"q_length": 1, "kv_length": 8, "q_offset": 7, "attention_mask": PAD}),  # a decoding step
    ("padding", {"q_length": 3, "kv_length": 8, "q_offset": 5, "attention_mask": PAD}),  # tokens against a cache
    ("padding", {"q_length": 8, "kv_length": 8, "attention_mask": PAD, "mask_function": FULL,
                 "allow_is_bidirectional_skip": True}),
    ("padding", {"q_length": 8, "kv_length": 8, "attention_mask": RIGHT_PAD, "mask_function": SLIDING,
                 "local_size": 3}),
    ("none", {"q_length": 8, "kv_length": 8, "mask_function": SLIDING, "local_size": 3}),
    ("sdpa", {"q_length": 8, "kv_length": 8, "attention_mask": HOLES, "mask_function": SLIDING,
              "local_size": 3}),                                                    # a window over holes
    ("sdpa", {"q_length": 1, "kv_length": 9, "q_offset": 8, "attention_mask": PAD[:1]}),  # ones, short of the keys
    ("sdpa", {"q_length": 8, "kv_length": 16}),                                     # a static cache's empty slots
    ("sdpa", {"q_length": 8, "kv_length": 16, "attention_mask": PAD}),              # ... with padding
    ("sdpa", {"q_length": 8, "kv_length": 8, "allow_is_causal_skip": False}),       # the caller wants a mask
    ("sdpa", {"q_length": 8, "kv_length": 8, "allow_is_causal_skip": False, "attention_mask": PAD}),
    ("sdpa", {"q_length": 8, "kv_length": 8, "mask_function": FULL}),               # ... bidirectional too
    ("sdpa", {"q_length": 8, "kv_length": 8, "mask_function": SLIDING}),            # another pattern
])
def test_build_mask(expect: str, args: dict[str, Any]) -> None:
    """None exactly where the kernel computes the pattern itself; the keys' padding mask where the varlen
    kernel computes it over padding; otherwise sdpa's full boolean mask."""
    mask = fht.build_mask(batch_size=2 if "attention_mask" not in args else len(args["attention_mask"]), **args)
    if expect == "none":
        assert mask is None
    elif expect == "padding":
        assert mask.dtype == torch.bool and torch.equal(mask, args["attention_mask"])
    else:
        sdpa_args = {**args, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False}
        assert mask.dim() == 4 and torch.equal(mask, sdpa_mask(batch_size=mask.shape[0], **sdpa_args))


def test_build_mask_packed_sequences() -> None:
    """transformers' packed-sequence masks (position_ids restarting, no attention_mask, no cache) come back as
    each token's document index, int32, for the causal and the sliding layers; an overlay on them, or a
    model that adds its own mask onto sdpa's (Doge), keeps sdpa's mask."""
    from transformers import DogeConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]] * 2, dtype=torch.int32)
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=1)
    model.set_attn_implementation(NAME)
    embeds = torch.empty(2, 9, 0)
    for create in (create_causal_mask, create_sliding_window_causal_mask):
        mask = create(model.config, embeds, None, None, positions)
        assert mask.dtype == torch.int32 and torch.equal(mask, docs)
        assert create(model.config, embeds, None, None, torch.arange(9)[None]) is None  # not packed
    packed = and_masks(remap_positions_for_packed_sequence(causal_mask_function, positions.expand(2, -1)),
                       packed_sequence_mask_function(find_packed_sequence_indices(positions.expand(2, -1))))
    sdpa = sdpa_mask(2, 9, 9, mask_function=packed, allow_is_causal_skip=False)
    assert torch.equal(fht.build_mask(2, 9, 9, mask_function=packed), docs)
    overlay = and_masks(packed, lambda b, h, q, kv: kv != 4)
    assert torch.equal(fht.build_mask(2, 9, 9, mask_function=overlay),
                       sdpa_mask(2, 9, 9, mask_function=overlay, allow_is_causal_skip=False))
    assert torch.equal(fht.build_mask(2, 9, 9, mask_function=packed, config=DogeConfig()), sdpa)


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

def gpu_model(family: str, varlen: bool = False) -> PreTrainedModel:
    """The device family's causal kernels (forward and backward; with ``varlen``, the packed-batch ones too)
    must be in the build."""
    cap = torch.cuda.get_device_capability()
    backend = next(b for b in ("sm90", "sm80") if runs_on(b, cap))
    require_backend(backend, torch.bfloat16, 128, True, mode="bwd")
    if varlen:
        require_backend(backend, torch.bfloat16, 128, True, mode="bwd", varlen=True)
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


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_padded_and_packed(family: str, kernel_calls: list, varlen_calls: list, no_fallback: None) -> None:
    """Padded batches (left, right; logits, generate(), gradients) and packed sequences (position_ids,
    cu_seq_lens; logits, gradients) through flash_attn_varlen_func, within FA3's criterion."""
    model = gpu_model(family, varlen=True)
    cells, failures = padded_and_packed_checks(model, reference_model(model), vocab=1024, seqlen=300)
    assert not failures, "; ".join(failures)
    assert kernel_calls == [] and varlen_calls
