"""The feature key (python/flashhopper/kernel_key.py), its agreement with the extension's
(cpp/common/kernel_key.h through _C), and the build's table against its configuration: a kernel the
build was configured with is in it (on CI too, without a GPU)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from flashhopper import _ext, kernel_key
from flashhopper.kernel_key import BUILD_DTYPES, FIELDS, MASKS, KernelKey, from_dict, mask_of

needs_ext = pytest.mark.skipif(not _ext.has_extension(),
                               reason=f"needs the compiled extension ({_ext.extension_error()})")


def test_fields() -> None:
    assert FIELDS == ("arch", "dtype", "headdim", "headdim_v", "mask", "variant", "score_mod", "dropout", "varlen",
                      "kvcache")


def test_validation() -> None:
    KernelKey(90, "bfloat16", 128, 128, "window")
    with pytest.raises(ValueError, match=r"^mask must be one of"):
        KernelKey(90, "bfloat16", 128, 128, "sliding")
    with pytest.raises(ValueError, match=r"^mask must be one of"):
        KernelKey(90, "bfloat16", 128, 128, True)  # type: ignore[arg-type]  # the old causal flag
    with pytest.raises(ValueError, match=r"^dtype must be one of"):
        KernelKey(90, "bf16", 128, 128, "none")  # the build's spelling is not the key's
    with pytest.raises(ValueError, match=r"^dtype must be one of"):
        KernelKey(90, "torch.bfloat16", 128, 128, "none")
    with pytest.raises(ValueError, match=r"^score_mod must be one of"):
        KernelKey(90, "bfloat16", 128, 128, "none", score_mod="tanh")


def test_is_a_hashable_value() -> None:
    a, b = KernelKey(90, "float16", 64, 64, "causal"), KernelKey(90, "float16", 64, 64, "causal")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != dataclasses.replace(a, variant="no-pingpong") != dataclasses.replace(a, headdim_v=128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.mask = "none"  # type: ignore[misc]


def test_file_name_and_description() -> None:
    assert KernelKey(90, "bfloat16", 128, 128, "causal").file_name("fwd") == "fwd_sm90_bf16_hdim128_causal"
    assert KernelKey(80, "float16", 64, 64, "none").file_name("bwd") == "bwd_sm80_fp16_hdim64"
    assert KernelKey(90, "float8_e4m3fn", 256, 256, "window").file_name("fwd") == "fwd_sm90_e4m3_hdim256_window"
    assert KernelKey(90, "bfloat16", 192, 128, "none").file_name("fwd") == "fwd_sm90_bf16_hdim192v128"
    assert KernelKey(90, "bfloat16", 128, 128, "none", "no-pingpong").file_name("fwd") == \
        "fwd_sm90_bf16_hdim128_v-no-pingpong"
    # Every key has a file of its own.
    keys = [KernelKey(a, d, h, h, m) for a, d, h, m in itertools.product((90, 80), BUILD_DTYPES.values(), (64, 128),
                                                                            MASKS)]
    assert len({k.file_name("fwd") for k in keys}) == len(keys)
    assert KernelKey(90, "bfloat16", 128, 128, "causal").describe() == "sm90 bfloat16 headdim 128 mask causal"
    assert KernelKey(90, "bfloat16", 192, 128, "none", "x").describe() == \
        "sm90 bfloat16 headdim 192/128 mask none variant x"
    softcap = KernelKey(80, "float16", 64, 64, "window", score_mod="softcap")
    assert softcap.file_name("bwd") == "bwd_sm80_fp16_hdim64_window_softcap"
    assert softcap.describe() == "sm80 float16 headdim 64 mask window softcap"


def test_short_dtype() -> None:
    for short, name in BUILD_DTYPES.items():
        assert KernelKey(90, name, 128, 128, "none").short_dtype() == short


def test_mask_of() -> None:
    assert mask_of(False) == "none" and mask_of(True) == "causal"
    assert mask_of(False, (-1, -1)) == "none" and mask_of(True, (-1, -1)) == "causal"  # no window at all
    for window in ((-1, 0), (0, 0), (128, -1), (64, 64)):
        assert mask_of(False, window) == "window" and mask_of(True, window) == "window"


def test_from_dict() -> None:
    entry: dict[str, Any] = {"mode": "bwd", "index": 3, "arch": 80, "dtype": "float16", "headdim": 64, "headdim_v": 64,
                             "mask": "causal", "variant": "", "score_mod": "none", "dropout": False,
                             "varlen": False, "kvcache": "off", "block_m": 64, "block_n": 128}
    assert from_dict(entry) == KernelKey(80, "float16", 64, 64, "causal")
    with pytest.raises(KeyError):
        from_dict({k: v for k, v in entry.items() if k != "mask"})


def test_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the build was asked for: a missing one of these is a broken build (GPU tests fail on it).
    monkeypatch.setattr(_ext, "build_info", lambda: {})
    assert not _ext.configured("fwd", KernelKey(90, "bfloat16", 128, 128, "none"))  # no extension: nothing asked
    info = {"archs": [90, 80], "modes": ["fwd", "bwd"], "dtypes": ["bf16", "e4m3"], "headdims": [128],
            "masks": ["none", "causal"], "variants": ["no-pingpong"]}
    monkeypatch.setattr(_ext, "build_info", lambda: info)
    assert _ext.configured("bwd", KernelKey(80, "bfloat16", 128, 128, "causal"))
    assert _ext.configured("fwd", KernelKey(90, "float8_e4m3fn", 128, 128, "none"))
    assert not _ext.configured("bwd", KernelKey(90, "float8_e4m3fn", 128, 128, "none"))  # fp8: a forward only
    assert not _ext.configured("fwd", KernelKey(80, "float8_e4m3fn", 128, 128, "none"))  # and Hopper only
    assert not _ext.configured("fwd", KernelKey(90, "float16", 128, 128, "none"))
    assert not _ext.configured("fwd", KernelKey(90, "bfloat16", 64, 64, "none"))
    assert not _ext.configured("fwd", KernelKey(90, "bfloat16", 128, 128, "window"))
    assert not _ext.configured("fwd", KernelKey(90, "bfloat16", 128, 128, "none", "no-pingpong"))  # never required
    # Packed batches: forward and backward, 16-bit, when FLASHHOPPER_VARLEN has "on"; padded ones when it has "off".
    packed = KernelKey(90, "bfloat16", 128, 128, "causal", varlen=True)
    assert not _ext.configured("bwd", packed)
    info["varlen"] = ["on"]
    assert _ext.configured("fwd", packed) and _ext.configured("bwd", packed)
    assert not _ext.configured("fwd", KernelKey(90, "bfloat16", 128, 128, "causal"))
    # The packed fp8 forward (Hopper), with e4m3 in the dtypes; no fp8 backward.
    assert _ext.configured("fwd", KernelKey(90, "float8_e4m3fn", 128, 128, "none", varlen=True))
    assert not _ext.configured("bwd", KernelKey(90, "float8_e4m3fn", 128, 128, "none", varlen=True))
    assert not _ext.configured("fwd", KernelKey(80, "float8_e4m3fn", 128, 128, "none", varlen=True))
    # Packed batches with dropout: with FLASHHOPPER_DROPOUT "on", forward and backward, 16-bit only.
    assert not _ext.configured("bwd", KernelKey(90, "bfloat16", 128, 128, "causal", dropout=True, varlen=True))
    info["dropout"] = ["off", "on"]
    for arch, mode in ((90, "fwd"), (90, "bwd"), (80, "bwd")):
        assert _ext.configured(mode, KernelKey(arch, "bfloat16", 128, 128, "causal", dropout=True, varlen=True))
    assert not _ext.configured("fwd", KernelKey(90, "float8_e4m3fn", 128, 128, "none", dropout=True, varlen=True))
    info["dropout"] = ["off"]
    # KV caches: forwards with the build's masks and score mods (windows and softcap too), no dropout.
    info.update(varlen=["off", "on"], kvcache=["on", "e4m3"], masks=["none", "causal", "window"], score_mods=["none", "softcap"])
    for cache in ("on", "e4m3"):
        assert _ext.configured("fwd", KernelKey(90, "bfloat16", 128, 128, "window", score_mod="softcap", kvcache=cache))
        assert not _ext.configured("bwd", KernelKey(90, "bfloat16", 128, 128, "window", kvcache=cache))
    assert _ext.configured("fwd", KernelKey(80, "bfloat16", 128, 128, "window", kvcache="on"))
    assert not _ext.configured("fwd", KernelKey(80, "bfloat16", 128, 128, "none", kvcache="e4m3"))  # Hopper only


# --- against the extension ---

@needs_ext
def test_fields_match_the_extension() -> None:
    assert FIELDS == tuple(_ext.extension().kernel_key_fields())


@needs_ext
def test_build_info_lists_the_configuration() -> None:
    info = _ext.build_info()
    assert set(info["archs"]) <= set(kernel_key.ARCHS) and all(type(a) is int for a in info["archs"])
    assert set(info["modes"]) <= set(kernel_key.MODES)
    assert set(info["dtypes"]) <= set(BUILD_DTYPES)
    assert all(type(h) is int for h in info["headdims"])
    assert set(info["masks"]) <= set(MASKS)
    assert all(isinstance(v, str) and v for v in info["variants"])


@needs_ext
def test_every_kernel_is_configured() -> None:
    info = _ext.build_info()
    for entry in _ext.compiled_kernels():
        key = from_dict(entry)
        if key.variant:  # an ablation built beside production: named in the configuration, never required
            assert key.variant in info["variants"], entry
            assert dataclasses.replace(key, variant="") in {from_dict(e) for e in _ext.compiled_kernels()}, entry
        else:
            assert _ext.configured(entry["mode"], key), entry


@needs_ext
def test_every_configured_kernel_is_built() -> None:
    # The converse, from the configuration: a build that silently drops a kernel fails here, GPU or not.
    info = _ext.build_info()
    wanted = [(mode, KernelKey(arch, BUILD_DTYPES[dtype], h, h, mask))
              for mode, arch, dtype, h, mask in itertools.product(info["modes"], info["archs"], info["dtypes"],
                                                                   info["headdims"], info["masks"])]
    wanted = [(mode, key) for mode, key in wanted if _ext.configured(mode, key)]  # none in a bindings-only build
    missing = [f"{mode} {key.describe()}" for mode, key in wanted if _ext.kernel(mode, key) is None]
    assert not missing, f"configured but not built: {missing}"
