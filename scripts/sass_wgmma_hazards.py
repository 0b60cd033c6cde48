"""Which instructions of a Mosaic GPU kernel's loops touch the registers of a wgmma still in flight, from its SASS,
on a machine without a GPU.

PTX leaves it undefined to write a wgmma's A-operand registers, or to read or write its accumulator, before
wgmma.wait_group has retired it. The W4A16 kernel's consumers decode chunk i + 1 into registers while chunk i's
wgmmas run (the "overlap"); this scan shows, for each loop of the compiled kernel, every instruction that writes an
A register of an HGMMA group not yet retired by a WARPGROUP.DEPBAR (walking the loop body twice, so hazards across
the back edge show), and every instruction that touches the accumulator meanwhile. It reads the SASS only: what the
hardware does with such a write (w4a16 NOTES.md, open question 7) is for a GPU run to show.

Needs what scripts/ptxas_report.py needs (the compile-only CUDA venv, ptxas) plus nvdisasm (pip install
nvidia-cuda-nvdisasm into that venv). From the repository root:
    /tmp/cudavenv/bin/python scripts/sass_wgmma_hazards.py --case '{"op": "dense", "k": 7168, "n": 18432, "m": 32,
        "group": 128, "config": {}}'
    /tmp/cudavenv/bin/python scripts/sass_wgmma_hazards.py --sass kernel.sass      # an nvdisasm -c listing
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
_GUARD = re.compile(r"^@!?U?P\w+\s+")
_NO_REGISTER_DEST = ("ST", "BRA", "SYNCS", "BAR", "WARPGROUP", "RED", "ATOM", "UTMA", "FENCE", "MEMBAR", "EXIT",
                     "NOP", "HGMMA")


def parse_sass(text: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
  """nvdisasm -c text -> ([(address, instruction)], {label: index of the instruction it names})."""
  instructions, labels = [], {}
  for line in text.splitlines():
    if (m := _LABEL.match(line)):
      labels[m.group(1)] = len(instructions)
    elif (m := _INSTRUCTION.search(line)):
      instructions.append((int(m.group(1), 16), m.group(2)))
  return instructions, labels


def _registers(token: str, count: int) -> set[int]:
  m = re.match(r"R(\d+)$", token)
  return set(range(int(m.group(1)), int(m.group(1)) + count)) if m else set()


def loop_hazards(body: list[tuple[int, str]]) -> list[dict]:
  """The hazards of one loop body (instructions in order, the last one its back edge): walked twice, so the wgmma
  groups left in flight at the back edge meet the next iteration's first instructions."""
  found, groups, open_group = [], [], set()
  for walk in range(2):
    for address, text in body:
      text = _GUARD.sub("", text)
      op, _, rest = text.partition(" ")
      operands = [x.strip() for x in rest.split(",")]
      if op.startswith("HGMMA"):
        n = int(re.match(r"HGMMA\.64x(\d+)x", op).group(1))
        acc = _registers(operands[0], n // 2)               # m64nN f32: N / 2 registers a thread
        open_group = open_group | {("a", r) for r in _registers(operands[1], 4)} | {("acc", r) for r in acc}
        if "gsb0" in text:
          groups.append(open_group)
          open_group = set()
        continue
      if op.startswith("WARPGROUP.DEPBAR"):
        keep = int(operands[-1], 16)
        groups = groups[-keep:] if keep else []
        continue
      in_flight = set().union(open_group, *groups)
      if not in_flight:
        continue
      used = {int(r) for r in re.findall(r"\bR(\d+)\b", rest)}
      dest = set()
      if not op.startswith(_NO_REGISTER_DEST) and operands and operands[0].startswith("R"):
        dest = _registers(operands[0], 4 if ".128" in op else 2 if ".64" in op else 1)
      a_hit = sorted(r for kind, r in in_flight if kind == "a" and r in dest)
      acc_hit = sorted(r for kind, r in in_flight if kind == "acc" and r in used)
      if a_hit or acc_hit:
        found.append(dict(walk=walk, address=address, instruction=text, a_overwritten=a_hit, acc_touched=acc_hit))
  return found


def kernel_hazards(text: str) -> list[dict]:
  """Every loop (a backward branch) with an HGMMA in it: its address range and its hazards."""
  instructions, labels = parse_sass(text)
  out = []
  for i, (_, t) in enumerate(instructions):
    m = _BRANCH.search(t)
    if not m or labels.get(m.group(1), len(instructions)) > i:
      continue
    body = instructions[labels[m.group(1)]:i + 1]
    if any(x.startswith("HGMMA") or " HGMMA" in x for _, x in body):
      out.append(dict(start=body[0][0], end=body[-1][0], hazards=loop_hazards(body)))
  return out


def compile_sass(case: dict, workdir: str) -> str:
  """SASS of the case's kernel: ptxas_report's compile-only build with the PTX dumped, then ptxas and nvdisasm."""
  import ptxas_report                  # this folder's: the compile-only build (not needed by the SASS parser)
  run = ptxas_report.compile_in_subprocess(case, MOSAIC_GPU_DUMP_TO=workdir)
  if run.returncode:
    raise RuntimeError(f"{case} did not compile: {ptxas_report.error_line(run)}")
  ptx = sorted(glob.glob(os.path.join(workdir, "*.ptx")))
  if not ptx:
    raise RuntimeError(f"no PTX was dumped for {case}")
  nvdisasm = shutil.which("nvdisasm") or next(iter(glob.glob(os.path.join(
      sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu*", "bin", "nvdisasm"))), None)
  if nvdisasm is None:
    raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm into this venv")
  cubin = ptx[-1][:-4] + ".cubin"
  subprocess.run(["ptxas", "-arch=sm_90a", "-O3", ptx[-1], "-o", cubin], capture_output=True, check=True)
  return subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout


def sass_input(ap: argparse.ArgumentParser, args) -> str:
  """The SASS text of `--case` (compiled here) or `--sass` (a listing), exactly one of them."""
  if bool(args.case) == bool(args.sass):
    ap.error("give exactly one of --case and --sass")
  if args.sass:
    with open(args.sass) as f:
      return f.read()
  with tempfile.TemporaryDirectory() as workdir:
    return compile_sass(json.loads(args.case), workdir)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--case", help="one case as ptxas_report.py takes it (JSON)")
  ap.add_argument("--sass", help="an nvdisasm -c listing instead of a case")
  ap.add_argument("--show", type=int, default=6, help="hazards printed per loop")
  args = ap.parse_args(argv)
  text = sass_input(ap, args)
  loops = kernel_hazards(text)
  for loop in loops:
    hz = loop["hazards"]
    a = sum(bool(h["a_overwritten"]) for h in hz)
    acc = sum(bool(h["acc_touched"]) for h in hz)
    print(f"loop {loop['start']:#x}-{loop['end']:#x}: {a} writes to in-flight A registers, {acc} touches of an "
          f"in-flight accumulator")
    for h in hz[:args.show]:
      print(f"  walk {h['walk']} {h['address']:#x} {h['instruction'][:60]:60s} A {h['a_overwritten']} "
            f"acc {h['acc_touched']}")
  if not loops:
    print("no loop with an HGMMA in it")


if __name__ == "__main__":
  main()
