"""scripts/ncu_hot_lines.py on a synthetic ncu source-page export: per kernel, the lines with most
warp-stall samples first, with their shares and largest stall reasons, then its samples by stall
reason and by opcode."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import ncu_hot_lines  # noqa: E402


def _export(tmp_path, samples_a, samples_b):
    head = '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",' \
           '"stall_long_sb","stall_barrier"\n'
    lines = ['"kernel_a"\n', head]
    lines += [f'"{i:04x}","FFMA R{i}, R1, R2","{s}","{s // 2}","{s // 3}","{s - s // 3}"\n'
              for i, s in enumerate(samples_a)]
    lines += ['"kernel_b"\n', head]
    lines += [f'"{i:04x}","HGMMA.64x128x32 R{i}","{s:,}","0","0","{s}"\n' for i, s in enumerate(samples_b)]
    path = tmp_path / "source.csv"
    path.write_text("".join(lines))
    return path


def test_hottest_lines_per_kernel_with_shares_and_reasons(tmp_path, capsys):
    path = _export(tmp_path, [5, 90, 5], [1000, 3000])
    assert ncu_hot_lines.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "== kernel_a: 3 SASS lines, 100 samples"
    assert out[1].split()[:2] == ["90.0%", "0001"] and "stall_barrier 60" in out[1] and "stall_long_sb 30" in out[1]
    assert len([line for line in out if line.split()[0].endswith("%") and "FFMA" in line]) == 2
    # then the kernel's samples by stall reason and by opcode
    assert out[3] == "   by stall reason: barrier 68.0 %, long_sb 32.0 %"
    assert out[4] == "   by opcode: FFMA 100.0 %"
    b = out.index("== kernel_b: 2 SASS lines, 4000 samples")
    assert out[b + 1].split()[:2] == ["75.0%", "0001"]  # thousands separators read as numbers
    assert out[b + 4] == "   by opcode: HGMMA 100.0 %"


def test_opcode_drops_predicates_and_modifiers():
    assert ncu_hot_lines.opcode("@!P0  NANOSLEEP.SYNCS 0x989680") == "NANOSLEEP"
    assert ncu_hot_lines.opcode("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT") == "QGMMA"
    assert ncu_hot_lines.opcode("") == ""


def test_an_export_without_a_source_table_fails(tmp_path, capsys):
    path = tmp_path / "empty.csv"
    path.write_text('"==PROF== nothing profiled"\n')
    assert ncu_hot_lines.main([str(path)]) == 1
    assert "no source table" in capsys.readouterr().err
