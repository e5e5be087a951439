#!/usr/bin/env python3
"""Count the instructions that prove each kernel uses the Hopper mechanisms, or list ptxas's registers
and spills per kernel, under readable kernel names.

    cuobjdump --dump-sass _C.so > sass.txt && python scripts/sass_summary.py sass.txt
    python scripts/sass_summary.py --ptxas build.log     # a build with -Xptxas=-v (FLASHHOPPER_PTXAS_VERBOSE)
HGMMA/QGMMA: WGMMA; UTMALDG/UTMASTG/UTMAREDG: TMA load/store/reduce-add; UBLKCP/UBLKRED: bulk copy /
reduce-add; SYNCS: mbarrier ops; USETMAXREG: setmaxnreg; HMMA: mma.sync (sm80 path); LDGSTS: cp.async;
ATOMG: global atomics; LDL/STL: local memory (spills).

Names: the attention kernels by their feature key, e.g. sm90_fwd_bf16_d128_causal,
sm90_bwd_bf16_d128_det (deterministic), sm80_fwd_bf16_d128_smem99 (the sm80 shared-memory class),
sm90_fwd_bf16_d128_v-no-pingpong (a named variant); other kernels as their demangled template, without
namespaces. Needs c++filt (binutils) or the CUDA toolkit's cu++filt; without either, names stay mangled.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter
from functools import cache
from pathlib import Path

CPP = Path(__file__).resolve().parents[1] / "cpp"
OPS = ["HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "UTMAREDG", "UBLKCP", "UBLKRED", "SYNCS", "USETMAXREG", "HMMA", "LDGSTS",
       "LDSM", "STSM", "MUFU.EX2", "BAR.SYNC", "BAR.ARV", "ATOMG", "LDL", "STL"]
# Element types as they appear in the kernels' template arguments (cutlass's and CUDA's).
DTYPES = {"bfloat16_t": "bf16", "__nv_bfloat16": "bf16", "half_t": "fp16", "__half": "fp16", "float_e4m3_t": "e4m3"}


def demangle(names: list[str]) -> list[str]:
    """The demangled names, in one call of c++filt (or cu++filt); the names unchanged without one."""
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if tool is None or not names:
        if names:
            print("sass_summary: no c++filt or cu++filt on PATH: kernel names stay mangled", file=sys.stderr)
        return names
    out = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True, check=True).stdout
    return out.splitlines()


@cache
def mask_names() -> dict[str, str]:
    """MaskKind's value -> its name, from cpp/common/kernel_key.h (kCausal = 1 -> "1": "causal")."""
    text = (CPP / "common" / "kernel_key.h").read_text()
    body = re.search(r"enum class MaskKind[^{]*\{([^}]*)\}", text)
    return {v: k.lower() for k, v in re.findall(r"k(\w+)\s*=\s*(\d+)", body.group(1) if body else "")}


@cache
def variant_names() -> dict[str, str]:
    """A variant's policy type -> its name, from cpp/*/variants.h (NoPingPong -> "no-pingpong")."""
    out: dict[str, str] = {}
    for header in CPP.glob("*/variants.h"):
        out.update(re.findall(r"struct (\w+)\s*\{\s*static constexpr char const\* kName = \"([^\"]*)\"",
                              header.read_text()))
    return out


def template_args(s: str, open_at: int) -> tuple[list[str], int]:
    """The top-level arguments of the template whose '<' is at ``open_at``, and the index after its '>'."""
    args, depth, start = [], 0, open_at + 1
    for i in range(open_at, len(s)):
        c = s[i]
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
            if depth == 0:
                args.append(s[start:i].strip())
                return args, i + 1
        elif c == "," and depth == 1:
            args.append(s[start:i].strip())
            start = i + 1
    raise ValueError(f"unbalanced template arguments in {s[:80]!r}")


def _mask(arg: str) -> str:
    m = re.fullmatch(r"\((?:\w+::)*MaskKind\)(\d+)", arg)
    return mask_names().get(m.group(1), f"mask{m.group(1)}") if m else arg


