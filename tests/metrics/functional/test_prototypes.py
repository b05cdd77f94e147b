"""MO-FedProto prototype maths against hand-computed values and plain-Python references."""

import math

import pytest
import torch

from fedlight.metrics.functional import (
    aggregate_mean_margin,
    aggregate_mean_margin_as_written,
    aggregate_prototypes,
    attention_weights,
    class_feature_sums,
    class_prototypes,
    client_deviation,
    minmax_normalize,
    prototypes_from_sums,
    semantic_prototype_margin,
)

# Three classes in 2-D whose pairwise distances are the 3-4-5 triangle.
P_I = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
# The same, with class 2 moved by 3 to (3, 4).
P_J = torch.tensor([[0.0, 0.0], [3.0, 0.0], [3.0, 4.0]])
ALL = torch.tensor([5, 5, 5])


def sigmoid(value: float) -> float:
    return 1 / (1 + math.exp(-value))


def reference_margin(p_i, p_j, n_i, n_j):
    """Eqs. 5–7 with loops over classes, straight from the paper's definitions."""
    present = [c for c in range(len(p_i)) if n_i[c] > 0 and n_j[c] > 0]
    margins = [0.0] * len(p_i)
    if len(present) <= 1:
        return margins
    for c in present:
        d_plus = math.dist(p_i[c], p_j[c])
        others = [math.dist(p_i[c], p_j[o]) for o in present if o != c]
        d_minus = sum(others) / len(others)
        margins[c] = 0.0 if d_plus + d_minus == 0 else (d_minus - d_plus) / (d_minus + d_plus)
    return margins


# --- Eq. 4: prototypes -------------------------------------------------------------------------------


def test_class_prototypes_hand_example_with_ignore_index_and_absent_class():
    features = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [9.0, 9.0]])
    targets = torch.tensor([0, 0, 2, 255, 255])
    prototypes, counts = class_prototypes(features, targets, num_classes=3, ignore_index=255)
    torch.testing.assert_close(prototypes, torch.tensor([[2.0, 3.0], [0.0, 0.0], [5.0, 6.0]]))
    assert counts.tolist() == [2, 0, 1]
    assert counts.dtype == torch.int64


def test_class_prototypes_match_loop_reference():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(200, 5, generator=generator)
    targets = torch.randint(0, 6, (200,), generator=generator)
    targets[targets == 4] = 5  # class 4 absent
    prototypes, counts = class_prototypes(features, targets, num_classes=6)
    for c in range(6):
        members = features[targets == c]
        assert counts[c] == len(members)
        expected = members.mean(0) if len(members) else torch.zeros(5)
        torch.testing.assert_close(prototypes[c], expected)


def test_dense_prototypes_match_a_pixel_loop():
    # decoder features at 1/4 resolution; labels of 16×16 maps with void, background counted as class 0
    generator = torch.Generator().manual_seed(3)
    features = torch.rand(3, 6, 4, 4, generator=generator)  # [B, D, h, w]
    labels = torch.randint(0, 4, (3, 16, 16), generator=generator)
    labels[torch.rand(3, 16, 16, generator=generator) < 0.2] = 255
    prototypes, counts = class_prototypes(features, labels, num_classes=4, ignore_index=255)
    sums, expected_counts = torch.zeros(4, 6), [0] * 4
    for b in range(3):
        for i in range(4):
            for j in range(4):
                label = int(labels[b, 4 * i, 4 * j])  # nearest neighbour of feature pixel (i, j): input (4i, 4j)
                if label != 255:
                    sums[label] += features[b, :, i, j]
                    expected_counts[label] += 1
    assert counts.tolist() == expected_counts and counts[0] > 0
    for c in range(4):
        torch.testing.assert_close(prototypes[c], sums[c] / max(expected_counts[c], 1))


