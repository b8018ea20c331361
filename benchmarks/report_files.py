"""The results files of the small benchmarks: `<name>_<device>.json` and `.md` under an output folder."""

from __future__ import annotations

import json
import os

import jax


def device_slug() -> str:
  """The first device's kind as a file-name part: "cpu", "nvidia_h100_80gb_hbm3"."""
  return jax.devices()[0].device_kind.replace(" ", "_").lower()


def write(out_dir: str, name: str, result: dict, md_lines: list[str], echo: bool = True) -> str:
  """Writes `result` (with "device" and "jax" added) as `<name>_<device>.json` and `md_lines` as `.md` under
  out_dir, prints the markdown (if `echo`) and returns the path stem."""
  os.makedirs(out_dir, exist_ok=True)
  stem = os.path.join(out_dir, f"{name}_{device_slug()}")
  with open(stem + ".json", "w", encoding="utf-8") as f:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__} | result, f, indent=2)
  with open(stem + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(md_lines) + "\n")
  if echo:
    print("\n".join(md_lines))
  return stem
