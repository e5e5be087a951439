"""flashhopper as a Hugging Face transformers (5.x) attention backend.

    import flashhopper.integrations.transformers as fh_transformers
    name = fh_transformers.register()        # "FlashHopper"; idempotent
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name, dtype=torch.bfloat16)
    model.set_attn_implementation(name)      # or switch a loaded model (sdpa <-> FlashHopper)

The name is "FlashHopper", not "flashhopper": transformers takes every attn_implementation that
contains the lowercase string "flash" for a flash-attn build, tries to load it from the hub and
refuses it, and gives such models varlen arguments instead of masks.

What runs where, decided per call. The model builds its mask once per forward through ``build_mask``
(registered for the same name), which returns None (the kernel computes the pattern), a 2D tensor that
``attention_forward`` unpads with (a padding mask, or packed sequences' document indices), or sdpa's 4D
boolean mask (the sdpa fallback):

- ``flash_attn_func`` (bottom-right causal like flash-attn) whenever every key is real: no padding
  (attention_mask None or all ones), plain causal, sliding-window causal (Mistral, Gemma, gpt-oss:
  ``window_size=(sliding_window - 1, 0)``) or bidirectional attention, with the model's ``softcap``
  (Gemma 2), attention sinks (``s_aux``, gpt-oss) and attention dropout (in training) passed on. That is
  training and prefill without padding, and generate() with a DynamicCache (one or several new tokens
  against the cache). GQA runs natively (no repeat_kv); ``scaling`` is the softmax scale. Sliding windows,
  softcap and dropout need their kernels in the build (FLASHHOPPER_MASKS / FLASHHOPPER_SCORE_MODS /
  FLASHHOPPER_DROPOUT), or flash_attn_func says what to rebuild with.
- ``flash_attn_varlen_func`` (the packed-batch kernel; same patterns, softcap, sinks and dropout) for
  - padded batches: a 2D attention_mask with zeros, left or right padding, in training, prefill and
    generate() with a DynamicCache (one or several tokens against it). ``build_mask`` returns the keys'
    (batch, kv_length) boolean padding mask; ``attention_forward`` gathers the real keys and the real
    queries (the mask's last q_length positions: the queries are the last tokens of the keys; every query
    where attention is bidirectional), runs the kernel on them and scatters its output back, padded query
    rows getting zeros (sdpa gives them values that nothing should read). As transformers' flash-attention
    path does (``_upad_input``). A sliding window needs each row's real tokens contiguous (left or right
    padding, no holes), or the call falls back to sdpa: the kernel counts the window in real tokens.
  - packed sequences told apart by position_ids restarting (padding-free training: transformers detects
    them with ``find_packed_sequence_indices`` when there is no attention_mask and no cache, and hands the
    mask function a packed pattern, which ``build_mask`` recognises): ``build_mask`` returns each token's
    document index, int32 (batch, seqlen), and every document attends within itself (causal or sliding).
    Only for models that transformers also runs with flash-attn (``_supports_flash_attn``): others (e.g.
    Doge, which adds its own mask onto the 4D one) keep sdpa's mask, as they ask.
  - ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (with ``max_length_q`` / ``max_length_k``; where missing, computed
    from them in each layer, a synchronization), flash-attn's varlen arguments (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): over the
    batch's tokens flattened to (batch * seqlen), as transformers' flash-attention path reads them. They
    take precedence over position_ids' packing; a padding mask takes precedence over them (as in
    flash-attn's path). Tokens past cu_seq_lens_q[-1] get zeros.
  Unpadding reads the mask on the host (the real tokens' indices and the longest sequence, max_seqlen,
  are Python-side arguments): a device-to-host synchronization, as in flash-attn's integration, but once
  per mask and forward (the layers that share a mask share what was derived from it), not per layer.
- transformers' sdpa attention, with a ``SdpaFallbackWarning`` naming the reason, where sdpa can compute
  what the kernels cannot: other mask patterns (static caches' empty slots, custom masks, chunked
  attention, a sliding window over padding with holes) and a position bias. The result is what
  attn_implementation="sdpa" gives. Python's default filter shows each reason once per model class;
  ``warnings.simplefilter("error", SdpaFallbackWarning)`` turns every fallback into an error.
- NotImplementedError where neither can: such a fallback with ``softcap`` or ``s_aux`` (sdpa would ignore
  them), or with ``cu_seq_lens_q``/``_k`` and no mask that carries them (sdpa would ignore them: a position
  bias with packed sequences given that way; pass position_ids instead).
- Everything else is flash_attn_func's / flash_attn_varlen_func's: e.g. CUDA tensors must be fp16/bf16 with
  a head dim the build has, or they raise their TypeError/ValueError; CPU tensors run the float64 reference.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..interface import flash_attn_func
from ..varlen import flash_attn_varlen_func

try:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import (and_masks, bidirectional_mask_function, causal_mask_function,
                                            packed_sequence_mask_function, sdpa_mask,
                                            sliding_window_causal_mask_function)
except ImportError as e:
    raise ImportError(
        "flashhopper.integrations.transformers needs Hugging Face transformers 5.x (tested with 5.17 and 5.24): "
        "pip install 'transformers>=5'. flashhopper itself does not depend on it.") from e

ATTN_IMPLEMENTATION = "FlashHopper"

__all__ = ["ATTN_IMPLEMENTATION", "SdpaFallbackWarning", "attention_forward", "build_mask", "register"]

# build_mask's packed-sequence answer: each token's document index (a padding mask is boolean).
DOCUMENTS_DTYPE = torch.int32


class SdpaFallbackWarning(UserWarning):
    """A call ran transformers' sdpa attention instead of flashhopper's kernel (the message says why)."""


def register() -> str:
    """Register ``attention_forward`` and ``build_mask`` with transformers under ATTN_IMPLEMENTATION
    (idempotent) and return that name, for ``attn_implementation=``."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, build_mask)
    return ATTN_IMPLEMENTATION