def test_dense_features_need_label_maps_of_the_same_batch():
    with pytest.raises(ValueError, match=r"features \[B, D, h, w\] and targets \[B, H, W\]"):
        class_feature_sums(torch.zeros(2, 3, 4, 4), torch.zeros(3, 16, 16, dtype=torch.long), 2)


def test_feature_sums_accumulate_over_batches():
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(90, 4, generator=generator)
    targets = torch.randint(0, 3, (90,), generator=generator)
    sums, counts = torch.zeros(3, 4), torch.zeros(3, dtype=torch.long)
    for batch_features, batch_targets in zip(features.split(32), targets.split(32), strict=True):
        batch_sums, batch_counts = class_feature_sums(batch_features, batch_targets, 3)
        sums += batch_sums
        counts += batch_counts
    prototypes, full_counts = class_prototypes(features, targets, 3)
    torch.testing.assert_close(prototypes_from_sums(sums, counts), prototypes)
    assert counts.tolist() == full_counts.tolist()


def test_half_precision_features_accumulate_in_float32():
    features = torch.full((4, 2), 0.5, dtype=torch.float16)
    prototypes, _ = class_prototypes(features, torch.tensor([1, 1, 1, 1]), 2)
    assert prototypes.dtype == torch.float32
    torch.testing.assert_close(prototypes, torch.tensor([[0.0, 0.0], [0.5, 0.5]]))


def test_class_prototypes_reject_bad_labels():
    with pytest.raises(ValueError, match=r"labels in \[0, 3\)"):
        class_prototypes(torch.zeros(2, 2), torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="integer class labels"):
        class_prototypes(torch.zeros(2, 2), torch.tensor([0.0, 1.0]), 3)
    with pytest.raises(ValueError, match=r"features \[N, D\]"):
        class_prototypes(torch.zeros(2, 2), torch.tensor([0, 1, 2]), 3)


# --- D1: min–max normalisation ------------------------------------------------------------------------


