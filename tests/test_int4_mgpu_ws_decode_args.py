"""Argument checks of `benchmarks/int4_mgpu_ws_decode.py` (they run before anything touches a device)."""

import pytest

from benchmarks import int4_mgpu_ws_decode as bench


@pytest.mark.parametrize("shape", ["8,4096", "8,4096,0", "8,4096,x", "8,4096,2048,1"])
def test_bad_shape_names_the_flag(shape, capsys, tmp_path):
  with pytest.raises(SystemExit) as exit_info:
    bench.main([f"--shape={shape}", f"--out={tmp_path}"])
  assert exit_info.value.code == 2
  assert "--shape" in capsys.readouterr().err
  assert not list(tmp_path.iterdir())  # nothing was written
