"""Model presets as Python: `configs.get("tiny")` returns a validated `ModelConfig`.

| preset | what | instantiated in tests |
|---|---|---|
| tiny | CPU model, seconds per test; byte-level vocab | yes |
| small | ~2B params, one H200 with room for a large KV cache | no (GPU runs) |
| mixtral_8x7b, qwen3_30b_a3b, qwen3_235b_a22b | published shapes | never: analytical numbers only |
| seed_480b | 480B total, 32 active experts (the seed's model) | never: analytical numbers only |
"""

from configs.large import MIXTRAL_8X7B, QWEN3_30B_A3B, QWEN3_235B_A22B, SEED_480B
from configs.tiny import SMALL, TINY
from configs.trained import TINY_TRAINED
from moe_jax.config import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    c.name: c for c in (TINY, SMALL, TINY_TRAINED, MIXTRAL_8X7B, QWEN3_30B_A3B, QWEN3_235B_A22B, SEED_480B)
}


def register(config: ModelConfig) -> None:
  """Adds a preset (e.g. a trained checkpoint's own shape) under `config.name`."""
  PRESETS[config.name] = config


def get(name: str, *, flag: str = "config") -> ModelConfig:
  """The preset `name`; an unknown name raises ValueError naming `flag` (e.g. "--preset" for a command line)."""
  if name not in PRESETS:
    raise ValueError(f"{flag}={name!r} is not a preset; choose one of {sorted(PRESETS)}")
  return PRESETS[name]