def test_minmax_normalize_hand_example_and_constant_rows():
    prototypes = torch.tensor([[2.0, 6.0, 4.0, 3.0], [0.0, 0.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
    expected = torch.tensor([[0.0, 1.0, 0.5, 0.25], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(minmax_normalize(prototypes), expected)


def test_minmax_normalize_rows_span_zero_to_one_with_leading_dims():
    prototypes = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2)) * 10  # [K, C, D]
    normalised = minmax_normalize(prototypes)
    torch.testing.assert_close(normalised.amin(-1), torch.zeros(3, 5))
    torch.testing.assert_close(normalised.amax(-1), torch.ones(3, 5))


# --- Eqs. 5–7: semantic prototype margin ----------------------------------------------------------------


def test_margin_hand_example():
    # class 0: d⁺ = 0, d⁻ = (3 + 5) / 2 = 4 → 1
    # class 1: d⁺ = 0, d⁻ = (3 + 4) / 2 = 3.5 → 1
    # class 2: d⁺ = 3, d⁻ = (4 + 5) / 2 = 4.5 → 1.5 / 7.5 = 0.2
    margin = semantic_prototype_margin(P_I, P_J, ALL, ALL)
    torch.testing.assert_close(margin, torch.tensor([1.0, 1.0, 0.2]))


def test_margin_restricts_to_classes_present_on_both_sides():
    # C′ = {0, 2}: class 0: d⁺ = 0, d⁻ = ‖(0,0) − (3,4)‖ = 5 → 1; class 2: d⁺ = 3, d⁻ = ‖(0,4)‖ = 4 → 1/7
    margin = semantic_prototype_margin(P_I, P_J, torch.tensor([5, 5, 5]), torch.tensor([5, 0, 2]))
    torch.testing.assert_close(margin, torch.tensor([1.0, 0.0, 1 / 7]))


@pytest.mark.parametrize("n_j", [[5, 0, 0], [0, 0, 0]])
def test_margin_is_zero_when_at_most_one_shared_class(n_j):
    margin = semantic_prototype_margin(P_I, P_J, ALL, torch.tensor(n_j))
    assert margin.tolist() == [0.0, 0.0, 0.0]
    assert client_deviation(margin).item() == 0.5  # σ(0)


def test_margin_zero_over_zero_is_zero():
    identical = torch.ones(3, 2)  # d⁺ = d⁻ = 0 for every class
    margin = semantic_prototype_margin(identical, identical, ALL, ALL)
    assert margin.tolist() == [0.0, 0.0, 0.0]
    assert not margin.isnan().any()


def test_margin_matches_loop_reference_and_is_bounded():
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        p_i, p_j = torch.rand(6, 8, generator=generator), torch.rand(6, 8, generator=generator)
        n_i, n_j = (
            torch.randint(0, 3, (6,), generator=generator),
            torch.randint(0, 3, (6,), generator=generator),
        )
        margin = semantic_prototype_margin(p_i, p_j, n_i, n_j)
        expected = reference_margin(p_i.tolist(), p_j.tolist(), n_i.tolist(), n_j.tolist())
        torch.testing.assert_close(margin, torch.tensor(expected))
        assert margin.abs().max() <= 1


def test_margin_batched_over_clients_against_shared_reference():
    generator = torch.Generator().manual_seed(4)
    local = torch.rand(4, 5, 3, generator=generator)  # [K, C, D]
    counts = torch.randint(0, 2, (4, 5), generator=generator)  # [K, C]
    aggregate, seen = torch.rand(5, 3, generator=generator), torch.tensor([True, True, False, True, True])
    margins = semantic_prototype_margin(local, aggregate, counts, seen)  # APM, Eq. 9
    for k in range(4):
        torch.testing.assert_close(margins[k], semantic_prototype_margin(local[k], aggregate, counts[k], seen))


def test_identical_prototypes_give_unit_margin_with_many_classes():
    # exact distances: d⁺ must be exactly 0 for an unchanged model, whatever C (cdist's mm path is not)
    prototypes = minmax_normalize(torch.randn(40, 256, generator=torch.Generator().manual_seed(5)))
    counts = torch.ones(40)
    torch.testing.assert_close(
        semantic_prototype_margin(prototypes, prototypes, counts, counts), torch.ones(40), rtol=0, atol=0
    )


def test_positive_only_margin_hand_example():
    # r = (‖p_i[c]‖ + ‖p_j[c]‖) / 2, μ = (r − d⁺) / (r + d⁺)
    # class 0: both zero vectors, r = d⁺ = 0 → 0/0 guard → 0
    # class 1: r = 3, d⁺ = 0 → 1
    # class 2: r = (4 + 5) / 2 = 4.5, d⁺ = 3 → 1.5 / 7.5 = 0.2
    margin = semantic_prototype_margin(P_I, P_J, ALL, ALL, use_negatives=False)
    torch.testing.assert_close(margin, torch.tensor([0.0, 1.0, 0.2]))


def test_positive_only_margin_needs_no_other_class_but_respects_presence():
    n_j = torch.tensor([0, 0, 5])  # |C′| = 1: defined without negatives
    margin = semantic_prototype_margin(P_I, P_J, ALL, n_j, use_negatives=False)
    torch.testing.assert_close(margin, torch.tensor([0.0, 0.0, 0.2]))


def test_positive_only_margin_decreases_with_distance_and_is_bounded():
    # p_j rotates away from p_i on the unit circle: r = 1 stays, d⁺ = 2 sin(θ/2) grows
    angles = torch.linspace(0, math.pi, 9)
    p_i = torch.tensor([[1.0, 0.0]]).expand(9, 1, 2)
    p_j = torch.stack([angles.cos(), angles.sin()], dim=-1).unsqueeze(1)  # [9, 1, 2]
    margin = semantic_prototype_margin(p_i, p_j, torch.ones(9, 1), torch.ones(9, 1), use_negatives=False)[:, 0]
    assert margin[0] == 1.0
    assert (margin.diff() < 0).all()
    torch.testing.assert_close(margin[-1], torch.tensor(-1 / 3))  # antipodal: (1 − 2) / (1 + 2)
    random = semantic_prototype_margin(
        torch.randn(50, 4, 6),
        torch.randn(50, 4, 6),
        torch.ones(50, 4),
        torch.ones(50, 4),
        use_negatives=False,
    )
    assert random.abs().max() <= 1


def test_positive_only_margin_is_scale_invariant():
    margin = semantic_prototype_margin(P_I, P_J, ALL, ALL, use_negatives=False)
    scaled = semantic_prototype_margin(7 * P_I, 7 * P_J, ALL, ALL, use_negatives=False)
    torch.testing.assert_close(scaled, margin)


# --- Eq. 11: client deviation ----------------------------------------------------------------------------


def test_client_deviation_sum_and_mean():
    margins = torch.tensor([[1.0, 1.0, 0.2], [1.0, 0.0, 1 / 7]])
    present = torch.tensor([[True, True, True], [True, False, True]])
    torch.testing.assert_close(client_deviation(margins), torch.tensor([sigmoid(2.2), sigmoid(8 / 7)]))
    torch.testing.assert_close(
        client_deviation(margins, "mean", present), torch.tensor([sigmoid(2.2 / 3), sigmoid(4 / 7)])
    )


def test_client_deviation_ignores_margins_outside_present_and_empty_client_is_half():
    margins = torch.tensor([[0.5, 9.0], [3.0, 3.0]])
    present = torch.tensor([[True, False], [False, False]])
    torch.testing.assert_close(client_deviation(margins, "mean", present), torch.tensor([sigmoid(0.5), 0.5]))
    torch.testing.assert_close(client_deviation(margins, "sum", present), torch.tensor([sigmoid(0.5), 0.5]))


def test_client_deviation_errors_name_the_fix():
    with pytest.raises(ValueError, match="present"):
        client_deviation(torch.zeros(2, 3), "mean")
    with pytest.raises(ValueError, match="'sum' or 'mean'"):
        client_deviation(torch.zeros(2, 3), "max")


# --- Eqs. 12–13: attention --------------------------------------------------------------------------------


def test_attention_first_round_is_fedavg():
    weights = attention_weights(torch.tensor([0.9, 0.1, 0.5]), None, torch.tensor([10, 30, 60]), True)
    torch.testing.assert_close(weights, torch.tensor([0.1, 0.3, 0.6]))


def test_attention_averages_normalised_loc_and_agg():
    v_loc, v_agg = torch.tensor([1.0, 1.0, 2.0]), torch.tensor([3.0, 1.0, 0.0])
    # a_loc = [1/4, 1/4, 1/2], a_agg = [3/4, 1/4, 0] → mean [1/2, 1/4, 1/4]
    weights = attention_weights(v_loc, v_agg, torch.tensor([1, 1, 1]), first_round=False)
    torch.testing.assert_close(weights, torch.tensor([0.5, 0.25, 0.25]))


def test_attention_single_clue_ablations():
    v = torch.tensor([1.0, 3.0])
    torch.testing.assert_close(attention_weights(v, None, torch.tensor([5, 5]), False), torch.tensor([0.25, 0.75]))
    torch.testing.assert_close(attention_weights(None, v, torch.tensor([5, 5]), False), torch.tensor([0.25, 0.75]))
    with pytest.raises(ValueError, match="v_loc"):
        attention_weights(None, None, torch.tensor([5, 5]), False)
    with pytest.raises(ValueError, match="shape"):
        attention_weights(torch.ones(3), None, torch.tensor([5, 5]), False)


def test_attention_sums_to_one():
    generator = torch.Generator().manual_seed(6)
    v_loc, v_agg = torch.rand(10, generator=generator), torch.rand(10, generator=generator)
    num_samples = torch.randint(1, 100, (10,), generator=generator)
    for first_round in (True, False):
        weights = attention_weights(v_loc, v_agg, num_samples, first_round)
        torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
        assert (weights >= 0).all()


# --- Eq. 10 and D2: aggregate prototypes ---------------------------------------------------------------


def test_aggregate_prototypes_hand_example_with_carry_over():
    prototypes = torch.tensor(
        [
            [[1.0, 1.0], [2.0, 0.0], [0.0, 0.0], [0.0, 0.0]],
            [[3.0, 3.0], [6.0, 4.0], [0.0, 0.0], [0.0, 0.0]],
        ]
    )  # [K=2, C=4, D=2]
    counts = torch.tensor([[1, 3, 0, 0], [3, 1, 0, 0]])
    previous = torch.tensor([[9.0, 9.0], [9.0, 9.0], [7.0, 8.0], [5.0, 5.0]])
    previous_seen = torch.tensor([True, True, True, False])  # class 3 was never seen: its row is stale
    p_agg, n_agg, seen = aggregate_prototypes(prototypes, counts, previous, previous_seen)
    # class 0: (1·(1,1) + 3·(3,3)) / 4 = (2.5, 2.5); class 1: (3·(2,0) + 1·(6,4)) / 4 = (3, 1)
    expected = torch.tensor([[2.5, 2.5], [3.0, 1.0], [7.0, 8.0], [0.0, 0.0]])
    torch.testing.assert_close(p_agg, expected)
    assert n_agg.tolist() == [4, 4, 0, 0]
    assert seen.tolist() == [True, True, True, False]


def test_aggregate_prototypes_without_previous_and_argument_pairing():
    p_agg, n_agg, seen = aggregate_prototypes(torch.ones(2, 2, 3), torch.tensor([[2, 0], [1, 0]]))
    torch.testing.assert_close(p_agg, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert n_agg.tolist() == [3, 0]
    assert seen.tolist() == [True, False]
    with pytest.raises(ValueError, match="together"):
        aggregate_prototypes(torch.ones(2, 2, 3), torch.ones(2, 2), previous=torch.zeros(2, 3))


def test_aggregate_of_identical_clients_is_their_prototypes():
    prototypes = torch.rand(5, 3, generator=torch.Generator().manual_seed(7))
    p_agg, _, _ = aggregate_prototypes(prototypes.expand(4, 5, 3), torch.randint(1, 9, (4, 5)))
    torch.testing.assert_close(p_agg, prototypes)


# --- D6 / Eq. 15: AMM -----------------------------------------------------------------------------------


def test_aggregate_mean_margin_hand_example():
    # d⁻ = [(3+4)/2, (3+5)/2, (4+5)/2] = [3.5, 4, 4.5], d⁺ = 0 → AMM = 12 / 3 = 4
    torch.testing.assert_close(aggregate_mean_margin(P_I, ALL), torch.tensor(4.0))
    # class 2 absent: C′ = {0, 1}, d⁻ = [3, 3] → 3
    torch.testing.assert_close(aggregate_mean_margin(P_I, torch.tensor([1, 1, 0])), torch.tensor(3.0))
    # |C′| ≤ 1 → 0
    assert aggregate_mean_margin(P_I, torch.tensor([1, 0, 0])).item() == 0.0
    assert aggregate_mean_margin(P_I, ALL).shape == ()


def test_aggregate_mean_margin_as_written_is_degenerate():
    torch.testing.assert_close(aggregate_mean_margin_as_written(P_I, ALL), torch.tensor(1.0))
    torch.testing.assert_close(aggregate_mean_margin_as_written(7 * P_I, ALL), torch.tensor(1.0))
    # (1/|C|) Σ_c μ with μ = 0 for the absent class: 2 / 3
    torch.testing.assert_close(aggregate_mean_margin_as_written(P_I, torch.tensor([1, 1, 0])), torch.tensor(2 / 3))