# --- build_mask ---

def _padding_of_keys(attention_mask: torch.Tensor | None, batch_size: int, kv_length: int,
                     kv_offset: int) -> torch.Tensor | bool | None:
    """The 2D padding mask (batch, positions) at the key positions kv_offset.. kv_offset+kv_length-1: None if it
    marks every one real, else its boolean (batch, kv_length) slice; False where it does not cover them all
    (positions it does not reach count as padding, as transformers pads it with False: a static cache's
    empty slots, which need a mask)."""
    if attention_mask is None:
        return None
    keys = attention_mask[:, kv_offset:kv_offset + kv_length]
    if keys.dim() != 2 or keys.shape[-1] != kv_length or keys.shape[0] not in (1, batch_size):
        return False
    keys = keys.bool()
    if bool(keys.all()):
        return None
    return keys.expand(batch_size, -1)


def _contiguous_rows(padding: torch.Tensor) -> bool:
    """Whether each row's real positions are one run (no padding between two real tokens)."""
    n = padding.shape[-1]
    real = padding.sum(-1)
    first = padding.int().argmax(-1)
    last = n - 1 - padding.flip(-1).int().argmax(-1)
    return bool(((real == 0) | (last - first + 1 == real)).all())


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


def _closure(fn: Any, qualname: str) -> dict[str, Any]:
    """The variables a transformers.masking_utils closure named ``qualname`` captured ({} for anything else)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if (code is None or cells is None or getattr(fn, "__qualname__", None) != qualname
            or getattr(fn, "__module__", None) != "transformers.masking_utils"):
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    except ValueError:  # an empty cell
        return {}


@functools.lru_cache(maxsize=None)
def _model_takes_flash_masks(config_cls: type) -> bool:
    """Whether transformers runs this config's model with flash-attn (``_supports_flash_attn``), whose mask
    function returns None or a 2D mask where sdpa's is 4D: such a model takes build_mask's 2D answers for
    packed sequences. Models that do not (Doge: it adds its own mask onto the 4D one) keep sdpa's mask.
    Unknown configs (not in transformers' AutoModel mapping) count as taking them."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING
        return bool(getattr(MODEL_MAPPING[config_cls], "_supports_flash_attn", True))
    except Exception:
        return True


def _packed_documents(mask_function: Any, batch_size: int, q_length: int, kv_length: int, q_offset: Any,
                      kv_offset: Any, attention_mask: torch.Tensor | None,
                      kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The document index of each token, int32 (batch, q_length), where ``mask_function`` is transformers'
    packed-sequence pattern (create_causal_mask / create_sliding_window_causal_mask with position_ids that
    restart, no attention_mask and no cache): and_masks(remap_positions_for_packed_sequence(base,
    position_ids), packed_sequence_mask_function(documents)) (5.17: and_masks(base, packed_...)), ``base``
    plain or sliding-window causal.
    Within a document the positions then increase by exactly 1 (find_packed_sequence_indices starts a new
    document wherever they do not), so the base pattern on positions is the kernel's on token indices.
    None for anything else (including overlays: or/and mask functions, blockwise attention)."""
    if (attention_mask is not None or not isinstance(q_offset, int) or not isinstance(kv_offset, int)
            or q_offset != 0 or kv_offset != 0 or q_length != kv_length):
        return None
    parts = _closure(mask_function, "and_masks.<locals>.and_mask").get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    # transformers >= 5.2x wraps the base pattern to read positions; earlier 5.x apply it to token indices as is.
    base = _closure(parts[0], "remap_positions_for_packed_sequence.<locals>.inner_mask").get("mask_function",
                                                                                          parts[0])
    documents = _closure(parts[1], "packed_sequence_mask_function.<locals>.inner_mask").get("packed_sequence_mask")
    if (base is None or not isinstance(documents, torch.Tensor) or documents.dim() != 2
            or documents.shape[-1] != q_length or documents.shape[0] not in (1, batch_size)):
        return None
    if not (base is causal_mask_function or _sliding_causal(base, kwargs.get("local_size"))):
        return None
    config = kwargs.get("config")
    if config is not None and not _model_takes_flash_masks(type(config)):
        return None
    return documents.to(DOCUMENTS_DTYPE).expand(batch_size, -1)


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function: Any = causal_mask_function, attention_mask: torch.Tensor | None = None,
               **kwargs: Any) -> torch.Tensor | None:
    """The mask-building function for AttentionMaskInterface (called once per forward with the 2D padding
    mask), answering for attention_forward:

    - None where the kernel computes the pattern itself: every key real and the pattern causal (plain, or
      sliding-window: attention_forward gets the window as ``sliding_window``) with the queries at the last
      positions of the keys (bottom-right alignment, the kernel's causal), or bidirectional.
    - The same patterns over padding: the boolean (batch, kv_length) padding mask of the keys, for the
      varlen kernel (a sliding window only where each row's real tokens are contiguous). Reads the mask on
      the host (whether it has padding).
    - Packed sequences (transformers' packed-sequence pattern: position_ids restarting): each token's document
      index, int32 (batch, q_length), for the varlen kernel; see _packed_documents.
    - Otherwise sdpa's boolean (batch, 1, q_length, kv_length) mask, which attention_forward hands to sdpa.
      Where the caller forbids skipping the mask (allow_is_causal_skip / allow_is_bidirectional_skip False),
      it is always built (packed sequences aside: transformers forbids it for them itself, and models that
      ask for a materialised mask for their own use are kept to sdpa's, see _model_takes_flash_masks)."""
    documents = _packed_documents(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset,
                                  attention_mask, kwargs)
    if documents is not None:
        return documents
    sliding = mask_function is not causal_mask_function and _sliding_causal(mask_function, kwargs.get("local_size"))
    if mask_function is causal_mask_function or sliding:
        kernel_pattern = (kwargs.get("allow_is_causal_skip", True)
                          and isinstance(q_offset, int) and isinstance(kv_offset, int)  # a tensor: static cache
                          and q_offset + q_length == kv_offset + kv_length)
    else:
        kernel_pattern = (mask_function is bidirectional_mask_function
                          and kwargs.get("allow_is_bidirectional_skip", False))
    if kernel_pattern:
        padding = _padding_of_keys(attention_mask, batch_size, kv_length, kv_offset)
        if padding is None:
            return None
        if padding is not False and (not sliding or _contiguous_rows(padding)):
            return padding
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)


# --- attention_forward ---

@dataclass(frozen=True)
class _Packing:
    """Where a call's tokens go in flash_attn_varlen_func's layout. rows_q / rows_k: (batch index, position)
    of each token the kernel sees, in order, or None for every token of the (batch * seqlen) flattening;
    cu_seqlens int32 on the device, max_seqlen Python ints; zero_tail: zero the output rows past
    cu_seqlens_q[-1] (the kernels leave them unwritten)."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    rows_q: tuple[torch.Tensor, torch.Tensor] | None = None
    rows_k: tuple[torch.Tensor, torch.Tensor] | None = None
    zero_tail: bool = False


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


def _padding_packing(padding: torch.Tensor, q_length: int, causal: bool) -> _Packing:
    """Unpadding with a (batch, kv_length) boolean mask of the keys (flash-attn's _upad_input, for any
    q_length): the real keys in order; causal: the real queries among the last q_length positions (each
    row's real queries are then the last of its real keys, where bottom-right causal puts them);
    bidirectional: every query. Two host synchronizations (the indices, the maxima)."""
    batch, kv_length = padding.shape
    lengths_k = padding.sum(-1, dtype=torch.int32)
    rows_k = padding.nonzero(as_tuple=True)
    if not causal:
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=padding.device) * q_length
        return _Packing(cu_q, _cu_seqlens(lengths_k), q_length, int(lengths_k.max()), None, rows_k)
    if q_length == kv_length:
        lengths_q, rows_q = lengths_k, rows_k
    else:
        queries = padding[:, kv_length - q_length:]
        lengths_q = queries.sum(-1, dtype=torch.int32)
        rows_q = queries.nonzero(as_tuple=True)
    max_q, max_k = torch.stack([lengths_q.max(), lengths_k.max()]).tolist()
    return _Packing(_cu_seqlens(lengths_q), _cu_seqlens(lengths_k), max_q, max_k, rows_q, rows_k)


def _documents_packing(documents: torch.Tensor) -> _Packing:
    """Packed sequences from each token's document index (batch, seqlen): a sequence starts at each row's
    start and wherever the index changes. Two host synchronizations (the starts, the longest)."""
    batch, seqlen = documents.shape
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    cu = torch.cat([starts.flatten().nonzero().flatten(),
                    torch.tensor([batch * seqlen], device=documents.device)]).to(torch.int32)
    longest = int(cu.diff().max())
    return _Packing(cu, cu, longest, longest)


def _kwargs_packing(kwargs: dict[str, Any], device: torch.device) -> _Packing | None:
    """flash-attn's varlen arguments cu_seq_lens_q/_k (max_length_q/_k computed where missing), or None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None:
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k (packed sequences) go together: got only "
                         + ("cu_seq_lens_q" if cu_k is None else "cu_seq_lens_k"))
    cu_q, cu_k = (x.to(device=device, dtype=torch.int32) for x in (cu_q, cu_k))
    longest = []
    for cu, name in ((cu_q, "max_length_q"), (cu_k, "max_length_k")):
        n = kwargs.get(name)
        longest.append(int(cu.diff().max()) if n is None else int(n))
    return _Packing(cu_q, cu_k, longest[0], longest[1], zero_tail=True)


_CACHE_ATTR = "_flashhopper_packing"


def _mask_packing(mask: torch.Tensor, q_length: int, causal: bool) -> _Packing:
    """_padding_packing / _documents_packing of build_mask's 2D answer, derived once per mask object (the
    layers of one forward share it; a copy, e.g. to another device, derives it again)."""
    key = (q_length, causal) if mask.dtype != DOCUMENTS_DTYPE else None
    cache = getattr(mask, _CACHE_ATTR, None)
    if isinstance(cache, dict) and key in cache:
        return cache[key]
    if mask.dtype == DOCUMENTS_DTYPE:
        packing = _documents_packing(mask)
    else:
        packing = _padding_packing(mask.bool(), q_length, causal)
    try:
        if not isinstance(cache, dict):
            cache = {}
            setattr(mask, _CACHE_ATTR, cache)
        cache[key] = packing
    except (AttributeError, RuntimeError):  # a tensor that takes no attributes: derive it each time
        pass
    return packing


def _run_varlen(packing: _Packing, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                scaling: float | None, sliding_window: int | None, softcap: float | None,
                sinks: torch.Tensor | None, dropout: float) -> torch.Tensor:
    """flash_attn_varlen_func on the tokens ``packing`` selects; (batch, seqlen_q, nheads_q, headdim_v) back."""
    batch, nheads_q, seqlen_q, _ = query.shape
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (batch, seqlen, heads, dim)

    def select(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        return x.reshape(-1, *x.shape[2:]) if rows is None else x[rows]

    out = flash_attn_varlen_func(select(q, packing.rows_q), select(k, packing.rows_k), select(v, packing.rows_k),
                                 packing.cu_seqlens_q, packing.cu_seqlens_k, packing.max_seqlen_q,
                                 packing.max_seqlen_k, softmax_scale=scaling, causal=causal,
                                 window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
                                 softcap=softcap or 0.0, sinks=None if sinks is None else sinks.float(),
                                 dropout_p=float(dropout))
    if packing.rows_q is not None:
        return out.new_zeros(batch, seqlen_q, nheads_q, out.shape[-1]).index_put(packing.rows_q, out)
    if packing.zero_tail:
        used = torch.arange(out.shape[0], device=out.device) < packing.cu_seqlens_q[-1]
        out = torch.where(used[:, None, None], out, out.new_zeros(()))
    return out.view(batch, seqlen_q, nheads_q, out.shape[-1])


def _sdpa_mask_of(mask: torch.Tensor, q_length: int, kv_length: int, causal: bool,
                  sliding_window: int | None) -> torch.Tensor:
    """build_mask's 2D answer as sdpa's 4D boolean mask (for a call that must fall back): the queries at the
    last positions of the keys, the pattern causal, sliding-window causal or bidirectional."""
    if not causal:
        pattern = bidirectional_mask_function
    elif sliding_window:
        pattern = sliding_window_causal_mask_function(sliding_window)
    else:
        pattern = causal_mask_function
    padding = None
    if mask.dtype == DOCUMENTS_DTYPE:
        pattern = and_masks(pattern, packed_sequence_mask_function(mask))
    else:
        padding = mask.bool()
    return sdpa_mask(mask.shape[0], q_length, kv_length, kv_length - q_length, 0, pattern, padding,
                     allow_is_causal_skip=False, allow_is_bidirectional_skip=False, device=mask.device)


def _check_fallback(reason: str, softcap: float | None, kwargs: dict[str, Any]) -> None:
    """What sdpa cannot compute: it would ignore a softcap or sinks."""
    for name, value in (("softcap", softcap), ("s_aux", kwargs.get("s_aux"))):
        if value is not None:
            raise NotImplementedError(
                f"{name} with {reason}: flashhopper's kernels cannot run this call and transformers' sdpa, its "
                "fallback, ignores " + ("a softcap" if name == "softcap" else "attention sinks") +
                "; use attn_implementation='eager' for this model, or inputs that the kernels run")


def _fallback_reason(attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> str | None:
    """Why this call goes to sdpa; constant strings, so that the default filter warns once per reason."""
    if attention_mask is not None and attention_mask.dim() != 2:
        return ("an attention mask that the kernels cannot compute (a static cache's empty slots, a custom "
                "pattern, a sliding window over padding with holes)")
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
    ``module.is_causal``) is False. flash_attn_func without a mask; flash_attn_varlen_func with build_mask's
    2D answer (padding, packed sequences) or with ``cu_seq_lens_q``/``_k``; see the module docstring for
    what falls back to sdpa or raises."""
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    q_length, kv_length = query.shape[2], key.shape[2]
    mask_2d = attention_mask is not None and attention_mask.dim() == 2
    # cu_seq_lens over no mask or over packed sequences' document indices (the same sequences); a padding mask
    # takes precedence over them (as in transformers' flash path), and sdpa's 4D mask goes to sdpa, which
    # reads the mask alone.
    from_kwargs = (_kwargs_packing(kwargs, query.device)
                   if attention_mask is None or (mask_2d and attention_mask.dtype == DOCUMENTS_DTYPE) else None)
    if mask_2d:
        if attention_mask.shape[-1] != kv_length or attention_mask.shape[0] != query.shape[0]:
            raise ValueError(f"the 2D attention mask {tuple(attention_mask.shape)} does not match the keys' "
                             f"(batch, seqlen) {(query.shape[0], kv_length)}")
        if attention_mask.dtype == DOCUMENTS_DTYPE and q_length != kv_length:
            raise ValueError("packed sequences' document indices need as many queries as keys, got "
                             f"{q_length} and {kv_length}")
    reason = _fallback_reason(attention_mask, kwargs)
    sinks = kwargs.get("s_aux")
    if reason is None and (mask_2d or from_kwargs is not None):
        packing = from_kwargs if from_kwargs is not None else _mask_packing(attention_mask, q_length, causal)
        return _run_varlen(packing, query, key, value, causal, scaling, sliding_window, softcap, sinks,
                           dropout), None
    if reason is None:
        # (b, h, s, d) -> (b, s, h, d) as strided views: the last dim stays contiguous, which is all the
        # kernel needs (with 16-byte aligned strides, true for any head dim that it has). transformers'
        # sliding window W: a query sees itself and the W - 1 keys before it.
        out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                              softmax_scale=scaling, causal=causal,
                              window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
                              softcap=softcap or 0.0, sinks=None if sinks is None else sinks.float(),
                              dropout_p=float(dropout))
        return out, None
    _check_fallback(reason, softcap, kwargs)
    if from_kwargs is not None and not mask_2d:
        raise NotImplementedError(
            f"cu_seq_lens_q/cu_seq_lens_k (packed sequences) with {reason}: flashhopper's kernels cannot run this "
            "call and transformers' sdpa, its fallback, ignores cu_seq_lens; pass position_ids that restart at "
            "each sequence instead (the model then masks the packed sequences)")
    warnings.warn(f"flashhopper: {reason}: running transformers' sdpa attention for these calls",
                  SdpaFallbackWarning, stacklevel=2)
    if mask_2d:
        attention_mask = _sdpa_mask_of(attention_mask, q_length, kv_length, causal, sliding_window)
    elif attention_mask is None and causal and 1 < q_length != kv_length:
        # build_mask's None means bottom-right causal; sdpa without a mask would align it top-left.
        attention_mask = torch.ones(q_length, kv_length, dtype=torch.bool,
                                    device=query.device).tril(kv_length - q_length)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
