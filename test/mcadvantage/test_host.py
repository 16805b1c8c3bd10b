"""Tests of torchrl_grpo/mcadvantage/host.py: many integers read with one synchronisation."""

import torch

from torchrl_grpo.launches import count_launches
from torchrl_grpo.mcadvantage.host import read_ints


class TestReadInts:
    def test_scalars_vectors_and_plain_values_in_order(self):
        done = torch.tensor([False, True, True])
        values = read_ints(done.sum(), None, torch.tensor([5, 6]), done.all(), 3, done.long())
        assert values == [2, None, [5, 6], 0, 3, [0, 1, 1]]

    def test_one_synchronisation_for_all(self):
        x = torch.arange(10)
        with count_launches() as launches:
            read_ints(x.sum(), x.max(), x > 4, x.min())
        assert launches.syncs == 1

    def test_one_value_is_read_without_an_operator(self):
        x = torch.arange(4).sum()
        with count_launches() as launches:
            assert read_ints(x) == [6]
        assert (launches.ops, launches.syncs) == (0, 1)

    def test_nothing_to_read(self):
        with count_launches() as launches:
            assert read_ints(1, None) == [1, None]
        assert launches.syncs == 0
