"""NSAKVOnlyTokenToKVPoolHost layout and the row copy kernels of nsa_kv_offload_copy.

On a machine without CUDA the Triton kernels run in the interpreter
(TRITON_INTERPRET=1, set here before triton is imported); "host" and "device"
buffers are then both CPU tensors.
"""

import unittest
from types import SimpleNamespace
from unittest import mock

import torch
from sglang.srt.mem_cache import nsa_kv_offload_copy as skc
from sglang.srt.mem_cache import nsa_kv_only_host_pool
from sglang.srt.mem_cache.nsa_kv_only_host_pool import NSAKVOnlyTokenToKVPoolHost

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_ROW_BYTES = 656
BF16_ROW_BYTES = 1152
# Index values that must never be dereferenced (past the count).
GARBAGE_BIG = 1 << 40
GARBAGE_NEG = -(1 << 40)


def _random_rows(num_rows: int, row_bytes: int, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (num_rows, row_bytes), dtype=torch.uint8, generator=g)
    return rows.to(device)


class TestHostPoolLayout(unittest.TestCase):
    def test_row_bytes_from_device_pool(self):
        self.assertEqual(
            NSAKVOnlyTokenToKVPoolHost.get_row_bytes(656, torch.uint8), FP8_ROW_BYTES
        )
        self.assertEqual(
            NSAKVOnlyTokenToKVPoolHost.get_row_bytes(576, torch.bfloat16),
            BF16_ROW_BYTES,
        )

    def test_shape_and_rounding(self):
        pool = NSAKVOnlyTokenToKVPoolHost(
            size=1000, page_size=64, layer_num=3, row_bytes=FP8_ROW_BYTES
        )
        self.assertEqual(pool.size, 1024)  # rounded up to whole pages
        self.assertEqual(pool.page_num, 16)
        self.assertEqual(pool.num_rows, 1024 + 64)
        self.assertEqual(tuple(pool.kv_buffer.shape), (3, 1088, FP8_ROW_BYTES))
        self.assertEqual(pool.kv_buffer.dtype, torch.uint8)
        self.assertTrue(pool.kv_buffer.is_contiguous())
        self.assertEqual(pool.get_size_per_token(), 3 * FP8_ROW_BYTES)
        self.assertEqual(pool.nbytes, 3 * 1088 * FP8_ROW_BYTES)
        if not torch.cuda.is_available():
            self.assertFalse(pool.pin_memory)
            self.assertEqual(pool.pin_method, "none")

    def test_invalid_args(self):
        with self.assertRaises(ValueError):
            NSAKVOnlyTokenToKVPoolHost(size=0, page_size=64, layer_num=1, row_bytes=656)
        with self.assertRaises(ValueError):
            NSAKVOnlyTokenToKVPoolHost(
                size=64, page_size=64, layer_num=1, row_bytes=100
            )
        with self.assertRaises(ValueError):
            NSAKVOnlyTokenToKVPoolHost(
                size=64, page_size=64, layer_num=1, row_bytes=656, pin_method="x"
            )

    def test_layer_views_pointers_and_infos(self):
        pool = NSAKVOnlyTokenToKVPoolHost(
            size=128, page_size=64, layer_num=3, row_bytes=FP8_ROW_BYTES, start_layer=10
        )
        layer_bytes = pool.num_rows * FP8_ROW_BYTES
        base = pool.kv_buffer.data_ptr()
        self.assertEqual(pool.layer_ptrs.dtype, torch.int64)
        self.assertEqual(
            pool.layer_ptrs.tolist(), [base + i * layer_bytes for i in range(3)]
        )
        for i in range(3):
            view = pool.get_kv_buffer(10 + i)
            self.assertEqual(tuple(view.shape), (pool.num_rows, FP8_ROW_BYTES))
            self.assertEqual(view.data_ptr(), base + i * layer_bytes)
            view[7].fill_(i + 1)  # a view, not a copy
            self.assertTrue(bool((pool.kv_buffer[i, 7] == i + 1).all()))
        with self.assertRaises(IndexError):
            pool.get_kv_buffer(9)
        with self.assertRaises(IndexError):
            pool.get_kv_buffer(13)

        ptrs, lens, items = pool.get_contiguous_buf_infos()
        self.assertEqual(ptrs, pool.layer_ptrs.tolist())
        self.assertEqual(lens, [layer_bytes] * 3)
        self.assertEqual(items, [64 * FP8_ROW_BYTES] * 3)
        # Page p of a layer holds locs [p * 64, (p + 1) * 64): contiguous as on GPU.
        self.assertEqual(
            pool.get_kv_buffer(11)[2 * 64].data_ptr(),
            base + layer_bytes + 2 * 64 * FP8_ROW_BYTES,
        )
        self.assertEqual(pool.get_layer_ptrs(DEVICE).device.type, DEVICE)
        self.assertEqual(pool.get_layer_ptrs(DEVICE).tolist(), ptrs)
        for p in ptrs:
            self.assertEqual(p % 16, 0)

    @unittest.skipUnless(torch.cuda.is_available(), "pinning needs CUDA")
    def test_pinned(self):
        for method in ("register", "torch"):
            pool = NSAKVOnlyTokenToKVPoolHost(
                size=64, page_size=64, layer_num=2, row_bytes=656, pin_method=method
            )
            self.assertTrue(pool.pin_memory)
            pool.close()


