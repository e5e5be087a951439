"""cpp/generate_kernels.py: which generated units turn on CuTe's extended WGMMA shapes (~30 s of every unit's compile),
and that the define comes before any header. sm90/gemm.h's ss_atom / rs_atom fail the compile of a unit that needs
them without it; these tests pin the other direction, units that would carry the cost for nothing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

GENERATOR = Path(__file__).resolve().parents[1] / "cpp" / "generate_kernels.py"
DEFINE = "#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"


@pytest.fixture(scope="module")
def units(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("gen")
    subprocess.run([sys.executable, str(GENERATOR), "--out", str(out), "--archs", "90", "80", "--modes", "fwd", "bwd",
                    "--dtypes", "bf16", "fp16", "e4m3", "--hdims", "64", "96", "128", "192", "256", "192x128", "128x64",
                    "--masks", "none", "causal", "window", "--variants", "no-pingpong", "--score-mods", "none",
                    "softcap", "--dropout", "off", "on", "--varlen", "off", "on", "--kvcache", "off", "on", "e4m3"],
                   check=True, capture_output=True)
    names = (out / "sources.txt").read_text().split()
    return {n.removesuffix(".cu"): (out / n).read_text() for n in names}


def extended(units: dict[str, str], name: str) -> bool:
    return DEFINE in units[name]


def test_define_precedes_every_include(units: dict[str, str]) -> None:
    for name, text in units.items():
        if DEFINE in text:
            assert text.index(DEFINE) < text.index("#include"), name


def test_ampere_units_never_extended(units: dict[str, str]) -> None:
    sm80 = [n for n in units if "_sm80_" in n]
    assert sm80 and not any(extended(units, n) for n in sm80)


@pytest.mark.parametrize("name", [
    "fwd_sm90_bf16_hdim64", "fwd_sm90_fp16_hdim128_causal", "fwd_sm90_bf16_hdim128_varlen",
    "fwd_sm90_bf16_hdim128_causal_kvcache", "fwd_sm90_bf16_hdim96", "fwd_sm90_bf16_hdim192v128",
    "fwd_sm90_bf16_hdim128v64", "fwd_sm90_e4m3_hdim128_causal", "fwd_sm90_e4m3_hdim256",
    "fwd_sm90_bf16_hdim256_kvcache-e4m3", "bwd_sm90_bf16_hdim64_causal", "bwd_sm90_bf16_hdim128",
    "bwd_sm90_fp16_hdim128v64_causal", "bwd_sm90_bf16_hdim256_causal_dropout",
])
def test_standard_shapes_only(units: dict[str, str], name: str) -> None:
    assert not extended(units, name)


@pytest.mark.parametrize("name", [
    "fwd_sm90_bf16_hdim256", "fwd_sm90_fp16_hdim256_causal_kvcache", "fwd_sm90_bf16_hdim192_causal",
    "fwd_sm90_e4m3_hdim64_causal", "fwd_sm90_e4m3_hdim64_varlen", "bwd_sm90_bf16_hdim96",
    "bwd_sm90_bf16_hdim192v128_causal", "bwd_sm90_fp16_hdim256_varlen",
])
def test_extended_where_a_tile_needs_it(units: dict[str, str], name: str) -> None:
    assert extended(units, name)
