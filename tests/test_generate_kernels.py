"""cpp/generate_kernels.py: how configurations share translation units (one per arch, mode, dtype and head dims, at
most MAX_UNITS_PER_TU), and which units turn on CuTe's extended WGMMA shapes (their headers: ~30 s of a unit's compile
on two cores). sm90/gemm.h's ss_atom / rs_atom fail the compile of a tile that needs the define without it; these tests
pin the other direction, tiles that would carry the cost for nothing, and that grouping loses no configuration."""
from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

GENERATOR = Path(__file__).resolve().parents[1] / "cpp" / "generate_kernels.py"
DEFINE = "#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"
UNIT = re.compile(r"^// (\S+)\nusing (Config\d+) = (KernelConfig<[^;]+>);$", re.M)


def load_generator():
    spec = importlib.util.spec_from_file_location("generate_kernels", GENERATOR)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


gen = load_generator()
kk = gen.kk


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen")
    subprocess.run([sys.executable, str(GENERATOR), "--out", str(out), "--archs", "90", "80", "--modes", "fwd", "bwd",
                    "--dtypes", "bf16", "fp16", "e4m3", "--hdims", "64", "96", "128", "192", "256", "192x128", "128x64",
                    "--masks", "none", "causal", "window", "--variants", "no-pingpong", "--score-mods", "none",
                    "softcap", "--dropout", "off", "on", "--varlen", "off", "on", "--kvcache", "off", "on", "e4m3"],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def tus(out: Path) -> dict[str, str]:
    """Generated translation unit name -> its text."""
    names = (out / "sources.txt").read_text().split()
    return {n.removesuffix(".cu"): (out / n).read_text() for n in names}


def units_of(text: str) -> list[tuple[str, str, str]]:
    """(configuration's file name, alias, KernelConfig) of each configuration a translation unit instantiates."""
    return UNIT.findall(text)


def test_every_configuration_instantiated_once(out: Path, tus: dict[str, str]) -> None:
    configs = [(tu[:3], c) for tu, text in tus.items() for _, _, c in units_of(text)]  # the same config: fwd and bwd
    names = [n for text in tus.values() for n, _, _ in units_of(text)]
    registry = (out / "registry.cpp").read_text()
    assert len(configs) == len(set(configs)) == len(set(names)) == registry.count("::key(), &run_")
    assert len(configs) > 500  # the full matrix
    assert len(tus) < len(configs) / 4


def test_units_share_arch_mode_dtype_headdims(tus: dict[str, str]) -> None:
    for tu, text in tus.items():
        units = units_of(text)
        assert 1 <= len(units) <= gen.MAX_UNITS_PER_TU, tu
        stem = re.sub(r"_part\d+$", "", tu)
        for name, alias, _ in units:
            # The stem is the configuration's name up to its head dims; every alias is used by its own lines only.
            assert re.fullmatch(re.escape(stem) + r"(_\S+)?", name), (tu, name)
            assert text.count(f"<{alias}>") >= 2, (tu, alias)


def test_define_where_some_unit_needs_it_and_before_every_include(tus: dict[str, str]) -> None:
    keys = {key.file_name(mode): (mode, key) for mode, key in all_keys()}
    for tu, text in tus.items():
        needs = any(gen.extended_wgmma_shapes(*keys[name]) for name, _, _ in units_of(text))
        assert (DEFINE in text) == needs, tu
        if needs:
            assert text.index(DEFINE) < text.index("#include"), tu


def test_ampere_units_never_extended(tus: dict[str, str]) -> None:
    sm80 = [t for t in tus if "_sm80_" in t]
    assert sm80 and not any(DEFINE in tus[t] for t in sm80)


@functools.cache
def all_keys() -> list[tuple[str, object]]:
    """(mode, KernelKey) of every combination of the fields, valid or not (looked up by file name)."""
    keys = []
    for arch in (90, 80):
        for mode in ("fwd", "bwd"):
            for dtype in ("bfloat16", "float16", "float8_e4m3fn"):
                for hd, hdv in ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128), (128, 64)):
                    for mask in ("none", "causal", "window"):
                        for score_mod in ("none", "softcap"):
                            for dropout in (False, True):
                                for varlen in (False, True):
                                    for kvcache in ("off", "on", "e4m3"):
                                        for variant in ("", "no-pingpong"):
                                            keys.append((mode, kk.KernelKey(arch, dtype, hd, hdv, mask, variant,
                                                                            score_mod, dropout, varlen, kvcache)))
    return keys


