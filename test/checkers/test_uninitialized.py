"""Nothing in the offload reads memory it did not write.

On the CPU a fresh ``torch.empty`` is usually zero, on CUDA it holds what the
caching allocator's last tensor left. ``poisoned_alloc.PoisonedAlloc`` fills
every uninitialized allocation with a byte pattern instead; the one-request-
at-a-time run with the settings that read wrong KV on the H200 must pass
under it, every page table checked against the KV written. Its own tests
show the pattern reaches the tensors, and that a read of an unwritten
element then changes the result.
"""

import unittest

import torch
from offload_scenarios import (  # noqa: F401 (module fixtures)
    OneRequestAtATime,
    setUpModule,
    tearDownModule,
)
from poisoned_alloc import PoisonedAlloc


def _sum_of_first(n: int) -> int:
    # Reads one element more than it writes: the bug the mode is for.
    buf = torch.empty(n + 1, dtype=torch.int64)
    buf[:n] = torch.arange(n)
    return int(buf.sum())


class TestPoisonedAlloc(unittest.TestCase):
    def test_patterns(self):
        with PoisonedAlloc(0xFF) as mode:
            ints = torch.empty(3, dtype=torch.int32)
            floats = torch.empty_like(torch.zeros(2))
            flags = torch.zeros(2).new_empty((2,), dtype=torch.bool)
            zeros = torch.zeros(4, dtype=torch.int16)  # initialized: untouched
        self.assertEqual(ints.tolist(), [-1, -1, -1])
        self.assertTrue(bool(floats.isnan().all()))
        self.assertEqual(flags.tolist(), [True, True])
        self.assertEqual(zeros.tolist(), [0, 0, 0, 0])
        self.assertGreaterEqual(sum(mode.allocations.values()), 3)
        with PoisonedAlloc(0x5A):
            big = torch.empty(1, dtype=torch.int64)
        self.assertEqual(int(big), 0x5A5A5A5A5A5A5A5A)

    def test_unwritten_read_changes_the_result(self):
        with PoisonedAlloc(0x5A):
            poisoned = _sum_of_first(10)
        self.assertEqual(poisoned, 45 + 0x5A5A5A5A5A5A5A5A)
        with PoisonedAlloc(0xFF):
            self.assertEqual(_sum_of_first(10), 44)

    def test_bad_byte(self):
        with self.assertRaises(ValueError):
            PoisonedAlloc(256)


class TestOneRequestAtATimePoisoned(OneRequestAtATime):
    """The settings that read wrong KV on the H200 (warm units and direct
    slots at 2 units, the early swap), with every uninitialized allocation
    poisoned with large positive values (an unwritten index or count then
    points far out of range): the same page tables."""

    def test_large_positive(self):
        with PoisonedAlloc(0x5A) as mode:
            seen = self._run(2)
        self.assertEqual(seen, dict(walked=1, direct=1))
        # The run allocated through the mode.
        self.assertGreater(sum(mode.allocations.values()), 0)


if __name__ == "__main__":
    unittest.main()
