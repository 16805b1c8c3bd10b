"""Tests of torchrl_grpo/launches.py: operators and host synchronisations counted at the
dispatcher, forward and backward."""

import torch

from torchrl_grpo.launches import Launches, count_launches


class TestCountLaunches:
    def test_backward_operators_are_counted(self):
        x = torch.randn(8, requires_grad=True)
        with count_launches() as forward_only:
            (x.exp() * 2).sum()
        with count_launches() as both:
            (x.exp() * 2).sum().backward()
        assert both.ops > forward_only.ops >= 3
        assert both.by_op["aten.exp.default"] == 1 and both.syncs == 0

    def test_every_host_read_is_a_sync(self):
        x = torch.randn(6)
        with count_launches() as launches:
            x[x > 0]  # a boolean index: nonzero inside
            (x > 0).nonzero()
            float(x.sum())
            bool((x > 0).any())
            x.tolist()
            x.numpy()
            torch.equal(x, x)
        assert launches.syncs == 7
        assert set(launches.by_sync) == {
            "index",
            "nonzero",
            "_local_scalar_dense",
            "tolist",
            "numpy",
            "equal",
        }

    def test_known_sizes_are_not_syncs(self):
        x = torch.arange(4)
        with count_launches() as launches:
            x.repeat_interleave(torch.tensor([1, 2, 0, 1]), output_size=4)
            x[torch.tensor([0, 2])]
        assert launches.syncs == 0 and launches.uploads == 2  # two tensors made from lists

    def test_without_output_size_repeat_interleave_waits(self):
        with count_launches() as launches:
            torch.arange(3).repeat_interleave(torch.tensor([1, 2, 0]))
        assert launches.by_sync == {"repeat_interleave": 1}

    def test_nothing_counted_outside_the_block(self):
        with count_launches() as launches:
            pass
        torch.ones(3).sum().item()
        assert launches == Launches()
