"""The policy registry (`dlmrt.runtime.policy_registry.POLICIES`): its entries name their classes, and
`make_policy` states no default of its own."""

from __future__ import annotations

import pytest

from dlmrt.runtime import EntropyBound, MaskPolicy, make_policy
from dlmrt.runtime.policy_registry import POLICIES


@pytest.mark.parametrize("name", list(POLICIES))
def test_each_entry_names_its_class(name):
    entry = POLICIES[name]
    assert entry.policy_class.name == name
    assert entry.noise == ("uniform" if name == "entropy_bound" else "mask")
    assert issubclass(entry.policy_class, MaskPolicy) == (entry.noise == "mask")


@pytest.mark.parametrize("name", list(POLICIES))
def test_make_policy_without_options_is_the_class_defaults(name):
    assert make_policy(name) == POLICIES[name].policy_class()


# A value of each option that no policy takes as its default.
SAMPLE_VALUES = {"steps": 4, "remasking": "random", "threshold": 0.5, "factor": 2.0, "confidence": "margin",
                 "minimal_topk": 2, "editing_threshold": 0.5, "max_post_steps": 4, "preset": "quality",
                 "entropy_bound": 0.3}


@pytest.mark.parametrize("name, option", [(name, option) for name, entry in POLICIES.items()
                                          for option in entry.options])
def test_each_registered_option_reaches_the_policy(name, option):
    value = SAMPLE_VALUES[option]
    assert isinstance(value, POLICIES[name].options[option])
    assert make_policy(name, **{option: value}) != make_policy(name)


def test_a_uniform_noise_policy_has_no_mask_schedule():
    assert not hasattr(EntropyBound(), "schedule") and not hasattr(EntropyBound(), "block_steps")
    assert not EntropyBound().edits


def test_make_policy_refuses_an_option_no_policy_takes():
    with pytest.raises(TypeError, match="unexpected options thresold"):
        make_policy("threshold", thresold=0.5)
