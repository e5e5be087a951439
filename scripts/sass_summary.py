#!/usr/bin/env python3
"""Count the instructions that prove each kernel uses the Hopper mechanisms.

    cuobjdump --dump-sass _C.so > sass.txt && python scripts/sass_summary.py sass.txt
HGMMA/QGMMA: WGMMA; UTMALDG/UTMASTG/UTMAREDG: TMA load/store/reduce-add; UBLKCP: bulk copy;
SYNCS: mbarrier ops; USETMAXREG: setmaxnreg; HMMA: mma.sync (sm80 path); LDGSTS: cp.async;
ATOMG: global atomics; LDL/STL: local memory (spills).
"""
import re
import sys
from collections import Counter

OPS = ["HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "UTMAREDG", "UBLKCP", "UBLKRED", "SYNCS", "USETMAXREG", "HMMA", "LDGSTS", "LDSM",
       "STSM", "MUFU.EX2", "BAR.SYNC", "BAR.ARV", "ATOMG", "LDL", "STL"]


def main(path: str) -> None:
    text = open(path).read()
    # cuobjdump prints "Function : <mangled>" before each kernel's code.
    parts = re.split(r"\n\s*Function : (\S+)\n", text)
    rows = []
    for name, body in zip(parts[1::2], parts[2::2]):
        c = Counter()
        for op in OPS:
            c[op] = len(re.findall(r"\b" + re.escape(op) + r"\b", body))
        rows.append((short(name), c))
    width = max((len(n) for n, _ in rows), default=10)
    print(f"{'kernel':<{width}} " + " ".join(f"{op:>10}" for op in OPS))
    for n, c in rows:
        print(f"{n:<{width}} " + " ".join(f"{c[op]:>10}" for op in OPS))


def short(mangled: str) -> str:
    # ...FwdMainloopIN7cutlass10bfloat16_tELi128ENS0_11FwdTileSizeILi128ELb1E...EELb1EEE... (Bwd likewise);
    # the tile size's first bool is the causal flag.
    m = re.search(r"(Fwd|Bwd)MainloopIN7cutlass\d+(\w+?)ELi(\d+)E.*?(?:Fwd|Bwd)TileSizeILi\d+ELb([01])", mangled)
    if m:
        dt = "bf16" if "bfloat16" in m.group(2) else ("e4m3" if "e4m3" in m.group(2) else "fp16")
        return f"sm90_{m.group(1).lower()}_{dt}_d{m.group(3)}{'_causal' if m.group(4) == '1' else ''}"
    if "quantize_fp8_kernel" in mangled:
        hd = re.search(r"Li(\d+)ELb([01])", mangled)
        dt = "bf16" if "bfloat16" in mangled else "fp16"
        return f"quantize_fp8_{dt}" + (f"_d{hd.group(1)}{'_vt' if hd.group(2) == '1' else ''}" if hd else "")
    for kind in ("bwd_preprocess_kernel", "convert_accum_kernel"):
        if kind in mangled:
            dt = "bf16" if "bfloat16" in mangled else "fp16"
            hd = re.search(r"ELi(\d+)E", mangled)
            return f"{kind}_{dt}" + (f"_d{hd.group(1)}" if hd else "")
    return mangled[:80]


if __name__ == "__main__":
    main(sys.argv[1])
