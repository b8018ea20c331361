"""Config validation and the analytical numbers of the large presets (checked against the published totals)."""

import pytest

import configs
from moe_jax.config import ModelConfig, analytical_report, param_counts


@pytest.mark.parametrize("changes, field", [
    (dict(n_heads=6, n_kv_heads=4), "n_kv_heads"),
    (dict(n_experts_per_tok=9), "n_experts_per_tok"),
    (dict(head_dim=15), "head_dim"),
    (dict(d_model=0), "d_model"),
    (dict(router="relu"), "router"),
    (dict(dense_layers=(5,)), "dense_layers"),
    (dict(dense_layers=(0,), dense_hidden=0), "dense_hidden"),
    (dict(shared_expert_gate=True, shared_expert_hidden=0), "shared_expert_gate"),
    (dict(param_dtype="int8"), "param_dtype"),
    (dict(dense_layers=[0]), "dense_layers"),
    (dict(rope_theta=float("nan")), "rope_theta"),  # before: accepted, NaN logits
    (dict(rope_theta=float("inf")), "rope_theta"),
    (dict(rms_eps=float("nan")), "rms_eps"),
    (dict(shared_expert_hidden=8.0), "shared_expert_hidden"),  # before: a shape error inside jax.random
    (dict(dense_layers=(0,), dense_hidden=4.5), "dense_hidden"),
    (dict(dense_layers=(1.5,), dense_hidden=8), "dense_layers"),  # before: accepted, and no layer was dense
    (dict(dense_layers=(True,), dense_hidden=8), "dense_layers"),  # before: layer 1
    (dict(qk_norm="false"), "qk_norm"),  # before: a true string, QK-norm on
    (dict(tie_embeddings=1), "tie_embeddings"),
    (dict(rope_theta="1e4"), "rope_theta"),  # before: a bare TypeError from the comparison
])
def test_invalid_config_names_the_field(changes, field):
  with pytest.raises(ValueError, match=field):
    ModelConfig(**changes)


def test_unknown_preset_lists_choices():
  with pytest.raises(ValueError, match="tiny"):
    configs.get("nope")


# Published totals: Mixtral-8x7B 46.7B total / 12.9B active; Qwen3-30B-A3B 30.5B / 3.3B; Qwen3-235B-A22B 235B / 22B.
@pytest.mark.parametrize("name, total, active", [
    ("mixtral_8x7b", 46.7e9, 12.9e9),
    ("qwen3_30b_a3b", 30.5e9, 3.3e9),
    ("qwen3_235b_a22b", 235e9, 22e9),
])
def test_param_counts_match_published(name, total, active):
  counts = param_counts(configs.get(name))
  assert abs(counts["total"] - total) / total < 0.02
  # The published "active" figures include the embedding table; ours counts the one row read per token as ~0.
  embed = counts["embedding"]
  assert abs(counts["active"] + embed - active) / active < 0.05


def test_tying_the_embeddings_saves_total_parameters_not_active_ones():
  """A tied LM head is the embedding, read whole for every token (before: V·D left out of "active")."""
  c = configs.get("tiny")
  untied, tied = param_counts(c.replace(tie_embeddings=False)), param_counts(c.replace(tie_embeddings=True))
  assert untied["total"] - tied["total"] == c.vocab_size * c.d_model
  assert tied["active"] == untied["active"]


def test_seed_preset_is_480b_with_32_active_experts():
  c = configs.get("seed_480b")
  assert c.n_experts_per_tok == 32
  assert abs(param_counts(c)["total"] - 480e9) / 480e9 < 0.03


def test_kv_bytes_per_token():
  c = configs.get("qwen3_30b_a3b")  # 48 layers × 4 kv heads × 128 × (K and V) × 2 bytes
  assert analytical_report(c)["kv_bytes_per_token_bf16"] == 48 * 4 * 128 * 2 * 2


def test_the_config_cli_names_its_preset_flag():
  import os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-m", "moe_jax.config", "--preset=nope"], cwd=root, env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode != 0
  assert "ValueError: --preset='nope' is not a preset; choose one of [" in r.stderr and "'tiny'" in r.stderr, r.stderr
  with pytest.raises(ValueError, match=r"^--config='nope' is not a preset"):
    configs.get("nope", flag="--config")
