"""scripts/sass_wgmma_hazards.py on hand-written SASS (no GPU, no ptxas): a loop whose next iteration writes an
A-operand register of an HGMMA group still in flight is flagged, across the back edge; a DEPBAR that retires the
group clears it; accumulator reads while in flight are flagged."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import sass_wgmma_hazards as hz  # noqa: E402

LOOP = """
.L_x_1:
        /*0100*/                   LDS R40, [R2] ;
        /*0110*/                   HADD2.BF16_V2 R41, R40, R3 ;
        /*0120*/                   WARPGROUP.ARRIVE ;
        /*0130*/                   HGMMA.64x32x16.F32.BF16 R24, R40, gdesc[UR8], R24, gsb0 ;
        /*0140*/                   {DEPBAR}
        /*0150*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0160*/              @!P0 BRA `(.L_x_1) ;
"""


def _hazards(depbar):
  loops = hz.kernel_hazards(LOOP.replace("{DEPBAR}", depbar))
  assert len(loops) == 1 and (loops[0]["start"], loops[0]["end"]) == (0x100, 0x160)
  return loops[0]["hazards"]


def test_in_flight_a_registers_overwritten_across_the_back_edge():
  found = _hazards("WARPGROUP.DEPBAR.LE gsb0, 0x1 ;")          # the group stays in flight over the back edge
  assert [(h["walk"], h["address"], h["a_overwritten"]) for h in found] == [(1, 0x100, [40]), (1, 0x110, [41])]
  assert all(not h["acc_touched"] for h in found)


def test_retired_group_is_no_hazard():
  assert _hazards("WARPGROUP.DEPBAR.LE gsb0, 0x0 ;") == []


def test_accumulator_read_in_flight():
  text = LOOP.replace("{DEPBAR}", "FADD R6, R30, R7 ;")
  found = hz.kernel_hazards(text)[0]["hazards"]
  assert any(h["acc_touched"] == [30] and h["address"] == 0x140 for h in found)


NESTED = """
.L_x_0:
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0010*/                   LDS.128 R40, [R2] ;
        /*0020*/                   F2FP.F16.E4M3.UNPACK_B R41, R40.H1 ;
        /*0030*/                   HGMMA.64x16x16.F32 R24, R40, gdesc[UR8], R24, gsb0 ;
        /*0040*/                   QGMMA.64x16x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
        /*0060*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0070*/              @!P1 BRA `(.L_x_0) ;
.L_x_2:
        /*0080*/                   FADD R6, R6, R7 ;
        /*0090*/               @P2 BRA `(.L_x_2) ;
"""


def test_sass_report_finds_the_innermost_wgmma_loop():
  """scripts/sass_report.py: of the loops holding the most wgmmas (the inner one and the outer one around it) the
  smallest is the hot loop; a loop without a wgmma is not; opcodes lose their guard and suffixes."""
  import sass_report
  instructions, labels = hz.parse_sass(NESTED)
  lo, hi = sass_report.hot_loop(instructions, labels)
  assert (instructions[lo][0], instructions[hi][0]) == (0x10, 0x50)
  assert [sass_report.opcode(t) for _, t in instructions[lo:hi + 1]] == ["LDS", "F2FP", "HGMMA", "QGMMA", "BRA"]
  assert sass_report.hot_loop(*hz.parse_sass(NESTED.split(".L_x_2:")[0].replace("HGMMA", "HADD2")
                                             .replace("QGMMA", "HADD2"))) is None
