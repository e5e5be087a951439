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
  real: no padding (attention_mask None or all ones), plain causal or bidirectional attention. That is
  training and prefill without padding, and generate() with a DynamicCache (one or several new tokens
  against the cache). GQA runs natively (no repeat_kv); ``scaling`` is the softmax scale.
- transformers' sdpa attention, with a ``SdpaFallbackWarning`` naming the reason, where sdpa can compute
  what the kernel cannot yet: padded batches and packed sequences (no varlen kernel yet, issue #21),
  other mask patterns (sliding window layers, static caches' empty slots, custom masks), dropout > 0,
  a position bias. The result is what attn_implementation="sdpa" gives. Python's default filter shows
  each reason once per model class; ``warnings.simplefilter("error", SdpaFallbackWarning)`` turns every
  fallback into an error.
- NotImplementedError where neither can: ``softcap`` and ``s_aux`` (attention sinks; sdpa would ignore
  them), a ``sliding_window`` or packed sequences (``cu_seq_lens_q``/``_k``) that no mask carries.
  flash_attn_func has softcap, sinks and window_size (issue #23); this backend does not route them to it
  yet.
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
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, sdpa_mask
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


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function: Any = causal_mask_function, attention_mask: torch.Tensor | None = None,
               **kwargs: Any) -> torch.Tensor | None:
    """The mask-building function for AttentionMaskInterface (called once per forward with the 2D
    padding mask). None where the kernel computes the pattern itself: every key real and the pattern
    plain causal with the queries at the last positions of the keys (bottom-right alignment, the
    kernel's causal) or bidirectional. Otherwise sdpa's boolean (batch, 1, q_length, kv_length) mask,
    which attention_forward hands to sdpa. Where the caller forbids skipping the mask
    (allow_is_causal_skip / allow_is_bidirectional_skip False), it is always built."""
    if mask_function is causal_mask_function:
        kernel_pattern = (kwargs.get("allow_is_causal_skip", True)
                          and isinstance(q_offset, int) and isinstance(kv_offset, int)  # a tensor: static cache
                          and q_offset + q_length == kv_offset + kv_length)
    else:
        kernel_pattern = mask_function is bidirectional_mask_function and kwargs.get("allow_is_bidirectional_skip", False)
    if kernel_pattern and _all_keys_real(attention_mask, kv_length, kv_offset):
        return None
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)


def _check_supported(attention_mask: torch.Tensor | None, sliding_window: int | None, softcap: float | None,
                     kwargs: dict[str, Any]) -> None:
    if softcap is not None:
        raise NotImplementedError(
            f"softcap={softcap}: this transformers backend does not pass a softcap to flashhopper yet "
            "(flash_attn_func(softcap=) has it), and transformers' sdpa ignores it; use "
            "attn_implementation='eager' for this model")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            "s_aux: this transformers backend does not pass attention sinks to flashhopper yet "
            "(flash_attn_func(sinks=) has them), and transformers' sdpa ignores them; use "
            "attn_implementation='eager' for this model")
    if attention_mask is None and sliding_window is not None:
        raise NotImplementedError(
            f"sliding_window={sliding_window} without a mask: this transformers backend does not pass a window "
            "to flashhopper yet; build the model's masks with flashhopper.integrations.transformers.register()")
    if attention_mask is None and any(kwargs.get(n) is not None for n in ("cu_seq_lens_q", "cu_seq_lens_k")):
        raise NotImplementedError(
            "cu_seq_lens_q/cu_seq_lens_k (packed sequences) without a mask: flashhopper has no varlen kernel yet "
            "(issue #21); pass position_ids so that the model masks the packed sequences")


def _fallback_reason(attention_mask: torch.Tensor | None, dropout: float, sliding_window: int | None,
                     kwargs: dict[str, Any]) -> str | None:
    """Why this call goes to sdpa; constant strings, so that the default filter warns once per reason."""
    if sliding_window is not None:
        return "sliding_window (this backend does not pass windows to flash_attn_func yet)"
    if attention_mask is not None:
        return ("an attention mask (padding, packed sequences, a static cache's empty slots or a custom pattern; "
                "no varlen kernel yet, issue #21)")
    if dropout > 0:
        return "dropout > 0 (no attention dropout in flashhopper)"
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
    _check_supported(attention_mask, sliding_window, softcap, kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    reason = _fallback_reason(attention_mask, dropout, sliding_window, kwargs)
    if reason is None:
        # (b, h, s, d) -> (b, s, h, d) as strided views: the last dim stays contiguous, which is all the
        # kernel needs (with 16-byte aligned strides, true for any head dim that it has).
        out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                              softmax_scale=scaling, causal=bool(causal))
        return out, None
    warnings.warn(f"flashhopper: {reason}: running transformers' sdpa attention for these calls",
                  SdpaFallbackWarning, stacklevel=2)
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and causal and 1 < q_len != kv_len:
        # build_mask's None means bottom-right causal; sdpa without a mask would align it top-left.
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
