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


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("report")
  ap.add_argument("--top", type=int, default=40)
  args = ap.parse_args()
  fields, rows = load_rows(args.report)
  samples = next((f for f in fields if f.startswith("Warp Stall Sampling (All")), None)
  if samples is None:
    sys.exit(f"no warp stall sampling column; columns: {fields}")
  total = sum(number(r[samples]) for r in rows) or 1.0
  print(f"{len(rows)} SASS instructions, {total:.0f} stall samples ({samples})")
  print("columns:", ", ".join(fields))
  by_op = collections.Counter()
  for r in rows:
    by_op[r["Source"].split()[0].split(".")[0] if r["Source"].split() else "?"] += number(r[samples])
  print("\nsamples by opcode (share of all):")
  for op, n in by_op.most_common(25):
    print(f"  {op:<14} {100 * n / total:5.1f}%")
  reasons = [f for f in fields if f.startswith("stall_") or "Stall Reason" in f]
  print(f"\ntop {args.top} instructions by samples (index, share, SASS, previous opcode):")
  order = sorted(range(len(rows)), key=lambda i: -number(rows[i][samples]))[:args.top]
  for i in sorted(order):
    r = rows[i]
    prev = rows[i - 1]["Source"].split()[0] if i else ""
    extra = " ".join(f"{f}={r[f]}" for f in reasons if number(r[f]) > 0)
    print(f"  {i:6d} {100 * number(r[samples]) / total:5.2f}%  {r['Source'][:70]:<70} after {prev:<10} {extra}")


if __name__ == "__main__":
  main()
