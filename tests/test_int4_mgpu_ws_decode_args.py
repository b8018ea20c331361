"""Argument checks of `benchmarks/int4_mgpu_ws_decode.py` (they run before anything touches a device)."""

import pytest

from benchmarks import int4_mgpu_ws_decode as bench


@pytest.mark.parametrize("flag,value", [("shape", "8,4096"), ("shape", "8,4096,0"), ("shape", "8,4096,x"),
                                        ("shape", "8,4096,2048,1"), ("rows", "16,x"), ("rows", "0"),
                                        ("seeds", "1,x"), ("seeds", "1,,2"), ("seeds", "1,1"), ("seeds", "-1"),
                                        ("seeds", "1,2"), ("ws", "defualt")])
def test_bad_shape_rows_or_seeds_name_the_flag(flag, value, capsys, tmp_path):
  with pytest.raises(SystemExit) as exit_info:
    bench.main([f"--{flag}={value}", f"--out={tmp_path}"])
  assert exit_info.value.code == 2
  assert f"--{flag}" in capsys.readouterr().err
  assert not list(tmp_path.iterdir())  # nothing was written
