"""`sharding.experiment_flags.check_flags`: settings that would fail every row of the sweep are refused before it."""

import types

import pytest

from sharding import experiment_flags as experiments

GOOD = dict(layouts="1x8,2x4", transports="padded,ragged_emulated", batch=16, prompt_len=32, steps=20,
            lambdas="0,0.05", ranks="0,8", windows=4, context=128, prefix=32, rank=16)


def test_good_flags_give_the_layouts():
  assert experiments.check_flags(types.SimpleNamespace(**GOOD)) == [(1, 8), (2, 4)]


@pytest.mark.parametrize("change, message", [
    (dict(transports="padded,bogus"), r"\['bogus'\] not among"),
    (dict(batch=12), "batch=12 must be divisible by the 8 devices of layout 1x8"),
    (dict(steps=0), "steps=0 must be >= 1"),
    (dict(lambdas="0,a"), "lambdas='0,a' must be comma-separated floats"),
    (dict(ranks="8,1.5"), "ranks='8,1.5' must be comma-separated ints"),
    (dict(layouts="2by4"), "layout='2by4'"),
    (dict(prefix=129), r"prefix=129 must be in \[1, context=128\]"),
    (dict(prefix=0), r"prefix=0 must be in \[1, context=128\]"),
    (dict(windows=0), "windows=0 must be >= 1"),
    (dict(lambdas="0,-1"), "lambdas='0,-1' must be finite and >= 0"),  # before: the sweep died after the rows
])
def test_bad_flags_are_named(change, message):
  with pytest.raises(ValueError, match=message):
    experiments.check_flags(types.SimpleNamespace(**{**GOOD, **change}))


@pytest.mark.parametrize("change, sizes, message", [
    # Before, each was found only after the model load and the baseline quality pass, and killed the whole run.
    (dict(layouts="1x8,4x4", batch=16), dict(n_devices=8), r"4x4 needs 16 devices, 8 present"),
    (dict(layouts="2x4,8x1"), dict(n_experts=4), r"8 nodes do not divide the model's 4 experts"),
    (dict(rank=0), {}, r"rank=0 must be >= 1"),  # before: every lcvc row failed, its JSON said surrogates served
    (dict(ranks="0,-8"), {}, r"ranks='0,-8' must be >= 0"),
])
def test_layouts_that_cannot_run_and_ranks_are_named(change, sizes, message):
  with pytest.raises(ValueError, match=message):
    experiments.check_flags(types.SimpleNamespace(**{**GOOD, **change}), **sizes)


@pytest.mark.parametrize("change, message", [
    (dict(context=2048), "context=2048 exceeds the model's max_seq_len=1024"),  # before: ran past it under jit
    (dict(prompt_len=1023), r"prompt_len=1023 \+ steps=20 \+ 2 exceeds"),  # before: every row failed, exit 0
])
def test_flags_past_the_models_length_are_named(change, message):
  experiments.check_model_limits(types.SimpleNamespace(**GOOD), max_seq_len=1024)
  with pytest.raises(ValueError, match=message):
    experiments.check_model_limits(types.SimpleNamespace(**{**GOOD, **change}), max_seq_len=1024)
