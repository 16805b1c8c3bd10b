"""Tests of torchrl_grpo/loss/variants/flat.py: the flat keywords of earlier versions build the
same variants as the objects (the same numbers and gradients), with a deprecation note naming
the new form; presets hold objects and merge the caller's by slot."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.loss import every_entry_batch, outputs_and_grads, token_policy

from torchrl_grpo.loss import DPPOLoss, GRPOLoss, SAPOLoss
from torchrl_grpo.loss.variants import (
    SAPO,
    TIS,
    VESPO,
    Clip,
    Decoupled,
    EntropyTarget,
    InferenceCorrection,
    InferenceVeto,
    KLMask,
    KLToInference,
    KLToReference,
    OffPolicyMask,
    TopEntropy,
    TruncatedCompletions,
    TrustRegion,
)
from torchrl_grpo.loss.variants.flat import from_keywords

PAIRS = [  # (flat keywords, the same loss as objects)
    ({"clip_ratio_c": 1.5}, {"objective": Clip(clip_ratio_c=1.5)}),
    ({"delta": 1.3}, {"objective": Clip(delta=1.3)}),
    (
        {"objective": "sapo", "sapo_temperature_neg": 2.0},
        {"objective": SAPO(temperature_neg=2.0)},
    ),
    (
        {"objective": "vespo", "ratio_level": "sequence_sum", "vespo_k": (1.0, 2.0)},
        {"objective": VESPO(k=(1.0, 2.0)), "ratio_level": "sequence_sum"},
    ),
    (
        {"kl_to_ref_coeff": 0.1, "kl_to_ref_estimator": "k2", "kl_to_ref_unbiased": True},
        {"penalties": [KLToReference(0.1, "k2", unbiased=True)]},
    ),
    ({"kl_to_inference_coeff": 0.1}, {"penalties": [KLToInference(0.1)]}),
    ({"entropy_target": 0.5}, {"penalties": [EntropyTarget(0.5)]}),
    ({"kl_mask_threshold": 0.02}, {"corrections": [KLMask(0.02)]}),
    ({"mask_truncated_completions": True}, {"corrections": [TruncatedCompletions()]}),
    ({"inference_veto_threshold": 0.3}, {"corrections": [InferenceVeto(0.3)]}),
    ({"decoupled": True, "behaviour_weight_cap": 1.2}, {"corrections": [Decoupled(1.2)]}),
    ({"tis_cap": 1.1}, {"corrections": [TIS(1.1)]}),
    (
        {"inference_correction": "token_mask", "inference_correction_bounds": (0.8, 1.2)},
        {"corrections": [InferenceCorrection("token_mask", (0.8, 1.2))]},
    ),
    ({"off_policy_mask_threshold": 0.02}, {"corrections": [OffPolicyMask(0.02)]}),
    ({"trust_region": "dppo_kl"}, {"corrections": [TrustRegion("dppo_kl")]}),
    ({"top_entropy_quantile": 0.5}, {"corrections": [TopEntropy(0.5)]}),
    (
        {"decoupled": True, "tis_cap": 1.1, "kl_mask_threshold": 0.05, "kl_to_ref_coeff": 0.1},
        {
            "corrections": [KLMask(0.05), Decoupled(), TIS(1.1)],
            "penalties": [KLToReference(0.1)],
        },
    ),
]


def build(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        loss = GRPOLoss(token_policy(), entropy_coeff=0.01, **kwargs)
    loss.set_keys(sample_log_prob="tokens_log_prob")
    return loss


@pytest.mark.parametrize("flat, objects", PAIRS)
def test_the_flat_form_is_the_objects(flat, objects):
    batch = every_entry_batch()
    plain, _ = outputs_and_grads(build(), batch)
    out_flat, grads_flat = outputs_and_grads(build(**flat), batch)
    out_objects, grads_objects = outputs_and_grads(build(**objects), batch)
    assert sorted(out_flat.keys()) == sorted(out_objects.keys())
    for key, value in out_flat.items():
        if value is not None:
            torch.testing.assert_close(out_objects[key], value, rtol=0, atol=0, msg=key)
    for a, b in zip(grads_flat, grads_objects, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the variant changes something: the equality above is not two default losses
    changed = [
        key
        for key, value in out_flat.items()
        if value is not None
        and (plain.get(key, None) is None or not torch.equal(plain[key], value))
    ]
    assert changed


def test_a_deprecation_note_names_the_new_form():
    with pytest.warns(DeprecationWarning, match=r"tis_cap= -> corrections=\[TIS\(cap\)\]"):
        GRPOLoss(token_policy(), tis_cap=2.0)
    with warnings.catch_warnings():  # torchrl's own keywords are not deprecated
        warnings.simplefilter("error", DeprecationWarning)
        GRPOLoss(token_policy(), kl_to_ref_coeff=0.1, kl_mask_threshold=0.1)
        GRPOLoss(token_policy(), corrections=[TIS(2.0)], penalties=[KLToReference(0.1)])


def test_a_flat_keyword_and_an_object_of_one_slot():
    # the flat keyword rebuilds the slot: the object given is replaced, not doubled
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        loss = GRPOLoss(token_policy(), corrections=[TIS(2.0)], tis_cap=1.5)
    assert loss.variants == (TIS(1.5),)
    assert loss.tis_cap.item() == 1.5


def test_from_keywords_keeps_what_is_not_given():
    objective, variants = from_keywords(
        {"trust_region_bounds": 0.1}, Clip(), (TrustRegion("dppo_kl"),)
    )
    assert variants == (TrustRegion("dppo_kl", 0.1),)
    _, variants = from_keywords({"trust_region": None}, objective, variants)
    assert variants == ()  # a main keyword given as None removes the slot's variant
    _, variants = from_keywords({"entropy_coeff_step": 0.1}, Clip(), (EntropyTarget(0.5),))
    assert variants == (EntropyTarget(0.5, step=0.1),)


class TestPresets:
    def test_presets_hold_objects(self):
        loss = DPPOLoss(token_policy())
        assert loss.objective.title == "CISPO" and loss.variants == (TrustRegion("dppo_tv"),)
        assert SAPOLoss(token_policy()).objective == SAPO()

    def test_the_callers_variants_join_the_presets_by_slot(self):
        joined = DPPOLoss(token_policy(), corrections=[TIS(2.0)])
        assert joined.variants == (TrustRegion("dppo_tv"), TIS(2.0))
        replaced = DPPOLoss(token_policy(), corrections=[TrustRegion("dppo_kl")])
        assert replaced.variants == (TrustRegion("dppo_kl"),)
        assert DPPOLoss(token_policy(), corrections=None).variants == (TrustRegion("dppo_tv"),)

    def test_flat_keywords_still_change_a_presets_variant(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert DPPOLoss(token_policy(), trust_region_bounds=0.1).variants == (
                TrustRegion("dppo_tv", 0.1),
            )
            assert DPPOLoss(token_policy(), trust_region="dppo_kl").variants == (
                TrustRegion("dppo_kl"),
            )
            assert SAPOLoss(token_policy(), sapo_temperature_neg=2.0).objective == SAPO(1.0, 2.0)