class TestPrefaultPages(unittest.TestCase):
    """The threaded page touch before cudaHostRegister."""

    def test_touches_the_first_byte_of_every_page_only(self):
        page = 64
        for num_bytes, threads in ((10 * page + 7, 3), (4 * page, 8), (5, 2)):
            with self.subTest(num_bytes=num_bytes, threads=threads):
                buf = torch.full((num_bytes,), 7, dtype=torch.uint8)
                nsa_kv_only_host_pool.prefault_pages(buf, threads, page_bytes=page)
                touched = torch.arange(num_bytes) % page == 0
                self.assertTrue(bool((buf[touched] == 0).all()))
                self.assertTrue(bool((buf[~touched] == 7).all()))

    def test_register_follows_the_prefault(self):
        # A large private buffer is touched before it is registered; a
        # smaller one is registered as it is.
        calls = []
        cudart = SimpleNamespace(
            cudaHostRegister=lambda ptr, size, flags: calls.append("register") or 0
        )
        touch = lambda buf, threads: calls.append(("prefault", buf.nbytes))
        with mock.patch.object(
            torch.cuda, "is_available", return_value=True
        ), mock.patch.object(
            torch.cuda, "cudart", return_value=cudart
        ), mock.patch.object(
            nsa_kv_only_host_pool, "prefault_pages", touch
        ):
            for min_bytes, expect in ((0, "prefault"), (1 << 40, None)):
                calls.clear()
                with mock.patch.object(
                    nsa_kv_only_host_pool, "PREFAULT_MIN_BYTES", min_bytes
                ):
                    pool = NSAKVOnlyTokenToKVPoolHost(
                        size=64, page_size=64, layer_num=2, row_bytes=656
                    )
                pool._registered = False  # nothing was registered for real
                if expect:
                    self.assertEqual(
                        calls, [(expect, pool.kv_buffer.nbytes), "register"]
                    )
                else:
                    self.assertEqual(calls, ["register"])


