#!/usr/bin/env python3
"""Write the kernel configurations' (a KernelKey and a mode each) explicit instantiations, plus the registry that
lists them and the build's configuration. The configurations of one (arch, mode, dtype, head dims) share a translation
unit, up to MAX_UNITS_PER_TU: they differ only in mask, varlen, cache or score mod, so CuTe's layout and atom
templates, most of a unit's compile, are instantiated once for all of them (four d128 forward kernels: 53 s in one
unit, 186 s in four; docs/perf-notes.md, session 23).

Run by CMake at configure time into the build tree; nothing generated is committed. A file is
rewritten only when its text changes, so reconfiguring does not trigger rebuilds. The key is
python/flashhopper/kernel_key.py's KernelKey (loaded by path: the build has no torch), mirrored by
cpp/common/kernel_key.h.

    python cpp/generate_kernels.py --out build/gen --archs 90 80 --modes fwd bwd --dtypes bf16 fp16 \\
        --hdims 64 96 128 192 256 --masks none causal --variants no-pingpong --score-mods none softcap \\
        --dropout off on --varlen off on --kvcache off on
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from pathlib import Path
from typing import NamedTuple

CPP_DIR = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("kernel_key", CPP_DIR.parent / "python" / "flashhopper" / "kernel_key.py")
kk = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["kernel_key"] = kk  # dataclasses resolve the module of the class
_spec.loader.exec_module(kk)  # type: ignore[union-attr]

CPP_KVCACHES = {"off": "kOff", "on": "kOn", "e4m3": "kE4M3"}
CPP_DTYPES = {"float16": "kFloat16", "bfloat16": "kBFloat16", "float8_e4m3fn": "kFloat8E4M3"}
CPP_MASKS = {"none": "kNone", "causal": "kCausal", "window": "kWindow"}
CPP_SCORE_MODS = {"none": "kNone", "softcap": "kSoftcap"}


class Family(NamedTuple):
    """What one (arch, mode) family's translation units include and instantiate."""
    header: str  # the launcher, relative to cpp/
    launcher: str  # its template name; <launcher>'s tiles: <tiles>
    tiles: str
    workspace: str | None = None  # backward: the workspace-size function, instantiated alongside
    dtypes: tuple[str, ...] = ("fp16", "bf16")  # element types the family has kernels for
    score_mod_dtypes: tuple[str, ...] = ("fp16", "bf16")  # those with score mods (softcap) and dropout
    varlen: bool = False  # has packed-batch (varlen) kernels (of its dtypes: e4m3 too; dropout as the padded ones)
    kvcache: bool = False  # has KV-cache kernels (16-bit queries, any mask and score mod, no dropout, varlen hdims)


FAMILIES = {
    (90, "fwd"): Family("sm90/launch_fwd.h", "run_fwd_sm90", "fwd_tiles_sm90", dtypes=("fp16", "bf16", "e4m3"),
                        varlen=True, kvcache=True),
    (90, "bwd"): Family("sm90/launch_bwd.h", "run_bwd_sm90", "bwd_tiles_sm90", "bwd_workspace_bytes_sm90",
                        varlen=True),
    (80, "fwd"): Family("sm80/launch_fwd.h", "run_fwd_sm80", "fwd_tiles_sm80", varlen=True, kvcache=True),
    (80, "bwd"): Family("sm80/launch_bwd.h", "run_bwd_sm80", "bwd_tiles_sm80", "bwd_workspace_bytes_sm80",
                        varlen=True),
}


class Variant(NamedTuple):
    """A named ablation worth keeping (cpp/sm90/variants.h): its policy type and where it applies; it is
    built beside the production kernels of those families, dtypes and masks (the build's head dims)."""
    cpp: str
    families: tuple[tuple[int, str], ...]
    dtypes: tuple[str, ...]
    masks: tuple[str, ...]


VARIANTS = {
    # The FA3 paper's ablation of the forward's warpgroup ping-pong.
    "no-pingpong": Variant("sm90::variant::NoPingPong", ((90, "fwd"),), ("bf16",), ("none", "causal")),
}


def cpp_config(key: kk.KernelKey) -> str:
    args = [str(key.arch), f"DType::{CPP_DTYPES[key.dtype]}", str(key.headdim), str(key.headdim_v),
            f"MaskKind::{CPP_MASKS[key.mask]}", f"ScoreModKind::{CPP_SCORE_MODS[key.score_mod]}",
            "true" if key.dropout else "false", "true" if key.varlen else "false",
            f"KVCacheKind::{CPP_KVCACHES[key.kvcache]}"]
    if key.variant:
        args.append(VARIANTS[key.variant].cpp)
    return f"KernelConfig<{', '.join(args)}>"


class TranslationUnit:
    """The configurations that share one generated .cu (tu_name), each as its instantiation lines."""
    def __init__(self, header: str) -> None:
        self.header = header
        self.units: list[tuple[str, bool]] = []  # instantiation lines, whether extended_wgmma_shapes


