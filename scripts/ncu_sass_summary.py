"""Where a kernel's warps stall, by SASS instruction: a short text summary of an Nsight Compute report's source page.

  ncu ... -o /tmp/k python scripts/ncu_mla.py --variant "fp8_e4m3 h128 seesaw"
  python scripts/ncu_sass_summary.py /tmp/k.ncu-rep --top 40 > bench/results/ncu_sass_<what>.txt

The source page (`ncu --import R --page source --csv --print-source sass`) has one row per SASS instruction with
its warp-stall samples; it is ~1.5 MB for an MLA kernel, too large to keep. This prints the instructions with the
most samples (with their neighbours' opcodes, to place them), the samples by opcode, and the column names the
report has, so a reader can tell a producer's global loads from a consumer's wgmma waits without the report.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import subprocess
import sys


def load_rows(report: str) -> tuple[list[str], list[dict]]:
  out = subprocess.run(["ncu", "--import", report, "--page", "source", "--csv", "--print-source", "sass"],
                       capture_output=True, text=True, check=True).stdout
  lines = out.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith('"Address"') or line.startswith('"#"'))
  reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
  return reader.fieldnames or [], list(reader)


def number(v: str) -> float:
  try:
    return float(v.replace(",", ""))
  except (AttributeError, ValueError):
    return 0.0


def opcode(source: str) -> str:
  """'@!P1 SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR16+0x38408], R0' -> 'SYNCS' (the guard skipped)."""
  words = [w for w in source.split() if not w.startswith("@")]
  return words[0].split(".")[0] if words else "?"


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("report")
  ap.add_argument("--top", type=int, default=40)
  args = ap.parse_args()
  fields, rows = load_rows(args.report)
  summarize(fields, rows, args.top)


def summarize(fields: list[str], rows: list[dict], top: int) -> None:
  """Prints the summary of a report's source page (fields and rows as load_rows returns them)."""
  samples = next((f for f in fields if f.startswith("Warp Stall Sampling (All")), None)
  if samples is None:
    sys.exit(f"no warp stall sampling column; columns: {fields}")
  total = sum(number(r[samples]) for r in rows) or 1.0
  print(f"{len(rows)} SASS instructions, {total:.0f} stall samples ({samples})")
  print("columns:", ", ".join(fields))
  by_op = collections.Counter()
  for r in rows:
    by_op[opcode(r["Source"])] += number(r[samples])
  print("\nsamples by opcode (share of all):")
  for op, n in by_op.most_common(25):
    print(f"  {op:<14} {100 * n / total:5.1f}%")
  reasons = [f for f in fields if f.startswith("stall_") or "Stall Reason" in f]
  print(f"\ntop {top} instructions by samples (index, share, SASS, previous opcode):")
  order = sorted(range(len(rows)), key=lambda i: -number(rows[i][samples]))[:top]
  for i in sorted(order):
    r = rows[i]
    prev = opcode(rows[i - 1]["Source"]) if i else ""
    extra = " ".join(f"{f}={r[f]}" for f in reasons if number(r[f]) > 0)
    print(f"  {i:6d} {100 * number(r[samples]) / total:5.2f}%  {r['Source'][:70]:<70} after {prev:<10} {extra}")
  # a wait's barrier is the operand of the try-wait before its branch: the previous instruction, whole
  waits = [i for i in sorted(order) if i and "PHASECHK" in rows[i - 1]["Source"]]
  if waits:
    print("\nbarrier waits among them (index: the try-wait before it):")
    for i in waits:
      print(f"  {i:6d}: {rows[i - 1]['Source'].strip()}")
  # shared-memory instructions: wavefronts against the ideal (bank conflicts), where the report has the columns
  have = [f for f in ("L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal", "L1 Wavefronts Shared Excessive")
          if f in fields]
  shared = [i for i, r in enumerate(rows) if opcode(r["Source"]) in ("STS", "LDS", "STSM", "LDSM")]
  if len(have) == 3 and shared:
    print("\nshared-memory instructions (index, SASS, wavefronts / ideal / excessive):")
    for i in shared:
      r = rows[i]
      if number(r[have[0]]):
        print(f"  {i:6d}  {r['Source'][:60]:<60} {r[have[0]]} / {r[have[1]]} / {r[have[2]]}")


if __name__ == "__main__":
  main()