def _attention_name(arch: str, kind: str, mainloop: list[str]) -> str:
    """(sm90|sm80)_<kind>_<dtype>_d<headdim>[_<mask>][_det][_smem<KB>][_v-<variant>] of a kernel whose
    template holds a (Fwd|Bwd)Mainloop<Element, headdim, Tile, MaskKind, ...>."""
    dtype = DTYPES.get(mainloop[0].rsplit("::", 1)[-1], mainloop[0])
    name = f"{arch}_{kind}_{dtype}_d{mainloop[1]}"
    mask = _mask(mainloop[3])
    name += "" if mask == "none" else f"_{mask}"
    if len(mainloop) > 4 and mainloop[4] == "true":  # the sm90 backward's kDeterministic
        name += "_det"
    tile = mainloop[2]
    smem = re.search(r"TileSize<\d+, (?:true|false), (\d+)>", tile)  # sm80: the shared-memory class (KB)
    if smem:
        name += f"_smem{smem.group(1)}"
    variant = re.search(r"variant::(\w+)::", tile)
    if variant:
        name += f"_v-{variant_names().get(variant.group(1), variant.group(1))}"
    return name


def short(demangled: str) -> str:
    """A readable name for a demangled kernel name (see the module's docstring)."""
    s = demangled.removeprefix("void ")
    open_at = s.find("<")
    if open_at < 0:
        return s.split("(", 1)[0].rsplit("::", 1)[-1]
    path = s[:open_at].split("::")
    kind = path[-1].removesuffix("_kernel")
    arch = next((p for p in path if re.fullmatch(r"sm\d+", p)), None)
    found = re.search(r"(?:Fwd|Bwd)Mainloop<", s)
    if arch is not None and found is not None:
        return _attention_name(arch, kind, template_args(s, found.end() - 1)[0])
    args, end = template_args(s, open_at)
    text = f"{kind}<{', '.join(args)}>"
    text = re.sub(r"\b\w+::", "", text)  # namespaces
    text = re.sub(r"\(MaskKind\)(\d+)", lambda m: mask_names().get(m.group(1), m.group(0)), text)
    return re.sub(r"\b(" + "|".join(DTYPES) + r")\b", lambda m: DTYPES[m.group(1)], text)


def short_names(mangled: list[str]) -> list[str]:
    return [short(d) if d != m else m[:100] for m, d in zip(mangled, demangle(mangled))]


def sass_table(path: Path) -> None:
    # cuobjdump prints "Function : <mangled>" before each kernel's code.
    parts = re.split(r"\n\s*Function : (\S+)\n", path.read_text())
    names = short_names(parts[1::2])
    rows = []
    for name, body in zip(names, parts[2::2]):
        rows.append((name, Counter({op: len(re.findall(r"\b" + re.escape(op) + r"\b", body)) for op in OPS})))
    width = max((len(n) for n, _ in rows), default=10)
    print(f"{'kernel':<{width}} " + " ".join(f"{op:>10}" for op in OPS))
    for n, c in rows:
        print(f"{n:<{width}} " + " ".join(f"{c[op]:>10}" for op in OPS))


def ptxas_table(path: Path) -> None:
    """Registers and spill bytes per kernel and target from ptxas -v output."""
    rows: list[list[str]] = []  # mangled, target, registers, spill stores, spill loads
    for line in path.read_text(errors="replace").splitlines():
        entry = re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line)
        if entry:
            rows.append([entry.group(1), entry.group(2), "?", "?", "?"])
        elif rows and (spill := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            rows[-1][3:5] = spill.groups()
        elif rows and (regs := re.search(r"Used (\d+) registers", line)):
            rows[-1][2] = regs.group(1)
    names = short_names([r[0] for r in rows])
    width = max((len(n) for n in names), default=10)
    print(f"{'kernel':<{width}} {'target':>8} {'registers':>9} {'spill st':>8} {'spill ld':>8}")
    for n, (_, target, count, st, ld) in zip(names, rows):
        print(f"{n:<{width}} {target:>8} {count:>9} {st:>8} {ld:>8}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path, help="cuobjdump --dump-sass output (or, with --ptxas, a build log)")
    ap.add_argument("--ptxas", action="store_true", help="the file is a build log with ptxas -v lines")
    args = ap.parse_args(argv)
    (ptxas_table if args.ptxas else sass_table)(args.file)


if __name__ == "__main__":
    main()