class TestGatherRows(unittest.TestCase):
    """The per-layer miss copy against a torch index_copy reference."""

    def _case(self, row_bytes, bs, k, counts, num_src=700, num_dst=400, seed=0, **kw):
        g = torch.Generator().manual_seed(seed)
        src = _random_rows(num_src, row_bytes, device="cpu", seed=seed)
        if DEVICE == "cuda":
            src = src.pin_memory()
        dst = _random_rows(num_dst, row_bytes, seed=seed + 1)
        # Garbage past the count: a read would fault (or be caught below).
        src_idx = torch.full((bs, k), GARBAGE_BIG, dtype=torch.int64)
        dst_idx = torch.full((bs, k), -(1 << 30), dtype=torch.int32)
        src_idx[::2, :] = GARBAGE_NEG
        dst_perm = torch.randperm(num_dst, generator=g)
        off = 0
        for b, c in enumerate(counts):
            src_idx[b, :c] = torch.randint(0, num_src, (c,), generator=g)
            dst_idx[b, :c] = dst_perm[off : off + c].to(torch.int32)
            off += c
        count = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
        src_idx, dst_idx = src_idx.to(DEVICE), dst_idx.to(DEVICE)
        expected = dst.clone()
        skc.gather_rows_reference(src, expected, src_idx, dst_idx, count, row_bytes)
        counters = torch.zeros(skc.NUM_COUNTERS, dtype=torch.int64, device=DEVICE)
        skc.gather_rows(
            src, dst, src_idx, dst_idx, count, row_bytes, counters=counters, **kw
        )
        self.assertTrue(torch.equal(dst, expected))
        total = sum(counts)
        self.assertEqual(
            counters.tolist(), [total, total * row_bytes, 0, 0], msg=str(kw)
        )

    def test_random_counts_fp8(self):
        k = 64
        self._case(FP8_ROW_BYTES, 5, k, [0, 1, 17, k, 33], block_rows=16)

    def test_all_zero_counts(self):
        self._case(FP8_ROW_BYTES, 3, 32, [0, 0, 0])

    def test_full_counts_bf16(self):
        self._case(BF16_ROW_BYTES, 2, 48, [48, 48], block_rows=8)

    def test_default_grid_loops_at_large_batch(self):
        # Past DEFAULT_MAX_GATHER_PROGRAMS // bs programs per row, each program
        # copies several tiles: 6 programs per row here, each looping over up
        # to 3 of the 16 four-row tiles, so rows with up to 64 misses need
        # every pass of the loop. As at bs = 160 with the default 1,024
        # programs; the cap scaled down to 5 rows (the interpreter runs each
        # program on the CPU).
        bs, k = 5, 64
        with mock.patch.object(skc, "DEFAULT_MAX_GATHER_PROGRAMS", 6 * bs + 3):
            self.assertLess(skc.DEFAULT_MAX_GATHER_PROGRAMS // bs, k // 4)
            counts = [64, 0, 37, 63, 9]
            self._case(
                FP8_ROW_BYTES, bs, k, counts, num_dst=sum(counts) + 8, block_rows=4
            )

    def test_tuning_knobs(self):
        # Every pair of knob values at least once (not all 18 combinations).
        counts = [0, 5, 40, 64]
        for i, word_bytes in enumerate((2, 4, 8)):
            for j, (block_rows, programs) in enumerate(((4, None), (16, 1), (8, 3))):
                self._case(
                    FP8_ROW_BYTES,
                    4,
                    64,
                    counts,
                    word_bytes=word_bytes,
                    split_tail=(i + j) % 2 == 0,
                    block_rows=block_rows,
                    programs_per_row=programs,
                    seed=word_bytes + block_rows,
                )

    def test_strided_index_rows(self):
        # Plans may be views of larger CUDA-graph buffers (row stride > K).
        row_bytes, bs, k = FP8_ROW_BYTES, 3, 16
        src = _random_rows(100, row_bytes, device="cpu")
        if torch.cuda.is_available():
            src = src.pin_memory()  # GPU kernels read host rows through UVA
        dst = _random_rows(60, row_bytes, seed=3)
        big_src = torch.full((bs, 2 * k), GARBAGE_BIG, dtype=torch.int64)
        big_dst = torch.full((bs, 2 * k), GARBAGE_NEG, dtype=torch.int64)
        big_src[:, :4] = torch.arange(12).view(3, 4) * 7
        big_dst[:, :4] = torch.arange(12).view(3, 4) + 20
        src_idx, dst_idx = big_src[:, :k].to(DEVICE), big_dst[:, :k].to(DEVICE)
        count = torch.tensor([4, 0, 3], dtype=torch.int32, device=DEVICE)
        expected = dst.clone()
        skc.gather_rows_reference(src, expected, src_idx, dst_idx, count, row_bytes)
        skc.gather_rows(src, dst, src_idx, dst_idx, count, row_bytes)
        self.assertTrue(torch.equal(dst, expected))

    def test_pick_word_bytes(self):
        self.assertEqual(skc.pick_word_bytes(656), 4)
        self.assertEqual(skc.pick_word_bytes(656, 8), 8)
        self.assertEqual(skc.pick_word_bytes(6), 2)
        with self.assertRaises(ValueError):
            skc.pick_word_bytes(656, 16)
        with self.assertRaises(ValueError):
            skc.pick_word_bytes(12, 8)


class TestCopyRowsAllLayers(unittest.TestCase):
    """The all-layer copy (D2H backup / H2D warm) through layer pointer tables."""

    def setUp(self):
        self.num_layers = 3
        self.pool = NSAKVOnlyTokenToKVPoolHost(
            size=256, page_size=64, layer_num=self.num_layers, row_bytes=FP8_ROW_BYTES
        )
        self.pool.kv_buffer.copy_(
            _random_rows(
                self.pool.num_rows * self.num_layers, FP8_ROW_BYTES, "cpu"
            ).view_as(self.pool.kv_buffer)
        )
        # Device pool layers as separate tensors, (rows, 1, dim) like sglang's.
        self.gpu = [
            _random_rows(200, FP8_ROW_BYTES, seed=10 + i).view(200, 1, FP8_ROW_BYTES)
            for i in range(self.num_layers)
        ]
        self.gpu_ptrs = skc.layer_pointer_table(self.gpu, DEVICE, FP8_ROW_BYTES)
        self.host_ptrs = self.pool.get_layer_ptrs(DEVICE)

    def _host_rows(self):
        return [self.pool.get_kv_buffer(i) for i in range(self.num_layers)]

    def test_d2h_scatter_count_bounded(self):
        n, valid = 40, 29
        rows = torch.randperm(200)[:n].to(torch.int32)
        locs = torch.randperm(self.pool.num_rows)[:n]
        rows[valid:] = 1 << 30  # garbage past the count
        locs[valid:] = GARBAGE_NEG
        count = torch.tensor([valid], dtype=torch.int32, device=DEVICE)
        host_before = self.pool.kv_buffer.clone()
        expected = [h.clone() for h in self._host_rows()]
        skc.copy_rows_all_layers_reference(
            self.gpu, expected, rows.to(DEVICE), locs.to(DEVICE), FP8_ROW_BYTES, count
        )
        counters = torch.zeros(skc.NUM_COUNTERS, dtype=torch.int64, device=DEVICE)
        skc.copy_rows_all_layers(
            self.gpu_ptrs,
            self.host_ptrs,
            rows.to(DEVICE),
            locs.to(DEVICE),
            FP8_ROW_BYTES,
            count=count,
            counters=counters,
        )
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        for layer in range(self.num_layers):
            got = self.pool.get_kv_buffer(layer)
            self.assertTrue(torch.equal(got, expected[layer]))
            want = self.gpu[layer].view(200, -1)[rows[:valid].long()].cpu()
            self.assertTrue(torch.equal(got[locs[:valid]], want))
        changed = (self.pool.kv_buffer != host_before).any(-1).sum().item()
        self.assertLessEqual(changed, valid * self.num_layers)
        rows_moved = valid * self.num_layers
        self.assertEqual(
            counters.tolist(), [0, 0, rows_moved, rows_moved * FP8_ROW_BYTES]
        )

    def test_h2d_per_layer_rows(self):
        # (L, n) destination rows: a different row per layer.
        n = 20
        locs = torch.randperm(self.pool.num_rows)[:n].to(DEVICE)
        rows = torch.stack([torch.randperm(200)[:n] for _ in range(self.num_layers)])
        rows = rows.to(DEVICE)
        expected = [g.clone() for g in self.gpu]
        skc.copy_rows_all_layers_reference(
            self._host_rows(), expected, locs, rows, FP8_ROW_BYTES
        )
        skc.copy_rows_all_layers(
            self.host_ptrs,
            self.gpu_ptrs,
            locs,
            rows,
            FP8_ROW_BYTES,
            block_rows=4,
            programs_per_layer=2,
        )
        for layer in range(self.num_layers):
            self.assertTrue(torch.equal(self.gpu[layer], expected[layer]))

    def test_zero_count_writes_nothing(self):
        before = self.pool.kv_buffer.clone()
        garbage = torch.full((8,), GARBAGE_BIG, dtype=torch.int64, device=DEVICE)
        skc.copy_rows_all_layers(
            self.gpu_ptrs,
            self.host_ptrs,
            garbage,
            garbage,
            FP8_ROW_BYTES,
            count=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        )
        self.assertTrue(torch.equal(self.pool.kv_buffer, before))

    def test_layer_pointer_table_checks(self):
        not_contiguous = self.gpu[0].view(200, -1)[:, :328]
        with self.assertRaises(ValueError):
            skc.layer_pointer_table([not_contiguous], DEVICE, 328)
        misaligned = torch.zeros(4 * FP8_ROW_BYTES + 8, dtype=torch.uint8)[8:]
        with self.assertRaises(ValueError):
            skc.layer_pointer_table([misaligned], DEVICE, FP8_ROW_BYTES)


if __name__ == "__main__":
    unittest.main()