def tu_name(mode: str, key: kk.KernelKey) -> str:
    """e.g. fwd_sm90_bf16_hdim128: the key's file name without mask, score mod, dropout, varlen, cache, variant."""
    base = kk.KernelKey(key.arch, key.dtype, key.headdim, key.headdim_v, "none")
    return base.file_name(mode)


def extended_wgmma_shapes(mode: str, key: kk.KernelKey) -> bool:
    """Whether the unit has a WGMMA whose N is not one of CuTe's standard 8, 16, 32, 64, 96, 128, 192, 256 (the tiles
    of cpp/sm90/tile_size.h), so that it needs CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED. That define's headers cost a
    unit ~30 s of its compile on a 2-core machine (docs/perf-notes.md, session 22), so it is set only here;
    sm90/gemm.h's ss_atom / rs_atom fail to compile a unit that needs it without it."""
    if key.arch != 90:
        return False
    if mode == "fwd":
        if key.kvcache == "e4m3":  # 64 or 128 keys
            return False
        if key.dtype == "float8_e4m3fn":  # head dim 64: 160 keys
            return key.headdim == 64
        if key.headdim == 96:  # 112 keys without a mask (tile_size.h: NoMaskKeys)
            return key.mask == "none"
        return key.headdim == key.headdim_v and key.headdim in (192, 256)  # 112 and 80 keys
    # Backward: head dim 96's dQ halves of 48 columns, 192's and 256's 48 and 40 keys per warpgroup (256 with dropout:
    # 32 keys).
    if key.dropout and (key.headdim, key.headdim_v) == (256, 256):
        return False
    return (key.headdim, key.headdim_v) not in ((64, 64), (128, 128), (128, 64))


# More per unit would lengthen the longest compile of a many-core build (its critical path) for little more saving.
MAX_UNITS_PER_TU = 8


