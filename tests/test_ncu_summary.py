"""scripts/ncu_sass_summary.py on a synthetic source page (no Nsight Compute here): opcodes past their guards, the
barrier of each top wait named by the try-wait before it, shared-memory wavefronts printed where the report has them."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import ncu_sass_summary as summary  # noqa: E402  (a script, not a package)

SAMPLES = "Warp Stall Sampling (All Samples)"
FIELDS = ["Address", "Source", SAMPLES, "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal",
          "L1 Wavefronts Shared Excessive", "stall_long_sb"]


def row(source, samples, wavefronts=("0", "0", "0"), long_sb="0"):
  return dict(zip(FIELDS, ["0x0", source, samples, *wavefronts, long_sb]))


def test_opcode_skips_the_guard():
  assert summary.opcode("@!P1 BRA 0x7f00") == "BRA"
  assert summary.opcode("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR16+0x38408], R0") == "SYNCS"
  assert summary.opcode("@UP3 UTMALDG.4D [UR24], [UR32]") == "UTMALDG"
  assert summary.opcode("   ") == "?"


def test_summary_names_waits_and_bank_conflicts(capsys):
  rows = [row("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR16+0x38408], R0", "10"),
          row("@!P1 BRA 0x7f00", "900", long_sb="900"),
          row("STS.128 [R2+UR5+0x9400], R4", "40", ("16", "4", "12")),
          row("HMUL2 R45, R98.H0_H0, R99", "50")]
  summary.summarize(FIELDS, rows, top=3)
  out = capsys.readouterr().out
  assert "4 SASS instructions, 1000 stall samples" in out
  assert "  BRA             90.0%" in out and "@!P1" not in out.split("top 3")[0]
  assert "1: SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR16+0x38408], R0" in out      # the wait's barrier
  assert "STS.128 [R2+UR5+0x9400], R4" in out.split("shared-memory instructions")[1]
  assert "16 / 4 / 12" in out
