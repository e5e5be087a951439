"""flashhopper as a Hugging Face transformers (5.x) attention backend.

    import flashhopper.integrations.transformers as fh_transformers
    name = fh_transformers.register()        # "FlashHopper"; idempotent
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name, dtype=torch.bfloat16)
    model.set_attn_implementation(name)      # or switch a loaded model (sdpa <-> FlashHopper)

The name is "FlashHopper", not "flashhopper": transformers takes every attn_implementation that
contains the lowercase string "flash" for a flash-attn build, tries to load it from the hub and
refuses it, and gives such models varlen arguments instead of masks.

What runs where, decided per call (the model builds its mask once per forward through ``build_mask``,
registered for the same name):

- flashhopper's kernel (``flash_attn_func``, bottom-right causal like flash-attn) whenever every key is
  real: no padding (attention_mask None or all ones), plain causal, sliding-window causal (Mistral,
  Gemma, gpt-oss: ``window_size=(sliding_window - 1, 0)``) or bidirectional attention, with the model's
  ``softcap`` (Gemma 2), attention sinks (``s_aux``, gpt-oss) and attention dropout (in training) passed
  on. That is training and prefill without padding, and generate() with a DynamicCache (one or several new
  tokens against the cache). GQA runs natively (no repeat_kv); ``scaling`` is the softmax scale. Sliding
  windows, softcap and dropout need their kernels in the build (FLASHHOPPER_MASKS / FLASHHOPPER_SCORE_MODS
  / FLASHHOPPER_DROPOUT), or flash_attn_func says what to rebuild with.
- transformers' sdpa attention, with a ``SdpaFallbackWarning`` naming the reason, where sdpa can compute
  what the kernel cannot yet: padded batches and packed sequences (this integration does not route them to
  flash_attn_varlen_func yet: issue #21),
  other mask patterns (static caches' empty slots, custom masks), a position bias. The
  result is what attn_implementation="sdpa" gives. Python's default filter shows each reason once per
  model class; ``warnings.simplefilter("error", SdpaFallbackWarning)`` turns every fallback into an error.
- NotImplementedError where neither can: such a fallback with ``softcap`` or ``s_aux`` (sdpa would ignore
  them), and packed sequences (``cu_seq_lens_q``/``_k``) that no mask carries.
- Everything else is flash_attn_func's: e.g. CUDA tensors must be fp16/bf16 with a head dim the build
  has, or it raises its TypeError/ValueError; CPU tensors run the float64 reference.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from ..interface import flash_attn_func

try:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import (bidirectional_mask_function, causal_mask_function, sdpa_mask,
                                            sliding_window_causal_mask_function)
except ImportError as e:
    raise ImportError(
        "flashhopper.integrations.transformers needs Hugging Face transformers 5.x (tested with 5.17): "
        "pip install 'transformers>=5'. flashhopper itself does not depend on it.") from e

ATTN_IMPLEMENTATION = "FlashHopper"

__all__ = ["ATTN_IMPLEMENTATION", "SdpaFallbackWarning", "attention_forward", "build_mask", "register"]


class SdpaFallbackWarning(UserWarning):
    """A call ran transformers' sdpa attention instead of flashhopper's kernel (the message says why)."""


def register() -> str:
    """Register ``attention_forward`` and ``build_mask`` with transformers under ATTN_IMPLEMENTATION
    (idempotent) and return that name, for ``attn_implementation=``."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, build_mask)
    return ATTN_IMPLEMENTATION