def key(name: str) -> tuple[str, object]:
    return next((m, k) for m, k in all_keys() if k.file_name(m) == name)


@pytest.mark.parametrize("name", [
    "fwd_sm90_bf16_hdim64", "fwd_sm90_fp16_hdim128_causal", "fwd_sm90_bf16_hdim128_varlen",
    "fwd_sm90_bf16_hdim128_causal_kvcache", "fwd_sm90_bf16_hdim96_causal", "fwd_sm90_fp16_hdim96_window_softcap",
    "fwd_sm90_bf16_hdim192v128",
    "fwd_sm90_bf16_hdim128v64", "fwd_sm90_e4m3_hdim128_causal", "fwd_sm90_e4m3_hdim256",
    "fwd_sm90_bf16_hdim256_kvcache-e4m3", "bwd_sm90_bf16_hdim64_causal", "bwd_sm90_bf16_hdim128",
    "bwd_sm90_fp16_hdim128v64_causal", "bwd_sm90_bf16_hdim256_causal_dropout",
])
def test_standard_shapes_only(name: str) -> None:
    assert not gen.extended_wgmma_shapes(*key(name))


@pytest.mark.parametrize("name", [
    "fwd_sm90_bf16_hdim256", "fwd_sm90_fp16_hdim256_causal_kvcache", "fwd_sm90_bf16_hdim192_causal",
    "fwd_sm90_e4m3_hdim64_causal", "fwd_sm90_e4m3_hdim64_varlen", "fwd_sm90_bf16_hdim96", "fwd_sm90_fp16_hdim96_dropout",
    "bwd_sm90_bf16_hdim96",
    "bwd_sm90_bf16_hdim192v128_causal", "bwd_sm90_fp16_hdim256_varlen",
])
def test_extended_where_a_tile_needs_it(name: str) -> None:
    assert gen.extended_wgmma_shapes(*key(name))


def test_another_head_dim_leaves_the_other_units_unchanged(tmp_path: Path) -> None:
    """A unit's text depends on its own configurations only, so a build that adds a head dim recompiles its units."""
    common = ["--archs", "90", "80", "--modes", "fwd", "bwd", "--dtypes", "bf16", "--masks", "none", "causal",
              "--varlen", "off", "on", "--kvcache", "off", "on"]
    texts = []
    for hdims in (["64", "128"], ["64", "96", "128"]):
        out = tmp_path / "-".join(hdims)
        subprocess.run([sys.executable, str(GENERATOR), "--out", str(out), "--hdims", *hdims, *common],
                       check=True, capture_output=True)
        texts.append({n: (out / n).read_text() for n in (out / "sources.txt").read_text().split()})
    assert set(texts[0]) < set(texts[1])
    assert all(texts[0][n] == texts[1][n] for n in texts[0])


def test_default_head_dims_are_the_explicit_list(tmp_path: Path) -> None:
    """Without --hdims the generator builds every head dim and pair (the default goes through parse_headdim too)."""
    common = ["--archs", "90", "80", "--modes", "fwd", "bwd", "--dtypes", "bf16", "e4m3", "--varlen", "off", "on",
              "--kvcache", "off", "on"]
    explicit = [str(d) for d in kk.HEADDIMS] + [f"{d}x{dv}" for d, dv in kk.HEADDIM_PAIRS]
    texts = []
    for name, hdims in (("default", []), ("explicit", ["--hdims", *explicit])):
        out = tmp_path / name
        subprocess.run([sys.executable, str(GENERATOR), "--out", str(out), *common, *hdims], check=True,
                       capture_output=True)
        texts.append({p.name: p.read_text() for p in out.iterdir()})
    assert texts[0] == texts[1]
    assert {"fwd_sm90_bf16_hdim96.cu", "fwd_sm90_bf16_hdim192v128.cu", "fwd_sm90_bf16_hdim128v64.cu"} <= set(texts[0])
