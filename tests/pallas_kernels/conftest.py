"""Fixtures of the kernel tests."""

import pytest

from interpreter_watchdog import run_with_watchdog  # pylint: disable=import-error


@pytest.fixture
def interpreted():
  """`interpreted(lambda: kernel(..., interpret=True))`: a Mosaic GPU interpret-mode call under the watchdog of
  `interpreter_watchdog.py` (retried when the interpreter's warpgroup threads starve XLA's CPU pool)."""
  return run_with_watchdog