def write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--archs", type=int, nargs="*", default=list(kk.ARCHS))
    ap.add_argument("--modes", nargs="*", choices=kk.MODES, default=list(kk.MODES))
    ap.add_argument("--dtypes", nargs="*", choices=list(kk.BUILD_DTYPES), default=list(kk.BUILD_DTYPES))
    # argparse runs `type` over given values only, not a list default: parse the default's spellings here.
    hdims = [str(d) for d in kk.HEADDIMS] + [f"{d}x{dv}" for d, dv in kk.HEADDIM_PAIRS]
    ap.add_argument("--hdims", type=kk.parse_headdim, nargs="*", default=[kk.parse_headdim(t) for t in hdims],
                    help=f'head dims (default: all): {" ".join(hdims)}; (Q/K, V) pairs are spelled "192x128"')
    ap.add_argument("--masks", nargs="*", choices=kk.MASKS, default=["none", "causal"])
    ap.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=[])
    ap.add_argument("--score-mods", nargs="*", choices=kk.SCORE_MODS, default=["none"])
    ap.add_argument("--dropout", nargs="*", choices=kk.DROPOUTS, default=["off"],
                    help="off: kernels without dropout; on: with it (16-bit, beside each configuration)")
    ap.add_argument("--varlen", nargs="*", choices=kk.VARLENS, default=["off"],
                    help="off: padded-batch kernels; on: packed-batch (varlen) ones too, for the families that "
                         "have them (16-bit, without dropout), beside each configuration")
    ap.add_argument("--kvcache", nargs="*", choices=kk.KVCACHES, default=["off"],
                    help="off: no KV-cache kernels; on: the forward's KV-cache kernels (flash_attn_with_kvcache: "
                         "16-bit, head dims %s); e4m3: Hopper ones reading an e4m3 cache with 16-bit queries; "
                         "beside each configuration" % "/".join(map(str, kk.VARLEN_HEADDIMS)))
    args = ap.parse_args()
    families = []
    for a in args.archs:
        if a not in kk.ARCHS:
            ap.error(f"unknown arch {a}; known: {list(kk.ARCHS)}")
        for m in args.modes:
            fam = FAMILIES.get((a, m))
            if fam is None or not (CPP_DIR / fam.header).exists():
                ap.error(f"the sm{a} {m} kernel family is not implemented yet; build without it "
                         "(FLASHHOPPER_ARCHS / FLASHHOPPER_MODES)")
            families.append((a, m, fam))

    args.out.mkdir(parents=True, exist_ok=True)
    entries: dict[str, list[str]] = {m: [] for m in kk.MODES}
    aliases: list[str] = []  # the registry's name for each configuration
    sources = []
    groups: dict[str, TranslationUnit] = {}  # by tu_name, in order of first unit
    for (arch, mode, fam), dtype, (hdim, hdim_v), mask, score_mod, dropout, varlen, kvcache, variant in itertools.product(
            families, args.dtypes, args.hdims, args.masks, args.score_mods, args.dropout, args.varlen, args.kvcache,
            [""] + args.variants):
        key = kk.KernelKey(arch, kk.BUILD_DTYPES[dtype], hdim, hdim_v, mask, variant, score_mod, dropout == "on",
                           varlen == "on", kvcache)
        if kk.never_built(key):  # head dims, dtypes and features no family instantiates (kernel_key.py)
            continue
        if dtype not in fam.dtypes:  # e.g. e4m3: forward only
            continue
        if (score_mod != "none" or dropout == "on") and (dtype not in fam.score_mod_dtypes or variant):
            continue
        if (varlen == "on" and not fam.varlen) or (kvcache != "off" and not fam.kvcache):
            continue
        if variant and ((arch, mode) not in VARIANTS[variant].families or dtype not in VARIANTS[variant].dtypes
                        or mask not in VARIANTS[variant].masks):
            continue
        config = cpp_config(key)
        params = "FwdParams" if mode == "fwd" else "BwdParams"
        tu = groups.setdefault(tu_name(mode, key), TranslationUnit(fam.header))
        unit = len(tu.units)  # numbered within its unit: another head dim does not change (and rebuild) this one
        lines = [f"// {key.file_name(mode)}",
                 f"using Config{unit} = {config};",
                 f"template int64_t {fam.launcher}<Config{unit}>({params} const&, cudaStream_t);",
                 f"template TileInfo {fam.tiles}<Config{unit}>();"]
        if fam.workspace:
            lines.append(f"template size_t {fam.workspace}<Config{unit}>({params} const&);")
        tu.units.append(("\n".join(lines), extended_wgmma_shapes(mode, key)))
        alias = f"K{len(aliases)}"
        aliases.append(f"using {alias} = {config};  // {mode}")
        extra = f"&{fam.workspace}<{alias}>, " if fam.workspace else ""
        entries[mode].append(f"      {{{alias}::key(), &{fam.launcher}<{alias}>, {extra}{fam.tiles}<{alias}>()}},")

    for name, tu in groups.items():
        chunks = [tu.units[i:i + MAX_UNITS_PER_TU] for i in range(0, len(tu.units), MAX_UNITS_PER_TU)]
        for i, chunk in enumerate(chunks):
            src = args.out / (f"{name}.cu" if len(chunks) == 1 else f"{name}_part{i}.cu")
            # The define must precede every CuTe header; SASS of standard-shape tiles is the same with it.
            extended = "#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED\n" if any(e for _, e in chunk) else ""
            write_if_changed(src, (
                "// Generated by cpp/generate_kernels.py; do not edit.\n"
                f'{extended}#include "{tu.header}"\n\n'
                "namespace flashhopper {\n" + "\n\n".join(lines for lines, _ in chunk) + "\n}  // namespace flashhopper\n"))
            sources.append(src.name)

    def table(mode: str, kind: str) -> str:
        rows = entries[mode]
        return (f"std::vector<{kind}> const& {mode}_kernels() {{\n"
                f"  static std::vector<{kind}> const kernels = {{\n"
                + "\n".join(rows) + ("\n" if rows else "") + "  };\n  return kernels;\n}\n")

    def strings(xs: list[str]) -> str:
        return "{" + ", ".join(f'"{x}"' for x in xs) + "}"

    build_config = (
        "BuildConfig const& build_config() {\n"
        "  static BuildConfig const config{"
        f"{{{', '.join(map(str, args.archs))}}}, {strings(args.modes)}, {strings(args.dtypes)}, "
        f"{strings(args.masks)}, {strings(args.variants)}, {strings(args.score_mods)}, {strings(args.dropout)}, "
        f"{strings(args.varlen)}, {strings(args.kvcache)}, "
        f"{{{', '.join(str(d) for d, dv in args.hdims if d == dv)}}}, "
        f"{{{', '.join(f'{{{d}, {dv}}}' for d, dv in args.hdims if d != dv)}}}}};\n"
        "  return config;\n}\n")
    registry = (
        "// Generated by cpp/generate_kernels.py; do not edit.\n"
        '#include "registry.h"\n'
        + ('#include "sm90/variants.h"\n' if args.variants else "") + "\n"
        "namespace flashhopper {\n\n"
        # Launcher and tile functions are declared in registry.h and instantiated by the units above.
        + "".join(f"{a}\n" for a in aliases) + "\n"
        + table("fwd", "FwdEntry") + "\n" + table("bwd", "BwdEntry") + "\n" + build_config
        + "\n}  // namespace flashhopper\n")
    write_if_changed(args.out / "registry.cpp", registry)
    # The list CMake reads back: one source per line; CMake picks each one's flags from its name.
    write_if_changed(args.out / "sources.txt", "".join(f"{s}\n" for s in sources))


if __name__ == "__main__":
    main()
