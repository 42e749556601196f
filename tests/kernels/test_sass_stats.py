"""``benchmarks/mgpu/sass_stats.py``: reading Mosaic GPU's ptxas reports and SASS dumps (from a
deviceless H200 compile) back into registers, spills, instruction mixes and
innermost loops. The dumps here are written by hand in nvdisasm's format."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "mgpu"))
import sass_stats as ss  # noqa: E402

PTXAS = """ptxas info    : Compiling entry function 'mix_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for mix_mosaic_gpu_kernel
    104 bytes stack frame, 196 bytes spill stores, 100 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 104 bytes cumulative stack size, 1 bytes smem
"""

# an outer loop (0x0010-0x00b0) around an inner one (0x0030-0x0070), and a second inner loop
SASS = """nvdisasm warning : Section '.text.mix', pc= 0x3230, Indirect branch address must go via symbolic table
.text.mix_mosaic_gpu_kernel:
   -:-:-:Y:01        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
   -:-:1:Y:01        /*0010*/                   S2R R145, SR_TID.X ;
   -:-:-:Y:01        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR8], R6 ;
.L_x_2:
   -:-:-:Y:01        /*0030*/                   LDS R164, [R4+UR13+0x7400] ;
   -:-:-:Y:01        /*0040*/                   PRMT R6, R8, 0x7632, R6 ;
   -:-:-:Y:01        /*0050*/                   FFMA R10, R6, R7, R10 ;
   -:-:-:Y:01        /*0060*/                   FFMA R11, R6, R7, R11 ;
   -:-:-:Y:05        /*0070*/              @P0 BRA `(.L_x_2) ;
   -:-:-:Y:05        /*0080*/              @!P1 BRA `(.L_x_3) ;
   -:-:-:Y:01        /*0090*/                   UIADD3 UR11, UR11, 0x3, URZ ;
.L_x_3:
   -:-:-:Y:01        /*00a0*/                   STL [R1], R10 ;
   -:-:-:Y:05        /*00b0*/              @P2 BRA `(.L_x_1) ;
.L_x_4:
   -:-:-:Y:01        /*00c0*/                   SYNCS.ARRIVE.TRANS64 RZ, [UR4] ;
   -:-:-:Y:05        /*00d0*/                   BRA `(.L_x_4) ;
   -:-:-:Y:01        /*00e0*/                   EXIT ;
"""


def test_parse_and_loops():
    instrs, labels = ss.parse_sass(SASS)
    assert [i.opcode for i in instrs][:3] == ["LDC", "S2R", "SYNCS"]
    assert instrs[2].text.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT P3")
    assert labels == {".L_x_1": 0x10, ".L_x_2": 0x30, ".L_x_3": 0xA0, ".L_x_4": 0xC0}
    loops = ss.innermost_loops(instrs, labels)
    assert [(lp.start, lp.end) for lp in loops] == [(0x30, 0x70), (0xC0, 0xD0)]  # the outer loop holds one
    inner = loops[0]
    assert [i.opcode for i in inner.instrs] == ["LDS", "PRMT", "FFMA", "FFMA", "BRA"]
    assert inner.kinds() == {"smem": 1, "convert": 1, "fp32": 2, "control": 1}


def test_read_dump_and_report(tmp_path):
    (tmp_path / "depth_attention_mix_mosaic_1.ptxas").write_text(PTXAS)
    (tmp_path / "depth_attention_mix_mosaic_1.sass_ctrl").write_text(SASS)
    (tmp_path / "other_2.ptxas").write_text("ptxas info    : Used 96 registers, used 1 barriers\n")  # no SASS
    kernels = ss.read_dump(tmp_path)
    assert [k.name for k in kernels] == ["depth_attention_mix_mosaic_1", "other_2"]
    mix, other = kernels
    assert (mix.registers, mix.spill_stores, mix.spill_loads, len(mix.instrs)) == (255, 196, 100, 15)
    assert (other.registers, other.spill_stores, other.instrs, other.loops) == (96, 0, [], [])
    text = ss.report(kernels)
    assert "depth_attention_mix_mosaic_1: 255 registers, spills 196 B stored / 100 B loaded; 15 SASS" in text
    assert "loop 0x00030-0x00070:     5 instructions  [fp32 2 convert 1 smem 1 control 1]  top: FFMA 2" in text
    assert "other_2: 96 registers; 0 SASS instructions" in text


def test_main_needs_one_source(tmp_path):
    with pytest.raises(SystemExit):
        ss.main([])
    with pytest.raises(SystemExit, match="no <kernel>.ptxas"):
        ss.main(["--dump", str(tmp_path)])


def test_compare_two_dumps(tmp_path, capsys):
    """``--against``: kernels paired by name without Mosaic GPU's running number, loops by size;
    a kernel only one side has is named, not dropped."""
    longer = SASS.replace("   -:-:-:Y:01        /*0040*/                   PRMT R6, R8, 0x7632, R6 ;\n",
                          "".join(f"   -:-:-:Y:01        /*{0x40 + k:04x}*/                   FFMA R9, R6, R7, R9 ;\n"
                                  for k in range(20)))
    assert longer != SASS
    for name, sass, ptxas in (("a", SASS, PTXAS), ("b", longer, PTXAS.replace("Used 255", "Used 240"))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "depth_attention_mix_mosaic_1.ptxas").write_text(ptxas)
        (tmp_path / name / "depth_attention_mix_mosaic_1.sass_ctrl").write_text(sass)
    (tmp_path / "b" / "extra_kernel_2.ptxas").write_text("ptxas info    : Used 96 registers\n")
    ss.main(["--dump", str(tmp_path / "a"), "--against", str(tmp_path / "b")])
    text = capsys.readouterr().out
    assert "depth_attention_mix_mosaic_1 -> depth_attention_mix_mosaic_1: 15 -> 34 instructions (+126.7%), " \
           "registers 255 -> 240, spills 196/100 -> 196/100 B" in text
    assert "    loop     5 ->    24 (+380.0%)  [fp32 2 convert 1 smem 1 control 1] -> [fp32 22 smem 1 control 1]" in text
    assert "loop     2 ->     2" not in text  # loops under 16 instructions on both sides are barrier spins
    assert "extra_kernel_2: not in the first compile" in text
