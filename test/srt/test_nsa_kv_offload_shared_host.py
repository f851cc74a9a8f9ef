"""One host pool for the attention-TP ranks of a node (decode NSA KV offload, CPU).

With attention TP every rank holds the same MLA KV, so the ranks of a group
share one host pool (``nsa_kv_offload_shared_host``): rank 0 creates it and
writes it, the others map it and only read (docs/MULTI_GPU.md, design (a)).

* the segment alone, in one process: create / attach by path / seal, the
  header check, the host pool built on it;
* the attention-TP ranks as spawned CPU processes joined by gloo
  (``multi_rank_sim``), through the real pools and coordinator: every rank
  maps the same bytes; a rank with another layout makes every rank fail (none
  hangs); a lifecycle with chunked prefill, misses, finish and slot reuse in
  which every reader's page tables read exactly the KV rank 0 wrote, and the
  readers write nothing; and a negative control in which the readers warm a
  new request from host memory before rank 0 has written it, which the
  checks must catch.
"""

import shutil
import tempfile
import unittest

import torch
from sglang.srt.mem_cache.nsa_kv_offload_shared_host import (
    HEADER_BYTES,
    SharedHostLayout,
    SharedHostSegment,
)
from sglang.srt.mem_cache.nsa_kv_only_host_pool import NSAKVOnlyTokenToKVPoolHost

PAGE = 64
# Rank 0 (the writer) and one reader: each spawned rank imports sglang
# (~10 CPU-seconds on CPU), so no more ranks than the checks need.
WORLD = 2


class TestSharedHostSegment(unittest.TestCase):
    LAYOUT = SharedHostLayout(layer_num=2, num_rows=3 * PAGE, row_bytes=656)

    def test_attach_sees_the_same_bytes(self):
        owner = SharedHostSegment.create(self.LAYOUT)
        self.assertTrue(owner.is_owner)
        rows = owner.tensor()
        self.assertEqual(tuple(rows.shape), self.LAYOUT.shape)
        self.assertTrue(bool((rows == 0).all()))  # zero-filled
        reader = SharedHostSegment.attach(owner.path, self.LAYOUT)
        self.assertFalse(reader.is_owner)
        self.assertNotEqual(reader.tensor().data_ptr(), rows.data_ptr())
        rows[1, 5] = torch.arange(656, dtype=torch.int64).to(torch.uint8)
        self.assertTrue(torch.equal(reader.tensor()[1, 5], rows[1, 5]))
        reader.tensor()[0, 7] = 9  # shared both ways (readers never write)
        self.assertTrue(bool((rows[0, 7] == 9).all()))
        before = rows.clone()
        # Touches one byte per page of each share (before anything is
        # written, in the rendezvous): zeros stay zeros, and every page is in
        # a share.
        rows.zero_()
        reader.prefault(1, 2)
        owner.prefault(0, 2)
        self.assertTrue(bool((rows == 0).all()))
        rows.copy_(before)
        # Sealed: the descriptor is gone, nobody can attach any more, the
        # mappings keep the memory.
        path = owner.path
        owner.seal()
        with self.assertRaises(OSError):
            SharedHostSegment.attach(path, self.LAYOUT)
        self.assertTrue(torch.equal(reader.tensor()[1, 5], rows[1, 5]))

    def test_attach_checks_the_layout(self):
        owner = SharedHostSegment.create(self.LAYOUT)
        other = SharedHostLayout(layer_num=2, num_rows=4 * PAGE, row_bytes=656)
        with self.assertRaisesRegex(ValueError, "bytes, expected"):
            SharedHostSegment.attach(owner.path, other)
        # Same size, other shape: the header tells.
        swapped = SharedHostLayout(layer_num=3, num_rows=2 * PAGE, row_bytes=656)
        with self.assertRaisesRegex(ValueError, r"rows \(2, 192, 656\), expected"):
            SharedHostSegment.attach(owner.path, swapped)
        # Not a segment at all.
        with tempfile.NamedTemporaryFile() as f:
            f.truncate(HEADER_BYTES + self.LAYOUT.data_bytes)
            f.flush()
            with self.assertRaisesRegex(ValueError, "expected"):
                SharedHostSegment.attach(f.name, self.LAYOUT)
        owner.close()

    def test_host_pool_on_a_segment(self):
        shape = NSAKVOnlyTokenToKVPoolHost.buffer_shape(
            size=100, page_size=PAGE, layer_num=2, row_bytes=656
        )
        self.assertEqual(shape, (2, 3 * PAGE, 656))  # 100 -> 128 locs + a page
        owner = SharedHostSegment.create(SharedHostLayout(*shape))
        reader = SharedHostSegment.attach(owner.path, SharedHostLayout(*shape))
        pools = [
            NSAKVOnlyTokenToKVPoolHost(
                size=100,
                page_size=PAGE,
                layer_num=2,
                row_bytes=656,
                start_layer=4,
                shared_segment=seg,
            )
            for seg in (owner, reader)
        ]
        for pool in pools:
            self.assertEqual(tuple(pool.kv_buffer.shape), shape)
        pools[0].get_kv_buffer(5)[70] = 3
        self.assertTrue(bool((pools[1].get_kv_buffer(5)[70] == 3).all()))
        ptrs, lens, _ = pools[1].get_contiguous_buf_infos()
        self.assertEqual(ptrs[1], pools[1].get_kv_buffer(5).data_ptr())
        self.assertEqual(lens, [3 * PAGE * 656] * 2)
        with self.assertRaisesRegex(ValueError, "shared segment rows"):
            NSAKVOnlyTokenToKVPoolHost(
                size=200,
                page_size=PAGE,
                layer_num=2,
                row_bytes=656,
                shared_segment=owner,
            )
        with self.assertRaisesRegex(ValueError, "pin_method=register"):
            NSAKVOnlyTokenToKVPoolHost(
                size=100,
                page_size=PAGE,
                layer_num=2,
                row_bytes=656,
                pin_method="torch",
                shared_segment=owner,
            )


