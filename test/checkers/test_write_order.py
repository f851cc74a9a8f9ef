"""Nothing in the offload depends on which of several writes to one element
wins, the CPU's last one or CUDA's unspecified one.

``duplicate_writes.DuplicateWriteOrder`` gives every repeated destination of
``x[idx] = v``, ``scatter_`` and ``index_copy_`` another winner than the
CPU's. Its own tests show it changes such a write, counts it and leaves the
others alone; the one-request-at-a-time run with the settings that read
wrong KV on the H200 must then pass unchanged, every page table checked
against the KV written. (The Triton kernels' repeated stores are
``triton_hazards``' "scatter" check.)
"""

import unittest

import torch
from duplicate_writes import DuplicateWriteOrder, describe
from offload_scenarios import (  # noqa: F401 (module fixtures)
    OneRequestAtATime,
    setUpModule,
    tearDownModule,
)


class TestDuplicateWriteOrder(unittest.TestCase):
    def test_index_put_first_wins(self):
        x = torch.zeros(4, dtype=torch.int64)
        with DuplicateWriteOrder("first") as mode:
            x[torch.tensor([1, 3, 1, 1])] = torch.tensor([5, 6, 7, 8])
        self.assertEqual(x.tolist(), [0, 5, 0, 6])
        self.assertEqual(sum(mode.conflicts.values()), 1, describe(mode))
        ((kind, where),) = mode.conflicts
        self.assertEqual(kind, "index_put")
        self.assertIn("test_index_put_first_wins", where)

    def test_without_the_mode_last_wins(self):
        # What the CPU does: the mode's tests would pass vacuously otherwise.
        x = torch.zeros(4, dtype=torch.int64)
        x[torch.tensor([1, 3, 1, 1])] = torch.tensor([5, 6, 7, 8])
        self.assertEqual(x.tolist(), [0, 8, 0, 6])

    def test_equal_values_are_no_conflict(self):
        x = torch.zeros(2, 3)
        with DuplicateWriteOrder("first") as mode:
            x[:, torch.tensor([2, 2, 0])] = 1.0
            x.scatter_(1, torch.tensor([[1, 1]]), 4.0)
        self.assertEqual(x.tolist(), [[1.0, 4.0, 1.0], [1.0, 0.0, 1.0]])
        self.assertEqual(mode.conflicts, {})
        self.assertEqual(mode.repeated["index_put"], 1)
        self.assertEqual(mode.repeated["scatter"], 1)

    def test_scatter_and_index_copy(self):
        x = torch.zeros(2, 3)
        y = torch.zeros(3, 2)
        with DuplicateWriteOrder("first") as mode:
            x.scatter_(
                1, torch.tensor([[0, 0, 2], [1, 1, 1]]), torch.arange(6.0).view(2, 3)
            )
            y.index_copy_(
                0, torch.tensor([2, 2]), torch.tensor([[1.0, 2.0], [3.0, 4.0]])
            )
            z = torch.zeros(3).index_put(
                (torch.tensor([0, 0]),), torch.tensor([9.0, 1.0])
            )
        self.assertEqual(x.tolist(), [[0.0, 0.0, 2.0], [0.0, 3.0, 0.0]])
        self.assertEqual(y.tolist(), [[0.0, 0.0], [0.0, 0.0], [1.0, 2.0]])
        self.assertEqual(z.tolist(), [9.0, 0.0, 0.0])
        # Counted per element: row 2 of y is two.
        self.assertEqual(sum(mode.conflicts.values()), 5, describe(mode))

    def test_random_winner(self):
        # Over seeds, each entry of a 3-way conflict wins sometimes.
        won = set()
        for seed in range(32):
            x = torch.zeros(1, dtype=torch.int64)
            with DuplicateWriteOrder("random", seed=seed):
                x[torch.tensor([0, 0, 0])] = torch.tensor([1, 2, 3])
            won.add(int(x))
        self.assertEqual(won, {1, 2, 3})

    def test_non_contiguous_and_accumulate(self):
        x = torch.zeros(3, 4).t()  # non-contiguous
        with DuplicateWriteOrder("first") as mode:
            x[torch.tensor([1, 1]), torch.tensor([2, 2])] = torch.tensor([5.0, 6.0])
            x.index_put_((torch.tensor([0, 0]),), torch.tensor(1.0), accumulate=True)
        self.assertEqual(x[1, 2].item(), 5.0)
        self.assertEqual(x[0].tolist(), [2.0, 2.0, 2.0])
        self.assertEqual(mode.writes["index_put"], 1)  # the accumulate is left alone


class TestOneRequestAtATimeWriteOrder(OneRequestAtATime):
    """The settings that read wrong KV on the H200 (warm units and direct
    slots at 2 units, the early swap), every repeated indexed write resolved
    unlike the CPU does (the first wins): the same page tables."""

    def test_first_wins(self):
        with DuplicateWriteOrder("first") as mode:
            seen = self._run(2)
        self.assertEqual(seen, dict(walked=1, direct=1))
        # The run wrote through the mode (it is not bypassed), and wrote no
        # element twice with different values: no winner to depend on.
        self.assertGreater(mode.writes["index_put"], 0)
        self.assertGreater(mode.writes["scatter"], 0)
        self.assertEqual(mode.conflicts, {}, describe(mode))


if __name__ == "__main__":
    unittest.main()
