"""On-policy distillation's math (torchrl_grpo/advantages/distillation.py) against references
written out here, loops over tokens, and against the peers' own functions transcribed in
test/helpers/distillation_peers.py (Tinker's discounted future sum, Trinity-RFT's and NeMo-RL's
per-token advantage)."""

import math

import pytest
import torch
from helpers.distillation_peers import (
    nemo_opd_advantage,
    tinker_discounted_future_sum,
    trinity_compute_opd_advantage,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrl_grpo.advantages import (
    distillation_advantage,
    distillation_metrics,
    future_reverse_kl,
    group_mean_baseline,
    token_reverse_kl,
)


def reference_future(kl, lengths, gamma, positions=None):
    """``D_t = sum_{k >= t} gamma^(p_k - p_t) d_k`` in each trajectory, a loop over tokens."""
    out, at = [], 0
    for n in lengths:
        d = kl[at : at + n]
        p = list(range(n)) if positions is None else positions[at : at + n]
        for t in range(n):
            out.append(sum(gamma ** (p[k] - p[t]) * d[k] for k in range(t, n)))
        at += n
    return torch.tensor(out, dtype=torch.float64)


class TestTokenReverseKL:
    def test_by_hand(self):
        got = token_reverse_kl(torch.tensor([-1.0, -0.5]), torch.tensor([-2.0, -0.25]))
        assert got.tolist() == [1.0, -0.25] and got.dtype == torch.float64

    def test_is_minus_trinity_and_nemo_advantage(self):
        g = torch.Generator().manual_seed(0)
        old, teacher = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
        mask = torch.ones(3, 5, dtype=torch.bool)
        trinity, _ = trinity_compute_opd_advantage(old, teacher, mask, mask, 1.0)
        nemo, _ = nemo_opd_advantage(teacher, old, mask.float())
        torch.testing.assert_close(-token_reverse_kl(old, teacher), trinity.double())
        torch.testing.assert_close(-token_reverse_kl(old, teacher), nemo.double())

    def test_shapes_must_match(self):
        with pytest.raises(ValueError, match="one shape"):
            token_reverse_kl(torch.zeros(3), torch.zeros(4))


class TestFutureReverseKL:
    def test_by_hand(self):
        kl, lengths = torch.tensor([1.0, 2.0, 4.0, 3.0]), torch.tensor([3, 1])
        got = future_reverse_kl(kl, lengths, 0.5)
        assert got.tolist() == [1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4.0, 3.0]

    def test_gamma_zero_is_the_token_kl(self):
        kl = torch.tensor([1.0, -2.0, 0.5])
        got = future_reverse_kl(kl, torch.tensor([2, 1]), 0.0, positions=torch.tensor([0, 5, 1]))
        assert got.tolist() == kl.tolist()

    @settings(max_examples=50, deadline=None)
    @given(
        lengths=st.lists(st.integers(0, 12), min_size=1, max_size=6),
        gamma=st.floats(0.0, 1.0),
        seed=st.integers(0, 2**16),
        gaps=st.booleans(),
    )
    def test_equals_the_loop(self, lengths, gamma, seed, gaps):
        g = torch.Generator().manual_seed(seed)
        total = sum(lengths)
        kl = torch.randn(total, generator=g, dtype=torch.float64)
        positions = None
        if gaps:  # tokens between the responses: increasing positions with gaps of 0 to 3
            steps = 1 + torch.randint(0, 4, (total,), generator=g)
            positions = torch.cat(
                [torch.cumsum(s, 0) for s in steps.split(lengths)] or [torch.zeros(0)]
            ).long()
        got = future_reverse_kl(kl, torch.tensor(lengths), gamma, positions=positions)
        p = None if positions is None else positions.tolist()
        want = reference_future(kl.tolist(), lengths, gamma, p)
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)

    @pytest.mark.parametrize("gamma", [0.0, 0.5, 0.99, 1.0])
    def test_equals_tinker_on_its_sequence(self, gamma):
        """Tinker's discounted sum over a whole sequence (zeros off the responses) read at the
        responses' positions is this package's sum over the responses with their positions."""
        g = torch.Generator().manual_seed(1)
        sequence = torch.randn(30, generator=g, dtype=torch.float64)
        response = torch.zeros(30, dtype=torch.bool)
        response[[3, 4, 5, 11, 12, 20, 21, 22, 29]] = True
        sequence[~response] = 0.0
        want = tinker_discounted_future_sum(sequence, gamma)[response]
        positions = response.nonzero().squeeze(1)
        got = future_reverse_kl(sequence[response], torch.tensor([9]), gamma, positions=positions)
        torch.testing.assert_close(got, want)

    def test_positions_must_increase(self):
        with pytest.raises(ValueError, match="trajectory 1's do not"):
            future_reverse_kl(
                torch.zeros(4), torch.tensor([2, 2]), 0.5, positions=torch.tensor([0, 1, 3, 3])
            )

    def test_bad_gamma(self):
        with pytest.raises(ValueError, match="gamma"):
            future_reverse_kl(torch.zeros(2), torch.tensor([2]), 1.5)


