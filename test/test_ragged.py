"""Tests of torchrl_grpo/ragged.py: padding and unpadding ragged rows at a fixed cost."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils.rnn import pad_sequence

from torchrl_grpo.launches import count_launches
from torchrl_grpo.ragged import host_rows, padded, padded_index, rows_of, upload

lengths_lists = st.lists(st.integers(0, 7), min_size=1, max_size=10).filter(lambda x: max(x) > 0)


class TestPadded:
    @settings(max_examples=40, deadline=None)
    @given(lengths_lists, st.sampled_from(["left", "right"]), st.integers(0, 3))
    def test_equals_pad_sequence(self, lengths, side, extra):
        rows = [torch.randn(n, 2) for n in lengths]
        width = max(lengths) + extra
        ours = padded(rows, -1.0, side, width=width)
        theirs = pad_sequence(rows, batch_first=True, padding_value=-1.0, padding_side=side)
        pad = (0, 0, extra, 0) if side == "left" else (0, 0, 0, extra)
        theirs = torch.nn.functional.pad(theirs, pad, value=-1.0)
        torch.testing.assert_close(ours, theirs)

    def test_a_fixed_number_of_operators(self):
        counts = []
        for n in (4, 64):
            rows = [torch.arange(k % 7 + 1) for k in range(n)]
            with count_launches() as launches:
                padded(rows, 0)
            counts.append(launches)
        assert counts[0].ops == counts[1].ops <= 5 and counts[1].syncs == 0

    def test_rows_of_one_length_are_stacked(self):
        rows = [torch.arange(3), torch.arange(3) + 3]
        with count_launches() as launches:
            out = padded(rows)
        assert out.tolist() == [[0, 1, 2], [3, 4, 5]] and launches.ops == 1

    def test_a_width_shorter_than_a_row_is_refused(self):
        with pytest.raises(ValueError, match="width 2 is shorter than the longest row .3."):
            padded([torch.arange(3)], width=2)


class TestRowsOf:
    @settings(max_examples=40, deadline=None)
    @given(lengths_lists, st.sampled_from(["left", "right"]))
    def test_inverse_of_padded(self, lengths, side):
        rows = [torch.randn(n) for n in lengths]
        back = rows_of(padded(rows, 0.0, side), lengths, side)
        assert len(back) == len(rows)
        for a, b in zip(back, rows, strict=True):
            torch.testing.assert_close(a, b)

    def test_a_fixed_number_of_operators(self):
        counts = []
        for n in (4, 64):
            x = torch.randn(n, 9)
            with count_launches() as launches:
                rows_of(x, [k % 9 + 1 for k in range(n)])
            counts.append(launches.ops)
        assert counts[0] == counts[1] <= 4


class TestPaddedIndex:
    def test_left_and_right(self):
        assert padded_index([2, 0, 3], 3).tolist() == [1, 2, 6, 7, 8]
        assert padded_index([2, 0, 3], 3, side="right").tolist() == [0, 1, 6, 7, 8]

    def test_bad_side(self):
        with pytest.raises(ValueError, match="side must be 'left' or 'right'"):
            padded_index([1], 1, side="middle")


class TestHostRows:
    def test_one_read_for_every_row(self):
        rows = [torch.arange(3), torch.arange(2) + 7, torch.arange(0)]
        with count_launches() as launches:
            found = host_rows(rows)
        assert [r.tolist() for r in found] == [[0, 1, 2], [7, 8], []]
        assert launches.syncs == 1
        assert host_rows([]) == []


class TestUpload:
    def test_on_the_cpu_the_array_itself(self):
        array = np.arange(4)
        out = upload(array)
        assert out.tolist() == [0, 1, 2, 3] and out.data_ptr() == array.ctypes.data

    def test_on_each_device_without_a_host_wait(self, device):
        with count_launches() as launches:
            out = upload(np.arange(4), device)
        assert out.device.type == device.type and launches.syncs == 0
        assert out.cpu().tolist() == [0, 1, 2, 3]
