"""XLA_FLAGS for N simulated CPU devices that keep the caller's other flags.

Imports nothing from jax: callers set the flags in the environment before jax (or a child process) starts.
"""

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_device_count(xla_flags: str, n: int) -> str:
  """`xla_flags` with its device-count flag, if any, replaced by `--xla_force_host_platform_device_count=n`."""
  kept = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
  return " ".join(kept + [f"{DEVICE_COUNT_FLAG}={n}"])