class TestDistillationAdvantage:
    def test_by_hand(self):
        kl, group = torch.tensor([0.5, -1.0]), torch.tensor([2.0, 2.0])
        got = distillation_advantage(kl, beta=0.5, alpha=1.0, group_advantage=group)
        assert got.tolist() == [2.0 - 0.25, 2.0 + 0.5]
        assert distillation_advantage(kl, beta=1.0).tolist() == [-0.5, 1.0]

    @pytest.mark.parametrize(
        "kw, match",
        [
            (dict(beta=-1.0), "beta must be finite and at least 0"),
            (dict(beta=math.nan), "beta must be finite"),
            (dict(beta=math.inf), "beta must be finite"),
            (dict(beta=1.0, alpha=math.nan), "alpha must be finite"),
            (dict(beta=1.0, alpha=-1.0), "alpha must be finite and at least 0"),
            (dict(beta=1.0, alpha=1.0), "needs group_advantage"),
            (dict(beta=1.0, alpha=1.0, group_advantage=torch.zeros(3)), r"got \(3,\)"),
        ],
    )
    def test_bad_weights(self, kw, match):
        with pytest.raises(ValueError, match=match):
            distillation_advantage(torch.zeros(2), **kw)


class TestGroupMeanBaseline:
    def test_by_hand(self):
        d, group = torch.tensor([1.0, 2.0, 6.0, -1.0]), torch.tensor([1, 0, 1, 0])
        assert group_mean_baseline(d, group, 3).tolist() == [3.5, 0.5, 3.5, 0.5]

    def test_centres_the_teachers_term_in_every_group(self):
        g = torch.Generator().manual_seed(0)
        d, group = torch.randn(40, generator=g), torch.randint(5, (40,), generator=g)
        adv = distillation_advantage(d, beta=0.7, baseline=group_mean_baseline(d, group, 5))
        sums = torch.zeros(5, dtype=torch.float64).index_add_(0, group, adv)
        torch.testing.assert_close(sums, torch.zeros_like(sums), atol=1e-12, rtol=0)
        # a constant within a group: the advantages differ from the uncentred ones by one shift
        shift = adv - distillation_advantage(d, beta=0.7)
        for k in range(5):
            assert torch.allclose(shift[group == k], shift[group == k][0])

    def test_shapes_must_match(self):
        with pytest.raises(ValueError, match="group must have the shape"):
            group_mean_baseline(torch.zeros(3), torch.zeros(2, dtype=torch.long), 1)
        with pytest.raises(ValueError, match="baseline must have the shape"):
            distillation_advantage(torch.zeros(3), beta=1.0, baseline=torch.zeros(2))


class TestDistillationMetrics:
    def test_against_the_definitions(self):
        g = torch.Generator().manual_seed(2)
        student, teacher = -torch.rand(10, generator=g), -torch.rand(10, generator=g)
        lengths, trajectories = torch.tensor([3, 1, 4, 2]), torch.tensor([1, 3])
        got = distillation_metrics(student, teacher, lengths, trajectory_lengths=trajectories)
        d = (student - teacher).double()
        sequences = torch.stack([s.sum() for s in d.split([3, 1, 4, 2])])
        trajectory = torch.stack([sequences[:1].sum(), sequences[1:].sum()])
        want = {
            "kl_token_mean": d.mean(),
            "kl_token_std": d.std(),
            "kl_sequence_mean": sequences.mean(),
            "kl_sequence_std": sequences.std(),
            "teacher_more_likely": (teacher > student).double().mean(),
            "kl_trajectory_mean": trajectory.mean(),
            "kl_trajectory_std": trajectory.std(),
        }
        assert got.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, msg=name)

    def test_nothing_and_one(self):
        none = distillation_metrics(
            torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long)
        )
        assert all(float(v) == 0.0 for v in none.values())
        one = distillation_metrics(torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([1]))
        assert float(one["kl_token_std"]) == 0.0 and float(one["kl_token_mean"]) == 1.0
