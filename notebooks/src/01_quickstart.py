# %% [markdown]
# # moe-jax quickstart
# A tiny MoE model on CPU: build it from a preset, prefill a ragged batch, decode with an explicit KV cache, and
# generate with the on-device loop. Everything here imports the package; no logic lives in the notebook.

# %%
import jax
import numpy as np

import configs
from moe_jax import decode, tokenizer
from moe_jax.config import analytical_report
from moe_jax.generate import generate, pad_batch
from moe_jax.sampling import SamplingParams

config = configs.get("tiny")
model = decode.init_model(config, seed=0)
config

# %% [markdown]
# Analytical numbers of a preset (never instantiated): parameters, active bytes per token, KV bytes per token.

# %%
analytical_report(configs.get("qwen3_30b_a3b"))

# %% [markdown]
# Prefill a ragged batch, then one decode step: the cache is a pytree passed in and returned.

# %%
prompts = [tokenizer.encode("def add(a, b):"), tokenizer.encode("import os")]
tokens, lengths = pad_batch(prompts)
logits, cache = decode.prefill(model, tokens, lengths, kv_cache="bf16", cache_len=64)
print("logits", logits.shape, "cache lengths", cache.lengths, "cache bytes", cache.nbytes())
next_logits, cache = decode.decode_step(model, cache, np.argmax(logits[np.arange(2), lengths - 1], -1))
print("after one step:", cache.lengths)

# %% [markdown]
# Generation (greedy and sampled). The weights are random, so the text is noise; `--checkpoint=tiny-trained`
# in the CLI uses a trained model.

# %%
out = generate(model, tokens, lengths, key=jax.random.key(0), max_new_tokens=16)
print(out.tokens.shape, out.lengths)
sampled = generate(model, tokens, lengths, key=jax.random.key(1), max_new_tokens=16,
                   sampling=SamplingParams(temperature=0.8, top_p=0.9))
[tokenizer.decode(t) for t in np.asarray(sampled.tokens)]
