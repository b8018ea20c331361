"""tests/worker_crash_report.py: a worker that segfaults ends the run at once (no xdist hang), and the log's tail
names the test and the crashing frame."""

import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_a_segfaulting_worker_is_named_with_its_stack_and_the_run_stops(tmp_path):
  (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {TESTS!r})
      from worker_crash_report import pytest_configure, pytest_testnodedown
      """))
  (tmp_path / "test_a_crash.py").write_text(textwrap.dedent("""
      import ctypes

      def test_before():
        pass

      def test_reads_address_zero():
        ctypes.string_at(0)

      def test_after():
        pass
      """))
  (tmp_path / "test_b_more.py").write_text("def test_more():\n  pass\n")
  env = {k: v for k, v in os.environ.items() if k not in ("MOE_JAX_TEST_CRASH_DIR", "PYTEST_XDIST_WORKER")}
  r = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "--dist", "loadfile", "--max-worker-restart=0",
                      "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=120)
  out = r.stdout + r.stderr
  assert r.returncode == 1, out[-3000:]
  assert "crashed while running 'test_a_crash.py::test_reads_address_zero'" in out, out[-3000:]
  dump = out[out.index("its fatal-error dump:"):]
  assert "Fatal Python error: Segmentation fault" in dump
  current = dump[dump.index("Current thread"):]
  assert "in string_at" in current and "in test_reads_address_zero" in current, dump
  assert "/pluggy/" not in current.split("Thread 0x")[0], dump  # the runner's frames are left out
  assert out.count("Fatal Python error") == 1, out[-3000:]  # the dump went to the file, not also to stderr
