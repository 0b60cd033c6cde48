"""The SASS of a Mosaic GPU kernel's hot loop, counted by opcode, on a machine without a GPU.

ptxas_report.py compiles a case for a compile-only sm_90a device and Mosaic dumps its PTX; this script assembles
that PTX with ptxas, disassembles it with nvdisasm and counts the instructions of the kernel's hot loop: the
smallest loop (a backward branch and its target) that holds the most wgmmas (HGMMA / QGMMA). Its opcode histogram
is what a change to the loop's body costs in issue slots before any device time is spent (mla_decode NOTES: the
fp8 h16 page loop at ~1,230 warp instructions a page, and the cuts to it). `--split` cuts the loop at the given
addresses (hex, from a first run's --out listing) for a histogram per part.

Setup: sass_wgmma_hazards.py's (ptxas_report.py's venv and ptxas, plus nvdisasm), whose build and SASS parser this
uses. From the repository root:
    /tmp/cudavenv/bin/python scripts/sass_report.py --case '{"op": "mla", "kernel": "swapped", "fp8": true,
        "heads": 16}' [--out /tmp/swapped.sass] [--split 3e00 4850]
As with ptxas_report.py, read the counts as differences between variants: this ptxas may not be the GPU image's.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_wgmma_hazards import _BRANCH, _GUARD, parse_sass, sass_input  # noqa: E402  (a sibling script)

_MMA = ("HGMMA", "QGMMA")


def opcode(instruction: str) -> str:
  """'@!P1 HGMMA.64x16x16.F32 R24, ...' -> 'HGMMA'"""
  return _GUARD.sub("", instruction).split(" ", 1)[0].split(".")[0]


def hot_loop(instructions, labels) -> tuple[int, int] | None:
  """(first, last index) of the smallest loop (a backward branch and its target) holding the most wgmmas, or None
  where no loop holds one."""
  best = None
  for i, (_, text) in enumerate(instructions):
    m = _BRANCH.search(text)
    if not m or labels.get(m.group(1), len(instructions)) > i:
      continue
    lo = labels[m.group(1)]
    mma = sum(opcode(t) in _MMA for _, t in instructions[lo:i + 1])
    if mma and (best is None or (mma, lo - i) > (best[0], best[1] - best[2])):
      best = (mma, lo, i)
  return None if best is None else best[1:]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--case", help="one case as ptxas_report.py takes it (JSON)")
  ap.add_argument("--sass", help="an nvdisasm -c listing instead of a case")
  ap.add_argument("--split", nargs="*", default=[], help="hex addresses inside the loop to cut it at")
  ap.add_argument("--out", default=None, help="write the whole SASS listing here")
  args = ap.parse_args(argv)
  text = sass_input(ap, args)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)
  instructions, labels = parse_sass(text)
  print(f"{len(instructions)} instructions in {args.case or args.sass}")
  loop = hot_loop(instructions, labels)
  if loop is None:
    print("no loop holds a wgmma")
    return
  body = instructions[loop[0]:loop[1] + 1]
  cuts = sorted({body[0][0], *(int(c, 16) for c in args.split), body[-1][0] + 1})
  for lo, hi in zip(cuts, cuts[1:]):
    counts = collections.Counter(opcode(t) for a, t in body if lo <= a < hi)
    top = ", ".join(f"{op} {n}" for op, n in counts.most_common(14))
    print(f"{lo:#07x}-{hi - 1:#07x}: {sum(counts.values()):5d} instructions  {top}")


if __name__ == "__main__":
  main()
