"""`make test`'s worker settings (Makefile, PYTEST_WORKERS) with tests/worker_crash_report.py: a test whose worker
segfaults once is run again and passes, one that segfaults every time fails after its reruns without hanging the
run, an assertion failure is not rerun, and the log names the crashing frame each time."""

import os
import re
import shlex
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def _makefile_worker_flags() -> list[str]:
  with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
    line = re.search(r"^PYTEST_WORKERS := (.*)$", f.read(), re.M)
  assert line, "the Makefile defines PYTEST_WORKERS"
  return shlex.split(line.group(1))


def test_a_crashed_test_is_rerun_and_the_dump_names_its_frame(tmp_path):
  (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {TESTS!r})
      from worker_crash_report import pytest_configure, pytest_runtest_logstart, pytest_testnodedown
      """))
  (tmp_path / "test_crashes.py").write_text(textwrap.dedent(f"""
      import ctypes, os

      def test_before():
        pass

      def test_crashes_once():
        marker = {str(tmp_path / "crashed_once")!r}
        if not os.path.exists(marker):
          open(marker, "w").close()
          ctypes.string_at(0)

      def test_crashes_every_time():
        ctypes.string_at(0)

      def test_fails():
        assert 1 == 2

      def test_after():
        pass
      """))
  env = {k: v for k, v in os.environ.items() if k not in ("MOE_JAX_TEST_CRASH_DIR", "PYTEST_XDIST_WORKER")}
  flags = _makefile_worker_flags()
  reruns = int(next(f.split("=", 1)[1] for f in flags if f.startswith("--reruns=")))
  r = subprocess.run([sys.executable, "-m", "pytest", *flags, "-p", "no:cacheprovider", "-o",
                      "addopts=", "-rA", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=180)
  out = r.stdout + r.stderr
  assert r.returncode == 1, out[-4000:]
  got = {name: kind for kind, name in re.findall(r"^(PASSED|FAILED) test_crashes\.py::(\w+)", out, re.M)}
  assert got == {"test_before": "PASSED", "test_crashes_once": "PASSED", "test_crashes_every_time": "FAILED",
                 "test_fails": "FAILED", "test_after": "PASSED"}, out[-4000:]
  assert "crashed while running 'test_crashes.py::test_crashes_every_time'" in out, out[-4000:]
  # the test that crashes once is rerun once, the one that always crashes `reruns` times, the assertion never
  assert re.search(rf"^=+ 2 failed, 3 passed, {1 + reruns} rerun in ", out, re.M), out[-4000:]
  dumps = out.split("its fatal-error dump:")[1:]
  assert len(dumps) == 2 + reruns, out[-4000:]  # once for the first crash, 1 + reruns for the one that always does
  for dump in dumps:
    assert "Fatal Python error: Segmentation fault" in dump
    started = re.findall(r"running: (\S+)", dump)
    assert started and re.fullmatch(r"test_crashes\.py::test_crashes_(once|every_time)", started[-1]), dump
    assert 1 <= len(started) <= 4, dump  # the crashing test last, after at most three before it
    current = dump[dump.index("Current thread"):].split("Thread 0x")[0]
    assert "in string_at" in current and re.search(r"in test_crashes_(once|every_time)", current), dump
    assert "/pluggy/" not in current, dump  # the runner's frames are left out
  assert out.count("Fatal Python error") == 2 + reruns, out[-4000:]  # the dumps went to the files, not to stderr


def test_the_summary_names_the_last_tests_and_the_events_when_no_python_thread_crashed():
  """A crash in one of XLA's own threads leaves no "Current thread" section: the last test started names it."""
  from worker_crash_report import summarize_dump  # pylint: disable=import-error,g-import-not-at-top
  text = "\n".join([
      "running: tests/a.py::test_one", "event: watchdog: no progress in 60.0 s on try 1 of tests/a.py::test_one",
      "running: tests/b.py::test_two", "Fatal Python error: Segmentation fault", "",
      "Thread 0x00007f01 (most recent call first):", '  File "/x/jax/_src/compiler.py", line 395 in compile',
      '  File "/x/tests/b.py", line 9 in test_two', "", "Extension modules: numpy"])
  assert summarize_dump(text) == [
      "running: tests/a.py::test_one", "running: tests/b.py::test_two", "event: watchdog: no progress in 60.0 s on try 1 of tests/a.py::test_one",
      "Fatal Python error: Segmentation fault", "Thread 0x00007f01 (most recent call first):",
      '  File "/x/jax/_src/compiler.py", line 395 in compile']