class TestAttentionTPRanks(unittest.TestCase):
    """WORLD attention-TP ranks as spawned processes (see multi_rank_sim)."""

    SCENARIOS = (
        "segment",
        "layout_mismatch",
        "lifecycle",
        "lifecycle_units",
        "naive_warm",
    )

    @classmethod
    def setUpClass(cls):
        import multi_rank_sim

        cls.tmp_dir = tempfile.mkdtemp()
        cls.results = multi_rank_sim.run_ranks(WORLD, cls.SCENARIOS, cls.tmp_dir)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp_dir, ignore_errors=True)

    def _results(self, name):
        return [self.results[(name, r)] for r in range(WORLD)]

    def test_ranks(self):
        # One test over the ranks' one run: pytest-xdist's worksteal would
        # start the spawned ranks again (~12 s) for each test it moves.
        for check in (
            self.check_every_rank_maps_the_same_bytes,
            self.check_a_mismatching_rank_fails_them_all,
            self.check_lifecycle_reads_rank_0s_rows,
            self.check_lifecycle_with_units,
            self.check_negative_control_is_caught,
        ):
            with self.subTest(check=check.__name__):
                check()

    def check_every_rank_maps_the_same_bytes(self):
        results = self._results("segment")
        for r in results:
            self.assertTrue(r.startswith("ok "), results)
        digests = {r.split()[1] for r in results}
        self.assertEqual(len(digests), 1, results)
        # Each rank its own mapping of them.
        self.assertEqual(len({r.split()[2] for r in results}), WORLD, results)

    def check_a_mismatching_rank_fails_them_all(self):
        results = self._results("layout_mismatch")
        for r in results:
            self.assertTrue(r.startswith("raised "), results)
            self.assertIn(f"rank {WORLD - 1}: shared host KV at /proc/", r)

    def _check_lifecycle(self, name):
        results = self._results(name)
        for r in results:
            self.assertTrue(r.startswith("ok "), results)
        fields = [dict(kv.split("=") for kv in r.split()[1:]) for r in results]
        # Every rank loaded its misses (and warm rows: none on readers) from
        # host memory ...
        for f in fields:
            self.assertGreater(int(f["h2d_rows"]), 0, results)
        # ... which only rank 0 wrote.
        self.assertGreater(int(fields[0]["d2h_rows"]), 0, results)
        for f in fields[1:]:
            self.assertEqual(int(f["d2h_rows"]), 0, results)
        self.assertEqual(len({f["host"] for f in fields}), 1, results)
        # A shared host pool's options: direct slots on (B is warmed from its
        # staging rows into slots 0..n-1 on every rank), warm units off.
        self.assertEqual({f["direct"] for f in fields}, {"01"}, results)

    def check_lifecycle_reads_rank_0s_rows(self):
        self._check_lifecycle("lifecycle")

    def check_lifecycle_with_units(self):
        self._check_lifecycle("lifecycle_units")

    def check_negative_control_is_caught(self):
        # Readers that warm from host memory before rank 0's backup read
        # zeros instead of the prompt's KV; rank 0 (its own backup first) is
        # right.
        results = self._results("naive_warm")
        self.assertEqual(results[0], "ok", results)
        for r in results[1:]:
            self.assertTrue(r.startswith("failed AssertionError"), results)
            self.assertIn("read wrong KV", r)


if __name__ == "__main__":
    unittest.main()