def _all_keys_real(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> bool:
    """The 2D padding mask (batch, positions) marks every key position kv_offset.. kv_offset+kv_length-1
    real (positions it does not reach count as padding, as transformers pads it with False)."""
    if attention_mask is None:
        return True
    keys = attention_mask[:, kv_offset:kv_offset + kv_length]
    return keys.shape[-1] == kv_length and bool(keys.all())


def _sliding_causal(mask_function: Any, local_size: Any) -> bool:
    """Whether ``mask_function`` is transformers' sliding-window causal pattern of width ``local_size``. Mask
    functions are closures without an identity to compare, so it is probed where patterns differ: query
    rows around the first windows, every key up to past them (a chunked pattern, which comes with a
    local_size too, differs at the chunk edges)."""
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
        return False
    w = local_size
    q = torch.tensor([0, 1, w - 1, w, w + 1, 2 * w + 1, 3 * w])[:, None]
    kv = torch.arange(3 * w + 2)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    try:
        got = mask_function(zero, zero, q, kv)
    except Exception:  # a function that needs more than indices (e.g. a padding mask's batch lookup)
        return False
    return bool(torch.equal(torch.as_tensor(got).expand(q.shape[0], kv.shape[1]),
                            sliding_window_causal_mask_function(w)(zero, zero, q, kv).expand(q.shape[0], kv.shape[1])))


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function: Any = causal_mask_function, attention_mask: torch.Tensor | None = None,
               **kwargs: Any) -> torch.Tensor | None:
    """The mask-building function for AttentionMaskInterface (called once per forward with the 2D
    padding mask). None where the kernel computes the pattern itself: every key real and the pattern
    causal (plain, or sliding-window: attention_forward gets the window as ``sliding_window``) with the
    queries at the last positions of the keys (bottom-right alignment, the kernel's causal) or
    bidirectional. Otherwise sdpa's boolean (batch, 1, q_length, kv_length) mask, which attention_forward
    hands to sdpa. Where the caller forbids skipping the mask (allow_is_causal_skip /
    allow_is_bidirectional_skip False), it is always built."""
    if mask_function is causal_mask_function or _sliding_causal(mask_function, kwargs.get("local_size")):
        kernel_pattern = (kwargs.get("allow_is_causal_skip", True)
                          and isinstance(q_offset, int) and isinstance(kv_offset, int)  # a tensor: static cache
                          and q_offset + q_length == kv_offset + kv_length)
    else:
        kernel_pattern = mask_function is bidirectional_mask_function and kwargs.get("allow_is_bidirectional_skip", False)
    if kernel_pattern and _all_keys_real(attention_mask, kv_length, kv_offset):
        return None
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)


def _check_supported(attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    if attention_mask is None and any(kwargs.get(n) is not None for n in ("cu_seq_lens_q", "cu_seq_lens_k")):
        raise NotImplementedError(
            "cu_seq_lens_q/cu_seq_lens_k (packed sequences) without a mask: this integration does not route them to "
            "flash_attn_varlen_func yet (issue #21; call it directly for packed documents); pass position_ids so that "
            "the model masks the packed sequences")


def _check_fallback(reason: str, softcap: float | None, kwargs: dict[str, Any]) -> None:
    """What sdpa cannot compute: it would ignore a softcap or sinks."""
    for name, value in (("softcap", softcap), ("s_aux", kwargs.get("s_aux"))):
        if value is not None:
            raise NotImplementedError(
                f"{name} with {reason}: flashhopper's kernel cannot run this call and transformers' sdpa, its "
                "fallback, ignores " + ("a softcap" if name == "softcap" else "attention sinks") +
                "; use attn_implementation='eager' for this model, or inputs without padding")


def _fallback_reason(attention_mask: torch.Tensor | None, dropout: float, kwargs: dict[str, Any]) -> str | None:
    """Why this call goes to sdpa; constant strings, so that the default filter warns once per reason."""
    if attention_mask is not None:
        return ("an attention mask (padding, packed sequences, a static cache's empty slots or a custom pattern; "
                "not routed to the varlen kernels yet, issue #21)")
    if kwargs.get("position_bias") is not None:
        return "position_bias (no additive bias in flashhopper)"
    return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (batch, nheads_q, seqlen_q, headdim), key and
    value (batch, nheads_kv, seqlen_k, headdim), the mask from ``build_mask``; returns
    (out (batch, seqlen_q, nheads_q, headdim), None). Causal unless ``is_causal`` (or, without it,
    ``module.is_causal``) is False. See the module docstring for what falls back to sdpa or raises."""
    _check_supported(attention_mask, kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    reason = _fallback_reason(attention_mask, dropout, kwargs)
    if reason is None:
        # (b, h, s, d) -> (b, s, h, d) as strided views: the last dim stays contiguous, which is all the
        # kernel needs (with 16-byte aligned strides, true for any head dim that it has). transformers'
        # sliding window W: a query sees itself and the W - 1 keys before it.
        sinks = kwargs.get("s_aux")
        out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                              softmax_scale=scaling, causal=bool(causal),
                              window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
                              softcap=softcap or 0.0, sinks=None if sinks is None else sinks.float(),
                              dropout_p=float(dropout))
        return out, None
    _check_fallback(reason, softcap, kwargs)
    warnings.warn(f"flashhopper: {reason}: running transformers' sdpa attention for these calls",
                  SdpaFallbackWarning, stacklevel=2)
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and causal and 1 < q_len != kv_len:
        # build_mask's None means bottom-right causal; sdpa without a mask would align it top-left.
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
