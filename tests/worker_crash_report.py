"""When an xdist worker dies (a segfault in a C extension), print where each of its threads was.

pytest's own faulthandler writes every thread's stack to the worker's stderr, interleaved with the progress dots; a
CI log that keeps only its head and tail cut the middle of that dump out, so the crash was anonymous. So:
- each worker sends its fatal-error dump to a file of its own (`crash_dir/gwN.txt`) instead of stderr;
- each worker also writes there the id of every test it starts (`running:`) and the events worth knowing at a
  crash (`note`: the interpret-mode watchdog giving up on a try), so the test is named even when the crashing
  thread is one of XLA's own, which has no Python stack;
- the controller, told that a worker went down, prints the last few tests started, the events, the crashing thread's
  stack (innermost first, the test runner's frames left out; the test's own frame is among them) and every other
  thread's innermost frame.
`make test` (Makefile, PYTEST_WORKERS) then replaces the worker and runs the crashed test again, up to twice.

Registered from tests/conftest.py; inert without xdist.
"""

import atexit
import faulthandler
import os
import pathlib
import shutil
import tempfile

import pytest

_DIR_ENV = "MOE_JAX_TEST_CRASH_DIR"
_dump_file = None  # kept open for the worker's lifetime: faulthandler writes to its descriptor


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin points the dump at stderr
def pytest_configure(config):
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  if worker is None:  # the controller (or a run without xdist): workers inherit the directory through the env
    if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None) and \
        _DIR_ENV not in os.environ:
      os.environ[_DIR_ENV] = tempfile.mkdtemp(prefix="moe_jax_tests_crashes_")
      atexit.register(shutil.rmtree, os.environ[_DIR_ENV], ignore_errors=True)
    return
  crash_dir = os.environ.get(_DIR_ENV)
  if crash_dir:
    global _dump_file
    path = os.path.join(crash_dir, f"{worker}.txt")
    _dump_file = open(path, "w", encoding="utf-8")  # pylint: disable=consider-using-with
    faulthandler.enable(file=_dump_file, all_threads=True)


def _write(line: str) -> None:
  if _dump_file is not None:
    _dump_file.write(line + "\n")
    _dump_file.flush()  # on disk before any crash: faulthandler writes after it, at the descriptor's offset


def pytest_runtest_logstart(nodeid, location):
  del location
  _write(f"running: {nodeid}")


def note(event: str) -> None:
  """Records `event` in this worker's dump file (printed with the dump if the worker dies; nothing otherwise)."""
  _write(f"event: {event}")


_RUNNER_FRAMES = ("/pluggy/", "/_pytest/", "/xdist/", "/execnet/")


def summarize_dump(text: str, *, max_frames: int = 25, last_tests: int = 4) -> list[str]:
  """The lines to print of a worker's dump file: the last `last_tests` tests it started (the crashing one last; what
  ran before it in that process may be what left it unsafe), its events, the fatal error's header,
  the crashing thread's stack (innermost first, up to `max_frames` frames, pytest's and xdist's own frames left out)
  and each other thread's innermost frame."""
  out, section, frames, running = [], None, 0, []
  for line in text.splitlines():
    if section is None and line.startswith("running: "):
      running = (running + [line])[-last_tests:]
    elif section is None and line.startswith("event: "):
      out.append(line)
    elif line.startswith("Current thread"):
      section, frames = "current", 0
      out.append(line)
    elif line.startswith("Thread 0x"):
      section, frames = "other", 0
      out.append(line)
    elif line.lstrip().startswith("File "):
      if section == "current" and any(part in line for part in _RUNNER_FRAMES):
        continue
      if (section == "current" and frames < max_frames) or (section == "other" and frames < 1):
        out.append(line)
      frames += 1
    elif line.strip() and section is None:
      out.append(line)  # "Fatal Python error: Segmentation fault" and the like
    elif line.startswith("Extension modules"):
      section = "done"
  return running + out


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  """xdist's hook in the controller: a worker finished (`error` None) or died."""
  if error is None:
    return
  crash_dir = os.environ.get(_DIR_ENV)
  worker = node.gateway.id
  path = pathlib.Path(crash_dir, f"{worker}.txt") if crash_dir else None
  text = path.read_text(encoding="utf-8", errors="replace") if path and path.exists() else ""
  reporter = node.config.pluginmanager.get_plugin("terminalreporter")
  write = reporter.write_line if reporter else print
  write(f"[{worker}] worker down ({error}); its fatal-error dump:")
  lines = summarize_dump(text)
  if not any(line.startswith("Fatal Python error") for line in lines):
    lines.append("(no fatal-error dump: the worker died without a Python fatal error, e.g. SIGKILL)")
  for line in lines:
    write(f"  {line}")
