"""BlendConfig.selection: the measured-and-lost selection levers in one SelectionPolicy value,
their old BlendConfig names kept as deprecated aliases that warn and mean the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CHUNKS, QUESTION, tiny_model
from helpers import engine_for

from ragblend import BlendConfig, SelectionPolicy
from ragblend.config import MOVED_TO_SELECTION
from ragblend.errors import RagblendError
from ragblend.fusion.selection import SelectorWithOptions, make_selector

# BlendConfig's 32 fields and defaults before the selection levers moved (issue 71)
OLD_DEFAULTS = dict(
    ratio=0.15,
    check_layers=(1, 10),
    check_scales=(1.5, 1.0),
    selector="kv-deviation",
    deviation="kv",
    chunk_start_tokens=16,
    near_question_tokens=256,
    cached_temperature=1.0,
    fitted_chunk_weight=1.0,
    adaptive_mass=None,
    adaptive_ratio=(0.05, 0.3),
    precompute_context="neighbours",
    precompute_neighbours=2,
    neighbour_rows="reused",
    exact_first_chunk=True,
    mode="blend",
    device="cpu",
    dtype="auto",
    weights="auto",
    namespace=None,
    kv_dtype="auto",
    max_new_tokens=64,
    packed_decode=True,
    row_attention="auto",
    layer_kernels="auto",
    decode_activations="auto",
    kv_cache_dtype="auto",
    decode_slots=None,
    decode_pool_tokens=4096,
    cuda_graphs=False,
    ram_bytes=4 << 30,
    extra={},
)
# a value other than the default for each moved lever
OTHER = dict(
    deviation="v",
    cached_temperature=0.9,
    fitted_chunk_weight=0.5,
    adaptive_mass=0.6,
    adaptive_ratio=(0.1, 0.5),
)


def test_the_moved_names_are_the_policy_fields_and_nothing_else_was_lost():
    assert set(MOVED_TO_SELECTION) == set(OTHER)
    fields = {f.name for f in dataclasses.fields(BlendConfig)}
    assert fields == (set(OLD_DEFAULTS) - set(MOVED_TO_SELECTION)) | {"selection"}


def test_the_default_config_equals_the_old_defaults_field_by_field():
    config = BlendConfig()
    for name, value in OLD_DEFAULTS.items():
        if name in MOVED_TO_SELECTION:
            assert getattr(config.selection, name) == value, name
        else:
            assert getattr(config, name) == value, name
    assert config.selection == SelectionPolicy()
    with pytest.warns(DeprecationWarning):
        assert BlendConfig(**OLD_DEFAULTS) == config


@pytest.mark.parametrize("name", sorted(OTHER))
def test_an_old_name_warns_naming_the_new_spelling_and_means_the_same(name):
    value = OTHER[name]
    with pytest.warns(DeprecationWarning, match=rf"SelectionPolicy\({name}=") as caught:
        old = BlendConfig(**{name: value}, ratio=0.2)
    assert caught[0].filename == __file__  # points at the caller
    new = BlendConfig(ratio=0.2, selection=SelectionPolicy(**{name: value}))
    assert old == new
    assert getattr(old.selection, name) == value
    with pytest.warns(DeprecationWarning, match=rf"config\.selection\.{name}"):
        assert getattr(old, name) == value


def test_setting_an_old_name_warns_and_changes_only_that_lever():
    config = BlendConfig(selection=SelectionPolicy(adaptive_mass=0.5))
    with pytest.warns(DeprecationWarning, match="cached_temperature"):
        config.cached_temperature = 1.06
    assert config.selection == SelectionPolicy(adaptive_mass=0.5, cached_temperature=1.06)


def test_replace_takes_both_spellings_and_an_old_name_keeps_the_rest_of_the_policy():
    base = BlendConfig(ratio=0.3, selection=SelectionPolicy(adaptive_mass=0.5))
    with pytest.warns(DeprecationWarning):
        old = dataclasses.replace(base, cached_temperature=1.06)
    assert old.selection == SelectionPolicy(adaptive_mass=0.5, cached_temperature=1.06)
    assert old.ratio == 0.3
    new = dataclasses.replace(
        base, selection=dataclasses.replace(base.selection, cached_temperature=1.06)
    )
    assert old == new
    with pytest.warns(DeprecationWarning):  # both: the old name applies onto the given policy
        both = BlendConfig(selection=SelectionPolicy(deviation="v"), adaptive_mass=0.4)
    assert both.selection == SelectionPolicy(deviation="v", adaptive_mass=0.4)


def test_the_default_replace_path_does_not_warn(recwarn):
    dataclasses.replace(BlendConfig(), ratio=0.2, check_layers=(1,), check_scales=None)
    BlendConfig(ratio=0.2)
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize(
    "bad",
    [
        {"deviation": "q"},
        {"cached_temperature": 0.0},
        {"fitted_chunk_weight": 1.5},
        {"adaptive_mass": 0.0},
        {"adaptive_ratio": (0.3, 0.1)},
    ],
)
def test_bad_levers_are_one_clear_error_in_either_spelling(bad):
    name = next(iter(bad))
    with pytest.raises(RagblendError, match=name):
        SelectionPolicy(**bad)
    with pytest.raises(RagblendError, match=name), pytest.warns(DeprecationWarning):
        BlendConfig(**bad)


def test_selection_must_be_a_policy():
    with pytest.raises(RagblendError, match="SelectionPolicy"):
        BlendConfig(selection={"cached_temperature": 1.06})  # type: ignore[arg-type]


def test_the_policy_is_a_value_equal_and_hashable():
    listed = SelectionPolicy(adaptive_ratio=[0.1, 0.2])  # type: ignore[arg-type]
    assert listed == SelectionPolicy(adaptive_ratio=(0.1, 0.2))
    assert hash(listed) == hash(SelectionPolicy(adaptive_ratio=(0.1, 0.2)))
    assert BlendConfig(selection=listed) == BlendConfig(
        selection=SelectionPolicy(adaptive_ratio=(0.1, 0.2))
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        listed.cached_temperature = 2.0  # type: ignore[misc]


def test_the_default_policy_leaves_the_selector_unwrapped_apart_from_the_kept_options():
    assert not isinstance(
        make_selector(BlendConfig(chunk_start_tokens=0, near_question_tokens=0)),
        SelectorWithOptions,
    )
    hot = make_selector(
        BlendConfig(
            chunk_start_tokens=0,
            near_question_tokens=0,
            selection=SelectionPolicy(cached_temperature=1.06),
        )
    )
    assert isinstance(hot, SelectorWithOptions) and hot.cached_temperature == 1.06


def test_the_old_wrapper_name_warns_and_is_the_wrapper():
    import ragblend.fusion.selection as selection

    with pytest.warns(DeprecationWarning, match="SelectorWithOptions"):
        assert selection.SelectionPolicy is SelectorWithOptions


def test_an_engine_built_with_the_old_spelling_prefills_the_same_logits(tokenizer):
    """Every moved lever off its default at once (the fitted weight has no fitted chunk here):
    the old spelling, the new one and a with_config view of either give the same logits."""
    model = tiny_model("llama", num_hidden_layers=4)
    common = dict(ratio=0.3, check_layers=(1, 2), check_scales=(1.5, 1.0), chunk_start_tokens=2)
    with pytest.warns(DeprecationWarning):
        old = engine_for(model, tokenizer, **common, **OTHER)
    new = engine_for(model, tokenizer, **common, selection=SelectionPolicy(**OTHER))
    assert old.config == new.config
    default = engine_for(model, tokenizer, **common)
    for engine in (old, new, default):
        engine.precompute(CHUNKS)
    prompt = new.tokenize(QUESTION, CHUNKS)
    logits = new.prefill(prompt, "blend").logits
    assert torch.equal(old.prefill(prompt, "blend").logits, logits)
    assert not torch.equal(default.prefill(prompt, "blend").logits, logits)  # the levers act
    with pytest.warns(DeprecationWarning):
        view = default.with_config(**OTHER)
    assert view.config == new.config
    assert torch.equal(view.prefill(prompt, "blend").logits, logits)
    same = default.with_config(selection=SelectionPolicy(**OTHER))
    assert torch.equal(same.prefill(prompt, "blend").logits, logits)
