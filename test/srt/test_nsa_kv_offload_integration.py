"""Decode NSA KV offload driven through the real sglang pools (CPU integration).

Builds the real ``NSAKVOffloadTokenToKVPool`` (an sglang ``DSATokenToKVPool``),
``ReqToTokenPool``, ``NSAKVOffloadTokenToKVPoolAllocator`` (an sglang
``PagedTokenToKVPoolAllocator``) and ``NSAKVOffloadCoordinator`` (host pool +
``SparseCacheController``), then plays the scheduler's part with small fake
``Req`` / ``ScheduleBatch`` / ``ForwardBatch`` objects:

* chunked prefill: logical locs from ``alloc_extend``, staging rows through
  ``loc_to_row``, KV written with ``set_mla_kv_buffer``;
* admission (``admit_prefilled_batch`` right after the forward that completes
  a prompt, or the first decode preparation for a request it missed): prompt
  backed up to host slot ``loc``, staging pages returned, region granted and
  warmed;
* decode steps: new token locs mapped onto the window ring, KV written per
  layer, then every layer's swap must return a page table whose rows hold
  exactly the KV of the picked tokens (compared with a full-KV reference kept
  by the test), CUDA-graph padding rows included; new tokens backed up to host;
* finish / abort / retract through sglang's own ``release_kv_cache`` (with a
  real ``ChunkCache``; the patched function releases the offload state): region
  and LRU state released, locs and staging pages freed, every pool back to its
  initial size (no leaks), including requests that finish at their prefill
  while the overlap scheduler already put them in a decode batch; new requests
  then reuse the freed request slot, region and locs exactly.

Also covered: pool sizing arithmetic and its error, the server-args -> pool
configurator -> pool/allocator/coordinator glue, ``translate_locs_to_rows``
and ``get_nsa_kv_offload``.

CPU notes: without CUDA the Triton kernels run in the interpreter
(``TRITON_INTERPRET=1``, set by conftest.py), the host pool is not pinned and
the controller runs its copies inline (no side stream). Upstream's
``alloc_extend_kernel`` does not run under the Triton interpreter (its
runtime-bounded ``range`` fails), so on CPU it is replaced by a torch
transcription (``TorchAllocExtendKernel``) while the tests run. For speed
(the interpreter runs a kernel launch in ~0.1 s, a KV write in one program
per row): the harness writes and reads the model's KV through torch
equivalents of sglang's ``set_mla_kv_buffer_triton`` /
``get_mla_kv_buffer_triton`` / fp8 ``quantize_k_cache_separate``
(``TestKVWriteEquivalents`` holds them to the real kernels), and the tests of
the offload's logic run the torch reference swap and copies
(``torch_harness``); the Triton swap and copy kernels run under
``TestEarlySwap`` and the shadowed one-request-at-a-time pass (their own
differential tests: test_lru_cache_state, test_sparse_cache_controller).
Everything else, ``alloc_decode_kernel`` included, is the real code. With
CUDA the same tests run on the GPU.
"""

import contextlib
import importlib.util
import random
import re
import types
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
from lru_shadow import shadow_reference
from offload_harness import (  # noqa: F401 (module fixtures)
    DEVICE,
    KV_LORA_RANK,
    PAGE,
    ROPE_DIM,
    UPSTREAM_ALLOC_EXTEND,
    FakeReq,
    OffloadHarness,
    TorchAllocExtendKernel,
    get_last_loc_torch,
    layer_arg,
    make_options,
    make_pool,
    quantize_k_cache_separate_torch,
    set_mla_kv_rows_torch,
    setUpModule,
    tearDownModule,
    torch_kv_write_patches,
)
from sglang.srt.layers.attention import nsa_offload_hooks
from sglang.srt.managers.nsa_kv_offload_coordinator import NSAKVOffloadCoordinator
from sglang.srt.mem_cache import lru_cache_state as lru_cache_state_module
from sglang.srt.mem_cache import nsa_kv_offload_lru_triton as triton_swap_module
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.nsa_kv_offload_pool import (
    NSAKVOffloadTokenToKVPoolAllocator,
    StagingRowAllocator,
    get_nsa_kv_offload,
)
from sglang.srt.mem_cache.nsa_kv_offload_sizing import NSAKVOffloadPoolSizes
from sglang.srt.mem_cache.nsa_kv_offload_units import (
    REGION_UNIT_SOURCE,
    StagingUnitLender,
)
from sglang.srt.mem_cache.sparse_cache_controller import SparseCacheController
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sparse_backend import forward_backend
from test_lru_cache_state import check_invariants

REPO_ROOT = Path(__file__).resolve().parents[2]


def torch_harness(test, **kwargs):
    """An ``OffloadHarness`` on the torch reference swap and copies: for the
    tests of the offload's logic (the Triton kernels are held to the same
    semantics by test_lru_cache_state and test_sparse_cache_controller, and
    run here under ``TestEarlySwap`` and the shadowed one-request-at-a-time
    pass). Looked up at call time (test_nsa_kv_offload_idle_locs patches
    ``OffloadHarness``)."""
    kwargs.setdefault("use_triton", False)
    return OffloadHarness(test, **kwargs)


TINY_DSV32_CONFIG = (
    REPO_ROOT / "benchmark" / "nsa_offload" / "server" / "tiny_dsv32_config.json"
)


# --------------------------------------------------------------------- sizing


# ---------------------------------------------------------- small components


class TestHooksAndLookup(unittest.TestCase):
    def setUp(self):
        sizes = NSAKVOffloadPoolSizes(
            num_locs=8 * PAGE,
            num_regions=1,
            region_rows=128 + 8,
            staging_rows=2 * PAGE,
            page_size=PAGE,
            host_capacity_locs=8 * PAGE,
        )
        self.pool = make_pool(sizes, layer_num=2)
        self.allocator = NSAKVOffloadTokenToKVPoolAllocator(
            8 * PAGE,
            page_size=PAGE,
            dtype=torch.bfloat16,
            device=DEVICE,
            kvcache=self.pool,
            need_sort=False,
            staging_start_row=sizes.staging_start_row,
            staging_rows=sizes.staging_rows,
        )
        self.req_to_token_pool = ReqToTokenPool(
            size=2, max_context_len=256, device=DEVICE, enable_memory_saver=False
        )
        self.sizes = sizes

    def _coordinator(self):
        return NSAKVOffloadCoordinator(
            self.pool,
            self.allocator,
            self.req_to_token_pool.req_to_token,
            make_options(),
            max_batch_size=2,
        )

    def test_get_nsa_kv_offload(self):
        # sglang code that holds only the tree cache finds the coordinator the
        # scheduler gave it (none without the offload).
        tree_cache = SimpleNamespace()
        self.assertIsNone(get_nsa_kv_offload(tree_cache))
        coordinator = self._coordinator()
        tree_cache.nsa_kv_offload = coordinator
        self.assertIs(get_nsa_kv_offload(tree_cache), coordinator)
        scheduler = importlib.util.find_spec("sglang.srt.managers.scheduler")
        self.assertIn(
            "self.tree_cache.nsa_kv_offload = self.nsa_kv_offload",
            Path(scheduler.origin).read_text(),
        )

        # The backend is handed it at construction (model_runner.nsa_kv_offload,
        # None without the offload), so the model runner builds it first.
        decode = SimpleNamespace(forward_mode=ForwardMode.DECODE)
        extend = SimpleNamespace(forward_mode=ForwardMode.EXTEND)
        idle = SimpleNamespace(forward_mode=ForwardMode.IDLE)
        use_positional = nsa_offload_hooks.use_positional_topk
        self.assertTrue(use_positional(coordinator, decode))
        self.assertTrue(use_positional(coordinator, idle))
        self.assertFalse(use_positional(coordinator, extend))
        self.assertFalse(use_positional(None, decode))
        backend = importlib.util.find_spec("sglang.srt.layers.attention.dsa_backend")
        backend_src = Path(backend.origin).read_text()
        self.assertRegex(  # 0.5.17's patch reads it with getattr
            backend_src,
            r"self\.nsa_kv_offload = (model_runner\.nsa_kv_offload|"
            r'getattr\(model_runner, "nsa_kv_offload", None\))',
        )
        runner = importlib.util.find_spec("sglang.srt.model_executor.model_runner")
        runner_src = Path(runner.origin).read_text()
        built = runner_src.index("create_nsa_kv_offload_coordinator(self)")
        # With the pools, which the scheduler builds before the attention
        # backends (init_memory_pools, init_all_attention_backends).
        start = runner_src.index("def _init_post_memory_pool_components(")
        self.assertLess(start, built)
        self.assertLess(built, runner_src.index("\n    def ", start + 1))
        # The decode top-k reaches the offload untouched: a production install
        # has no top-k trace hook (apply_patch.py --with-bench-hooks adds it;
        # unset, it returns its input itself: test_nsa_topk_trace.py).
        trace = importlib.util.find_spec("sglang.srt.layers.attention.nsa_topk_trace")
        if trace is None:  # not the GPU host's benchmark install
            self.assertNotIn("nsa_topk_trace", backend_src)
        self.assertFalse(hasattr(nsa_offload_hooks, "maybe_override_decode_topk"))

    def test_translate_locs_to_rows(self):
        coordinator = self._coordinator()
        # Locs of a 70-token prompt: two pages, each with its staging page.
        req = FakeReq("r0")
        self.req_to_token_pool.alloc([req])
        zero = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        seq = torch.full((1,), 70, dtype=torch.int64, device=DEVICE)
        locs = self.allocator.alloc_extend(
            zero, zero.cpu(), seq, seq.cpu(), zero - 1, 70
        )
        self.assertIsNotNone(locs)
        self.req_to_token_pool.write((req.req_pool_idx, slice(0, 70)), locs.int())
        staging_end = self.sizes.staging_start_row + self.sizes.staging_rows
        self.assertEqual(self.allocator.staging.available_pages(), 0)

        # The extend page table of the backend: int32 locs, -1 padded.
        page_table = torch.full((2, 96), -1, dtype=torch.int32, device=DEVICE)
        page_table[0, :70] = self.req_to_token_pool.req_to_token[req.req_pool_idx, :70]
        page_table[1, :5] = page_table[0, 65:70]
        rows = nsa_offload_hooks.translate_locs_to_rows(coordinator, page_table)
        self.assertEqual(rows.dtype, torch.int32)
        self.assertEqual(rows.shape, page_table.shape)
        pad = page_table < 0
        self.assertTrue(bool((rows[pad] == -1).all()))
        self.assertTrue(
            torch.equal(
                rows[~pad].long(), self.pool.loc_to_row[page_table[~pad].long()]
            )
        )
        self.assertTrue(bool((rows[~pad] >= self.sizes.staging_start_row).all()))
        self.assertTrue(bool((rows[~pad] < staging_end).all()))
        self.assertEqual(torch.unique(rows[0, :70]).numel(), 70)
        # int64 (flattened page table) keeps its dtype too; None passes.
        flat = nsa_offload_hooks.translate_locs_to_rows(
            coordinator, page_table.reshape(-1).long()
        )
        self.assertEqual(flat.dtype, torch.int64)
        self.assertTrue(torch.equal(flat, rows.reshape(-1).long()))
        self.assertIsNone(nsa_offload_hooks.translate_locs_to_rows(coordinator, None))
        # Without the offload the locs are returned as they are.
        self.assertIs(
            nsa_offload_hooks.translate_locs_to_rows(None, page_table), page_table
        )


@unittest.skipUnless(DEVICE == "cpu", "the transcription stands in on CPU only")
class TestAllocExtendTranscription(unittest.TestCase):
    """``TorchAllocExtendKernel`` gives the locs upstream's kernel gives.
    The interpreter cannot run that kernel as it ships: its loop bound is a
    one-element block, which numpy 2 will not turn into an int. Here the
    interpreter's ``__index__`` takes the element."""

    def _upstream(self):
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter

        patch_lang = interpreter._patch_lang

        def index_from_one_element(fn):
            scope = patch_lang(fn)
            scope.set_attr(
                tl.core.tensor,
                "__index__",
                lambda t: int(np.asarray(t.handle.data).reshape(-1)[0]),
            )
            return scope

        return mock.patch.object(interpreter, "_patch_lang", index_from_one_element)

    def test_same_locs(self):
        gen = torch.Generator().manual_seed(0)
        for case in range(12):
            bs = 1 + case % 4
            prefix = torch.randint(0, 300, (bs,), generator=gen)
            prefix[0] = 0 if case % 3 == 0 else prefix[0]  # a new prompt
            extend = torch.randint(1, 9000 if case % 2 else 200, (bs,), generator=gen)
            seq = prefix + extend
            # Each request's prefix on pages of its own, its last loc there.
            last = torch.where(
                prefix > 0,
                (10 + 20 * torch.arange(bs)) * PAGE + (prefix - 1) % PAGE,
                -1,
            )
            pages_needed = int(((seq + PAGE - 1) // PAGE).sum())
            free_pages = torch.randperm(pages_needed + 500, generator=gen) + 200
            outs = []
            for kernel in (UPSTREAM_ALLOC_EXTEND, TorchAllocExtendKernel()):
                out = torch.full((int(extend.sum()),), -7, dtype=torch.int64)
                with self._upstream():
                    kernel[(bs,)](
                        prefix,
                        seq,
                        last,
                        free_pages,
                        out,
                        1 << (bs - 1).bit_length(),
                        PAGE,
                    )
                outs.append(out)
            self.assertTrue(torch.equal(outs[0], outs[1]), f"case {case}")
            self.assertFalse(bool((outs[0] == -7).any()))


class TestKVWriteEquivalents(unittest.TestCase):
    """The harness' torch KV write (``set_mla_kv_rows_torch``, and for fp8
    ``quantize_k_cache_separate_torch``) against sglang's Triton kernels,
    which the offload pool's ``set_mla_kv_buffer`` calls (the other tests
    write through the torch ones)."""

    def _inputs(self, n, seed):
        gen = torch.Generator().manual_seed(seed)
        # Tiles of very different magnitudes (one fp8 scale each).
        mag = 10.0 ** torch.randint(-3, 4, (n, 1, 4, 1), generator=gen)
        nope = torch.randn((n, 1, 4, 128), generator=gen) * mag
        nope = nope.view(n, 1, KV_LORA_RANK).to(DEVICE, torch.bfloat16)
        rope = torch.randn((n, 1, ROPE_DIM), generator=gen)
        return nope, rope.to(DEVICE, torch.bfloat16)

    def test_fp8_quantization(self):
        # The quantization sglang's pool writes with (memory_pool's import).
        from sglang.srt.mem_cache import memory_pool as quant_k_cache

        n = 4
        nope, rope = self._inputs(n, 0)
        real = quant_k_cache.quantize_k_cache_separate(nope, rope)
        ours = quantize_k_cache_separate_torch(nope, rope)
        for a, b in zip(real, ours):
            self.assertEqual((a.shape, a.dtype), (b.shape, b.dtype))
        # The fp32 scales (amax / 448 per tile) and the rope's bf16 bytes:
        # bit for bit.
        self.assertTrue(torch.equal(real[0][..., 512:], ours[0][..., 512:]))
        self.assertTrue(torch.equal(real[1], ours[1]))
        # The fp8 values: the kernel's x * (1 / scale), cast to the nearest
        # e4m3 (what the GPU does). The interpreter's own fp32 -> fp8 cast is
        # off for a few values near a binade's top (e.g. -127.1 -> -64): the
        # torch ones are never further from the exact value.
        x = nope.float().view(n, 4, 128)
        scale = ours[0][..., 512:].reshape(n, 16).view(torch.float32)
        exact = (x * (1.0 / scale).unsqueeze(-1)).view(n, 512)

        def values(part):
            return part[..., :512].reshape(n, 512).view(torch.float8_e4m3fn).float()

        err_real = (values(real[0]) - exact).abs()
        err_ours = (values(ours[0]) - exact).abs()
        self.assertTrue(bool((err_ours <= err_real).all()))
        step = 2.0 ** (exact.abs().clamp(min=2**-6).log2().floor() - 3)
        self.assertTrue(bool((err_ours <= step / 2).all()), "not the nearest")
        same = (real[0] == ours[0]).float().mean().item()
        self.assertGreater(same, 0.95)

    def test_pool_reads_and_writes_through_the_patched_kernels(self):
        # The quantization sglang's pool writes with (memory_pool's import).
        from sglang.srt.mem_cache import memory_pool as quant_k_cache

        sizes = NSAKVOffloadPoolSizes(
            num_locs=2 * PAGE,
            num_regions=1,
            region_rows=PAGE,
            staging_rows=PAGE,
            page_size=PAGE,
            host_capacity_locs=2 * PAGE,
        )
        locs = torch.tensor([5, 70, 9], device=DEVICE)
        rows = torch.tensor([7, 3, 100], device=DEVICE)
        nope, rope = self._inputs(3, 1)
        for kv_fp8 in (False, True):
            for torch_write in (False, True):
                with self.subTest(kv_fp8=kv_fp8, torch_write=torch_write):
                    quantize = quant_k_cache.quantize_k_cache_separate
                    if torch_write:
                        quantize = quantize_k_cache_separate_torch
                    parts = quantize(nope, rope) if kv_fp8 else (nope, rope)
                    expect = torch.cat(
                        [p.view(3, -1).view(torch.uint8) for p in parts], 1
                    )
                    pool = make_pool(sizes, layer_num=1, kv_fp8=kv_fp8)
                    pool.loc_to_row[locs] = rows
                    with contextlib.ExitStack() as stack:
                        for patcher in torch_kv_write_patches() if torch_write else []:
                            stack.enter_context(patcher)
                        pool.set_mla_kv_buffer(layer_arg(0), locs, nope, rope)
                        buf = pool.kv_buffer[0].view(torch.uint8)
                        stored = buf.view(buf.shape[0], -1)
                        if not kv_fp8:
                            got = pool.get_mla_kv_buffer(layer_arg(0), locs)
                            self.assertTrue(torch.equal(got[0], nope))
                            self.assertTrue(torch.equal(got[1], rope))
                    self.assertTrue(torch.equal(stored[rows], expect))
                    others = torch.ones(stored.shape[0], dtype=torch.bool)
                    others[rows] = False
                    self.assertFalse(bool(stored[others].any()))


class TestStagingAllocator(unittest.TestCase):
    NUM_LOCS, STAGING_PAGES = 16 * PAGE, 6

    def test_unit_lender_takes_whole_runs(self):
        staging = StagingRowAllocator(PAGE, 10, PAGE, DEVICE)
        lender = StagingUnitLender(staging, unit_rows=2 * PAGE + 1, reserve_pages=2)
        self.assertEqual(lender.pages_per_unit, 3)
        # Free pages 0-1, 4-6 and 8-9: the only run of 3 is 4-6.
        taken = staging.alloc(10)
        staging.free(taken[[0, 1, 4, 5, 6, 8, 9]])
        self.assertTrue(lender.available())  # 7 free - 2 reserved >= 3
        self.assertEqual(lender.take(), PAGE + 4 * PAGE)
        self.assertEqual(sorted(staging.free_pages.tolist()), [0, 1, 8, 9])
        self.assertFalse(lender.available())  # 4 - 2 < 3
        self.assertIsNone(lender.take())
        lender.give(PAGE + 4 * PAGE)
        self.assertEqual(sorted(staging.free_pages.tolist()), [0, 1, 4, 5, 6, 8, 9])
        staging.free(taken[[2, 3, 7]])
        # Highest run first: 7-9.
        self.assertEqual(lender.take(), PAGE + 7 * PAGE)
        # Enough free pages but no run: one search, then no more until the
        # free list changes (a search reads it on the host).
        lender.give(PAGE + 7 * PAGE)
        staging.alloc(staging.available_pages())
        staging.free(taken[[0, 2, 4, 6, 8, 9]])  # runs of at most 2 pages
        self.assertTrue(lender.available())
        self.assertIsNone(lender.take())
        self.assertFalse(lender.available())
        staging.free(taken[[5]])  # 4-6 is a run again
        self.assertTrue(lender.available())
        self.assertEqual(lender.take(), PAGE + 4 * PAGE)

    def setUp(self):
        sizes = NSAKVOffloadPoolSizes(
            num_locs=self.NUM_LOCS,
            num_regions=1,
            region_rows=PAGE,
            staging_rows=self.STAGING_PAGES * PAGE,
            page_size=PAGE,
            host_capacity_locs=self.NUM_LOCS,
        )
        self.pool = make_pool(sizes, 1)
        self.allocator = NSAKVOffloadTokenToKVPoolAllocator(
            self.NUM_LOCS,
            page_size=PAGE,
            dtype=torch.bfloat16,
            device=DEVICE,
            kvcache=self.pool,
            need_sort=False,
            staging_start_row=PAGE,
            staging_rows=self.STAGING_PAGES * PAGE,
        )
        self.req_to_token = torch.zeros((4, 1024), dtype=torch.int32, device=DEVICE)

    def _extend(self, items):
        """items: [(req_idx, prefix_len, extend_len)] -> out locs (int64)."""
        idx = torch.tensor([r for r, _, _ in items], device=DEVICE)
        pre = torch.tensor([p for _, p, _ in items], dtype=torch.int64)
        seq = torch.tensor([p + e for _, p, e in items], dtype=torch.int64)
        last = get_last_loc_torch(self.req_to_token, idx, pre.to(DEVICE))
        out = self.allocator.alloc_extend(
            pre.to(DEVICE), pre, seq.to(DEVICE), seq, last, int((seq - pre).sum())
        )
        if out is not None:
            start = 0
            for r, p, e in items:
                self.req_to_token[r, p : p + e] = out[start : start + e].int()
                start += e
        return out

    def _check_mapping(self, locs):
        rows = self.pool.loc_to_row[locs]
        pages = locs // PAGE
        staging_row = self.allocator.page_to_staging_row[pages]
        self.assertTrue(bool((staging_row >= PAGE).all()))
        self.assertTrue(torch.equal(rows, staging_row + locs % PAGE))
        self.assertTrue(bool((rows < PAGE + self.STAGING_PAGES * PAGE).all()))
        return rows

    def test_chunked_prefill_staging(self):
        avail = self.allocator.available_size()
        # Two requests; the first chunk of request 0 ends mid-page.
        self._extend([(0, 0, 100), (1, 0, 64)])
        self.assertEqual(self.allocator.staging.available_pages(), 6 - 3)
        self._extend([(0, 100, 120)])  # 220 tokens: 4 pages, 2 new
        self.assertEqual(self.allocator.staging.available_pages(), 6 - 5)
        self.assertEqual(self.allocator.available_size(), avail - 5 * PAGE)
        locs0 = self.req_to_token[0, :220].long()
        locs1 = self.req_to_token[1, :64].long()
        rows = torch.cat([self._check_mapping(locs0), self._check_mapping(locs1)])
        self.assertEqual(torch.unique(rows).numel(), 284)  # no two locs share a row
        # Tokens 64..219 of request 0: the partial page continues its staging page.
        self.assertTrue(
            torch.equal(
                self.pool.loc_to_row[locs0[96:104]],
                self.pool.loc_to_row[locs0[96]] + torch.arange(8, device=DEVICE),
            )
        )

        # Admission returns the staging pages (any loc of a page frees it).
        self.allocator.release_staging(locs0[::7])
        self.assertEqual(self.allocator.staging.available_pages(), 1 + 4)
        self.assertTrue(
            bool((self.allocator.page_to_staging_row[locs0 // PAGE] == -1).all())
        )
        self.allocator.release_staging(locs0)  # idempotent
        self.assertEqual(self.allocator.staging.available_pages(), 5)

        # Freeing locs (finish) returns locs and the remaining staging pages,
        # also through a free group (decode result processing).
        self.allocator.free(locs0.int())
        self.allocator.free_group_begin()
        self.allocator.free(locs1.int())
        self.assertEqual(self.allocator.staging.available_pages(), 5)
        self.allocator.free_group_end()
        self.assertEqual(self.allocator.staging.available_pages(), 6)
        self.assertEqual(self.allocator.available_size(), avail)
        self.assertTrue(bool((self.allocator.page_to_staging_row == -1).all()))

        # Staging pages come back in a new order: rows no longer follow locs.
        self._extend([(2, 0, 6 * PAGE)])
        self._check_mapping(self.req_to_token[2, : 6 * PAGE].long())
        self.allocator.clear()
        self.assertEqual(self.allocator.staging.available_pages(), 6)
        self.assertEqual(self.allocator.available_size(), avail)
        self.assertTrue(bool((self.allocator.page_to_staging_row == -1).all()))

    def test_every_free_path_releases_staging(self):
        # Also freed by page ids (free_segment: the tail release_kv_cache
        # frees, free groups of page representatives), never through free().
        avail = self.allocator.available_size()
        locs = self._extend([(0, 0, 3 * PAGE + 5)])  # 4 pages
        self.assertEqual(self.allocator.staging.available_pages(), 6 - 4)
        # From page 1 on: pages 1, 2 and 3.
        self.allocator.free_segment(locs[PAGE:], start_pos=PAGE)
        self.assertEqual(self.allocator.staging.available_pages(), 6 - 1)
        self.allocator.free_group_begin()
        self.allocator.free_segment(locs[:PAGE], start_pos=0)
        self.assertEqual(self.allocator.staging.available_pages(), 6 - 1)
        self.allocator.free_group_end()
        self.assertEqual(self.allocator.staging.available_pages(), 6)
        self.assertEqual(self.allocator.available_size(), avail)
        self.assertTrue(bool((self.allocator.page_to_staging_row == -1).all()))

    def test_out_of_staging(self):
        avail = self.allocator.available_size()
        self._extend([(0, 0, 2 * PAGE)])
        with self.assertRaises(RuntimeError) as ctx:
            self._extend([(1, 0, 5 * PAGE)])
        self.assertIn("out of GPU staging rows", str(ctx.exception))
        self.assertIn("--chunked-prefill-size", str(ctx.exception))
        # The failed extend gave its locs back and took no staging page.
        self.assertEqual(self.allocator.available_size(), avail - 2 * PAGE)
        self.assertEqual(self.allocator.staging.available_pages(), 4)
        self._extend([(1, 0, 4 * PAGE)])
        self.assertEqual(self.allocator.staging.available_pages(), 0)

    def test_decode_pages_have_no_staging(self):
        self._extend([(0, 0, PAGE)])  # full page: the next token opens a page
        self.allocator.release_staging(self.req_to_token[0, :PAGE].long())
        seq = torch.tensor([PAGE + 1], dtype=torch.int64)
        last = self.req_to_token[0, PAGE - 1 : PAGE].long()
        out = self.allocator.alloc_decode(seq.to(DEVICE), seq, last)
        self.assertEqual(int(out[0]) % PAGE, 0)
        self.assertEqual(int(self.allocator.page_to_staging_row[out[0] // PAGE]), -1)
        self.assertEqual(self.allocator.staging.available_pages(), 6)


# ------------------------------------------------------------------ lifecycle


class TestOffloadLifecycle(unittest.TestCase):
    # LRU units a request may hold, idle staging pages that may be lent.
    MAX_UNITS = 1
    LEND_STAGING_PAGES = 0

    def _harness(self, **kwargs):
        return torch_harness(
            self,
            max_units=self.MAX_UNITS,
            lend_staging_pages=self.LEND_STAGING_PAGES,
            **kwargs,
        )

    def test_lifecycle_bf16(self):
        h = self._harness()
        # Chunked prefill of A (its first chunk ends mid-page), then A's last
        # chunk and all of B in one extend batch; the hook after that forward
        # admits both.
        a = h.new_req()
        h.prefill([(a, 200)], chunked_req=a)
        b = h.new_req()
        h.prefill([(a, 100), (b, 150)])
        self.assertEqual(h.allocator.staging.available_pages(), 10)
        h.decode_step([a, b], first_step_of=(a, b))
        for step in range(9):  # past the window: decode tokens come from host
            h.decode_step([a, b], pad_rows=1 if step % 3 == 0 else 0)
        stats = h.controller.get_stats()
        self.assertGreater(stats["lru_hits"], 0)
        self.assertGreater(stats["window_hits"], 0)
        self.assertGreater(stats["misses"], 0)
        self.assertEqual(stats["regions_used"], 2)
        msg = h.co.get_decode_log_msg()
        self.assertIn("nsa-offload hit rate: ", msg)
        self.assertIn("regions: 2/2", msg)
        self.assertEqual(h.controller.get_stats()["misses"], 0)  # reset

        # A finishes; C reuses A's request slot, region and (freed) locs. The
        # hook misses C: the first decode preparation admits it.
        a_idx, a_base = a.req_pool_idx, h.controller.region_base(a.req_pool_idx)
        a_locs = set(h.req_to_token[a_idx, : a.seq_len].tolist())
        h.finish(a)
        c = h.new_req()
        self.assertEqual(c.req_pool_idx, a_idx)
        h.prefill([(c, 260)], admit=False)
        self.assertTrue(a_locs & set(h.req_to_token[a_idx, :260].tolist()))
        h.decode_step([b, c], first_step_of=(c,))
        self.assertEqual(h.controller.region_base(c.req_pool_idx), a_base)
        for _ in range(5):
            h.decode_step([b, c], pad_rows=1)
        h.finish(b)
        h.decode_step([c])
        h.finish(c)
        h.check_no_leaks()

    def test_finish_at_prefill(self):
        # Requests that finish at their prefill (max_new_tokens=1, e.g. the
        # /health_generate probe): admitted by the prefill hook, released by
        # release_kv_cache when the prefill result is processed, whether or
        # not the overlap scheduler already put them in a decode batch.
        h = self._harness()
        a = h.new_req()
        h.prefill([(a, 150)])
        h.finish(a)
        b = h.new_req()
        h.prefill([(b, 180)])
        h.decode_step([b], first_step_of=(b,))  # overlap: next batch prepared
        h.finish(b)
        h.check_no_leaks()
        # Both request slots, regions and the locs are reused exactly.
        c, d = h.new_req(), h.new_req()
        h.prefill([(c, 140), (d, 200)])
        h.decode_step([c, d], first_step_of=(c, d))
        for _ in range(3):
            h.decode_step([c, d])
        h.finish(c)
        h.finish(d)
        h.check_no_leaks()

    def test_lifecycle_fp8(self):
        # 656-byte FlashMLA fp8 rows (the production layout).
        h = self._harness(kv_fp8=True, seed=1)
        self.assertEqual(h.row_bytes, 656)
        self.assertEqual(h.controller.row_bytes, 656)
        a = h.new_req()
        h.prefill([(a, 190)])
        h.decode_step([a], first_step_of=(a,))
        for _ in range(9):
            h.decode_step([a])
        # Alone, A may hold its region, the other one and two lent staging
        # units (4 idle pages of 2 per unit).
        self.assertEqual(h.controller.num_units(a.req_pool_idx), min(self.MAX_UNITS, 4))
        h.finish(a)
        h.check_no_leaks()

    def test_abort_before_admission(self):
        # Aborted (or retracted) while still being prefilled: never admitted;
        # freeing its locs returns its staging pages.
        h = self._harness()
        a = h.new_req()
        h.prefill([(a, 130)], chunked_req=a)
        self.assertLess(h.allocator.staging.available_pages(), 10)
        h.finish(a)
        h.check_no_leaks()


class TestOffloadLifecycleUnits(TestOffloadLifecycle):
    """The same with the server's default units: a finished request's region
    and idle staging pages become the others' extra units."""

    MAX_UNITS = 4
    LEND_STAGING_PAGES = 4


class TestEarlySwap(unittest.TestCase):
    """The early swap: the swap starts when the model hands the top-k over,
    the backend's hook only collects it."""

    def test_recency_update_deferred_past_the_event_but_the_last_layer(self):
        # Every decode layer but the last defers its LRU reorder and finishes
        # it within begin_layer_swap, before the next layer's swap; the
        # state is settled whenever the hook returns.
        h = OffloadHarness(self, layers=3, num_regions=3, max_reqs=3, max_units=3)
        ctrl, calls = h.controller, []
        swap, finish = ctrl.swap_one_layer, ctrl.finish_lru_reorder

        def record_swap(layer_id, *args, defer_lru_reorder=False, **kwargs):
            calls.append((layer_id, defer_lru_reorder))
            return swap(layer_id, *args, defer_lru_reorder=defer_lru_reorder, **kwargs)

        def record_finish():
            calls.append("finish")
            finish()

        a = h.new_req()
        h.prefill([(a, 300)])
        with mock.patch.object(ctrl, "swap_one_layer", record_swap), mock.patch.object(
            ctrl, "finish_lru_reorder", record_finish
        ):
            h.decode_step([a], first_step_of=(a,))
            h.decode_step([a])
        per_step = [(0, True), "finish", (1, True), "finish", (2, False)]
        self.assertEqual(calls, per_step * 2)
        ctrl.lru.swap_backend.check_settled("after the step")  # nothing pending
        h.finish(a)
        h.check_no_leaks()

    def test_idle_and_extend_stay_inline(self):
        # (MTP verify: test_nsa_kv_offload_mtp_verify, early and inline.)
        h = torch_harness(self)
        topk = torch.zeros((1, h.K), dtype=torch.int32, device=DEVICE)
        for mode in (ForwardMode.IDLE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY):
            fb = SimpleNamespace(
                forward_mode=mode, attn_backend=SimpleNamespace(nsa_kv_offload=h.co)
            )
            with forward_backend(fb.attn_backend):
                nsa_offload_hooks.begin_layer_swap(fb, 0, topk)
            self.assertEqual(h.co._early_page_tables, {})


class TestUnitsLifecycle(unittest.TestCase):
    """``--nsa-kv-offload-max-units``: free regions become extra LRU units of
    the running requests; admissions take them back."""

    def test_units_follow_the_load(self):
        h = torch_harness(self, seed=6, num_regions=3, max_reqs=3, max_units=3)
        co = h.controller
        a = h.new_req()
        h.prefill([(a, 300)])
        h.decode_step([a], first_step_of=(a,))
        self.assertEqual(co.num_units(a.req_pool_idx), 3)  # alone: every region
        for _ in range(4):
            h.decode_step([a])
        # B's admission takes A's newest unit back; the page tables of both
        # stay exact (checked against the full-KV reference every step).
        b = h.new_req()
        h.prefill([(b, 260)])
        self.assertEqual(co.num_units(a.req_pool_idx), 2)
        h.decode_step([a, b], first_step_of=(b,), pad_rows=1)
        for step in range(4):
            h.decode_step([a, b], pad_rows=step % 2)
        c = h.new_req()
        h.prefill([(c, 200)], admit=False)  # admitted by the decode preparation
        h.decode_step([a, b, c], first_step_of=(c,))
        self.assertEqual([co.num_units(r.req_pool_idx) for r in (a, b, c)], [1, 1, 1])
        for _ in range(3):
            h.decode_step([a, b, c])
        # A finishes: its region goes to the request with the fewest units.
        h.finish(a)
        h.decode_step([b, c])
        self.assertEqual(co.num_units(b.req_pool_idx) + co.num_units(c.req_pool_idx), 3)
        for _ in range(4):
            h.decode_step([b, c], pad_rows=1)
        self.assertGreater(co.get_stats()["misses"], 0)
        self.assertIn(
            "regions: 3/3, extra units: 1 (0 of staging, 0 moved, 0 of idle locs), "
            "units per request: 1-2",
            h.co.get_decode_log_msg(),
        )
        h.finish(b)
        h.finish(c)
        h.check_no_leaks()

    def test_idle_staging_lent_as_units(self):
        # 2 regions; 8 of the 10 staging pages may be lent (units of C = 128
        # rows = 2 pages). Prefills take staging units back, admissions take
        # region units back; every page table stays exact.
        h = torch_harness(
            self, seed=7, num_regions=2, max_units=4, lend_staging_pages=8
        )
        co, staging = h.controller, h.allocator.staging
        a = h.new_req()
        h.prefill([(a, 300)])
        h.decode_step([a], first_step_of=(a,))
        # Alone: its region, the other region, then two staging units.
        self.assertEqual(co.num_units(a.req_pool_idx), 4)
        self.assertEqual(co.get_stats()["extra_units_lent"], 2)
        self.assertEqual(staging.available_pages(), 10 - 4)
        for _ in range(3):
            h.decode_step([a])
        # B's 400-token prompt needs 7 staging pages: one staging unit comes
        # back first; its admission then needs a region: A's region unit
        # sits below its other staging unit, so its rows are copied into
        # that unit's rows (which back its slots from then on) and A keeps
        # two units.
        b = h.new_req()
        co.reset_stats()
        h.prefill([(b, 400)])
        self.assertEqual(co.num_units(a.req_pool_idx), 2)
        self.assertEqual(co.num_units(b.req_pool_idx), 1)
        self.assertIn(
            "units reclaimed: 2 (1 kept by a copy)", h.co.get_decode_log_msg()
        )
        h.decode_step([a, b], first_step_of=(b,), pad_rows=1)
        # With B's staging released, both take staging units again.
        self.assertEqual(co.get_stats()["extra_units_lent"], 4)
        self.assertIn("(4 of staging, ", h.co.get_decode_log_msg())
        for step in range(5):
            h.decode_step([a, b], pad_rows=step % 2)
        self.assertGreater(co.get_stats()["misses"], 0)
        h.finish(a)
        h.finish(b)
        h.check_no_leaks()
        self.assertEqual(staging.available_pages(), 10)


class TestRandomWorkload(unittest.TestCase):
    """A seeded random mix of what a colocated scheduler does: prefills (whole
    or in two chunks; admitted by the prefill hook or by the next decode
    preparation), decode steps with padded rows, finishes and aborts, while
    units follow the load. Every page table is checked against the full-KV
    reference at every layer of every step; nothing leaks at the end."""

    def _run(self, seed: int, max_units: int, lend_staging_pages: int):
        rng = random.Random(seed)
        h = torch_harness(
            self,
            seed=seed,
            num_regions=3,
            max_reqs=4,
            num_locs=20 * PAGE,
            max_units=max_units,
            lend_staging_pages=lend_staging_pages,
        )
        # Which sources had units taken back (0: a region for an admission,
        # 1: staging for a prefill).
        reclaim = mock.patch.object(
            h.controller, "_reclaim_from", wraps=h.controller._reclaim_from
        )
        spy = reclaim.start()
        self.addCleanup(reclaim.stop)
        running, fresh, chunked = [], {}, None
        seen = dict(decode_steps=0, max_extra_units=0)
        for _ in range(60):
            room = h.sizes.num_regions - len(running) - (chunked is not None)
            roll = rng.random()
            if roll < 0.3 and room > 0 and chunked is None:
                n = rng.randrange(60, 330)
                pages = -(-n // PAGE)
                if pages > h.staging_room() or n + 64 > h.allocator.available_size():
                    continue
                req = h.new_req()
                if rng.random() < 0.4:
                    # The first chunk now, the rest in a later extend batch.
                    h.prefill([(req, n // 2)], chunked_req=req)
                    chunked = (req, n - n // 2)
                    continue
                admit = rng.random() < 0.7
                h.prefill([(req, n)], admit=admit)
                running.append(req)
                fresh[req] = spy.call_count
            elif roll < 0.4 and chunked is not None:
                req, rest = chunked
                if -(-(req.seq_len + rest) // PAGE) - -(-req.seq_len // PAGE) > (
                    h.staging_room()
                ):
                    continue
                h.prefill([(req, rest)])
                running.append(req)
                fresh[req] = spy.call_count
                chunked = None
            elif roll < 0.5 and (running or chunked is not None):
                # Finish or abort (a chunked prompt may be aborted too).
                if chunked is not None and rng.random() < 0.3:
                    h.finish(chunked[0])
                    chunked = None
                elif running:
                    req = running.pop(rng.randrange(len(running)))
                    fresh.pop(req, None)
                    h.finish(req)
            elif running:
                new_pages = sum(r.seq_len % PAGE == 0 for r in running)
                if new_pages * PAGE > h.allocator.available_size():
                    req = running.pop(0)
                    fresh.pop(req, None)
                    h.finish(req)
                    continue
                # A fresh request misses nothing at its first step, unless a
                # unit its warm-up filled was taken back since.
                h.decode_step(
                    list(running),
                    pad_rows=rng.randrange(2),
                    first_step_of=tuple(r for r in fresh if fresh[r] == spy.call_count),
                )
                fresh.clear()
                seen["decode_steps"] += 1
                seen["max_extra_units"] = max(
                    seen["max_extra_units"], h.controller.get_stats()["extra_units"]
                )
        for req in running + ([chunked[0]] if chunked else []):
            h.finish(req)
        h.check_no_leaks()
        seen["reclaimed_from"] = {c.args[0] for c in spy.call_args_list}
        return seen

    def test_fixed_buffer(self):
        seen = self._run(11, max_units=1, lend_staging_pages=0)
        self.assertGreaterEqual(seen["decode_steps"], 10)
        self.assertEqual(seen["max_extra_units"], 0)

    def test_units_from_regions_and_staging(self):
        seen = self._run(13, max_units=4, lend_staging_pages=6)
        self.assertGreaterEqual(seen["decode_steps"], 10)
        self.assertGreater(seen["max_extra_units"], 0)
        # Admissions took regions back (staging taken back by a prefill:
        # TestUnitsLifecycle.test_idle_staging_lent_as_units).
        self.assertIn(REGION_UNIT_SOURCE, seen["reclaimed_from"])


class _OneRequestAtATime(unittest.TestCase):
    """What the exactness servers' batch-1 pass does: requests one after
    another, long prompts that walk the LRU over their units, then short ones
    that fit them (direct slots), in the same request slot, with the server's
    defaults (warm units, direct slots, spare regions, staging lent as units,
    the early swap).
    Every page table is checked against the KV written. On CUDA at the
    served sizes (4,096 LRU rows, window 64, top-k 2,048, 8,192 token
    chunks) with the streams the server runs; on CPU at 1/32 of them."""

    # Prompt lengths in LRU units (C rows): walkers past 2 units, then short.
    PROMPTS_IN_UNITS = (2.3, 5.5, 0.7, 1.6, 7.8, 1.95, 0.45, 3.9, 0.95)
    SERVED_SIZES = None  # None: on CUDA only
    SPARE_REGIONS = 2
    # None: 2 at the served sizes, 1 on CPU (the interpreter's time); with 2
    # or more, every layer but the last defers its LRU reorder.
    LAYERS = None

    def _run(self, max_units, shadow=False, use_triton=None):
        """``shadow``: the torch reference swap beside every Triton swap
        (``lru_shadow``): the first swap whose outputs differ fails.
        ``use_triton``: ``OffloadHarness``'s (None: the product's choice)."""
        served = DEVICE == "cuda" if self.SERVED_SIZES is None else self.SERVED_SIZES
        C, W, K = (4096, 64, 2048) if served else (128, 8, 64)
        chunk = 2 * C
        lens = [int(u * C) for u in self.PROMPTS_IN_UNITS]
        steps = W + 6  # past the window: prompt and decode tokens leave it
        longest = max(lens) + steps + 2
        pages = -(-longest // PAGE) + 2
        h = OffloadHarness(
            self,
            kv_fp8=True,
            layers=self.LAYERS or (2 if served else 1),
            top_k=K,
            buffer_size=C,
            window=W,
            num_locs=pages * PAGE,
            num_regions=2,
            staging_pages=pages,
            max_reqs=2,
            max_ctx=longest + PAGE,
            max_units=max_units,
            lend_staging_pages=pages - -(-chunk // PAGE),
            spare_regions=self.SPARE_REGIONS,
            use_triton=use_triton,
        )
        self.harness_ready(h)
        if shadow:
            compared = self.enterContext(shadow_reference(h.co.lru))
        walked = direct = 0
        for n in lens:
            req = h.new_req()
            req.origin_input_ids = [0] * n
            req.sampling_params.max_new_tokens = steps + 1
            done = 0
            while n - done > chunk:
                h.prefill([(req, chunk)], chunked_req=req)
                done += chunk
            h.prefill([(req, n - done)])
            self.check_lru_state(h, req, "admission")
            h.decode_step([req], first_step_of=(req,))
            self.check_lru_state(h, req, "first step")
            for step in range(steps):
                h.decode_step([req])
                self.check_lru_state(h, req, f"step {step + 2}")
            in_slots = n + steps + 1 - W <= h.controller.num_units(req.req_pool_idx) * C
            walked += not in_slots
            direct += in_slots
            h.finish(req)
        h.check_no_leaks()
        # Both kinds ran, beside units lent and taken back.
        self.assertGreater(walked, 0)
        self.assertGreater(direct, 0)
        if shadow:
            self.assertEqual(compared.compared_orders, compared.swaps)
            self.assertGreater(compared.swaps, 0)

    def harness_ready(self, h):
        """Called once the run's harness is built (subclasses watch it)."""

    def check_lru_state(self, h, req, when):
        """The LRU state's invariants (every slot's loc maps back to it, no
        stale map entry, each order a permutation of the held slots, ...)
        and the request's own: unique locs and, in direct mode, position p's
        loc in slot p or nowhere. Names the first broken one: a wrong page
        table on the GPU then says which state went wrong, and when."""
        r, n = req.req_pool_idx, req.seq_len
        where = (
            f"request {req.rid} (length {n}, "
            f"{h.controller.num_units(r)} units, direct "
            f"{int(h.co.lru.direct[r])}) after {when}"
        )
        locs = h.req_to_token[r, :n].long()
        self.assertEqual(locs.unique().numel(), n, f"{where}: repeated locs")
        with self.subTest(where=where):
            check_invariants(self, h.co.lru)
        if int(h.co.lru.direct[r]):
            slot_loc = h.co.lru.slot_loc[:, r].long()  # (layers, slots)
            held = slot_loc.shape[1]
            expect = torch.full((held,), -1, dtype=torch.long, device=locs.device)
            expect[: min(held, n)] = locs[:held]
            wrong = (slot_loc >= 0) & (slot_loc != expect)
            self.assertFalse(
                bool(wrong.any()),
                f"{where}: slots {wrong.nonzero()[:4].tolist()} (layer, slot) "
                "hold another position's loc",
            )


class TestOneRequestAtATime(_OneRequestAtATime):
    __doc__ = _OneRequestAtATime.__doc__

    def test_server_defaults_four_units(self):
        # The torch swap: the pass's logic at four units (the kernels: below).
        self._run(4, use_triton=False)

    def test_server_defaults_two_units_shadowed(self):
        # The Triton swap, every swap against the torch reference (on CUDA:
        # which kernel output goes wrong first). It checks all that the same
        # pass unshadowed would.
        self._run(2, shadow=True)


@unittest.skipUnless(DEVICE == "cuda", "the GPU bisect; CPU: the class above")
class TestOneRequestAtATimeBisect(_OneRequestAtATime):
    """test_server_defaults_two_units with one thing changed each (the GPU
    fault of docs/ENGINE.md, "Kernel barriers"): which it needs."""

    def _bisect(self):
        self._run(2)

    def test_no_spare_regions(self):
        with mock.patch.object(self, "SPARE_REGIONS", 0):
            self._bisect()

    def test_torch_swap(self):
        # The torch reference swap on CUDA instead of the Triton kernels.
        with mock.patch.object(lru_cache_state_module, "default_use_triton") as t:
            t.return_value = False
            self._bisect()

    def test_kernels_at_4_warps(self):
        with mock.patch.object(triton_swap_module, "default_num_warps", lambda n: 4):
            self._bisect()

    def test_synchronized(self):
        # The host waits for the GPU after every swap and side-stream copy:
        # no two streams' kernels overlap.
        begin = NSAKVOffloadCoordinator.begin_layer_swap
        launch = SparseCacheController._launch_side

        def begin_then_sync(*args, **kwargs):
            begin(*args, **kwargs)
            torch.cuda.synchronize()

        def launch_then_sync(*args, **kwargs):
            event = launch(*args, **kwargs)
            torch.cuda.synchronize()
            return event

        with mock.patch.object(
            NSAKVOffloadCoordinator, "begin_layer_swap", begin_then_sync
        ), mock.patch.object(SparseCacheController, "_launch_side", launch_then_sync):
            self._bisect()


class TestPDDecodeLifecycle(unittest.TestCase):
    """``--disaggregation-mode decode``: no staging, KV arrives in host slots."""

    MAX_UNITS = 1

    def test_transfer_admit_decode_release(self):
        h = torch_harness(
            self,
            kv_fp8=True,
            seed=2,
            kv_arrives_in_host=True,
            max_units=self.MAX_UNITS,
        )
        self.assertEqual(h.allocator.staging.num_pages, 0)
        a, b = h.new_req(), h.new_req()
        h.transfer(a, 300)
        h.transfer(b, 190)
        # Nothing backed up, no staging: the first decode preparation gives
        # the regions and warms them from the host slots (no first-step miss).
        h.decode_step([a, b], first_step_of=(a, b))
        for step in range(8):
            h.decode_step([a, b], pad_rows=step % 2)
        self.assertGreater(h.controller.get_stats()["misses"], 0)
        h.replace_and_drain(a, b)

    def test_retract_and_resume(self):
        # sglang's PD decode retraction keeps a request's KV in CPU memory
        # (get_cpu_copy), frees its locs, and later loads it into new locs.
        h = torch_harness(
            self,
            seed=3,
            kv_arrives_in_host=True,
            num_regions=3,
            max_reqs=3,
            max_units=self.MAX_UNITS,
        )
        a, b = h.new_req(), h.new_req()
        h.transfer(a, 200)
        h.transfer(b, 260)
        h.decode_step([a, b], first_step_of=(a, b))
        for _ in range(4):
            h.decode_step([a, b])
        n = a.seq_len
        old = h.req_to_token[a.req_pool_idx, :n].long()
        saved = h.allocator.get_cpu_copy(old)  # the KV pool's
        old_ref = h.ref[:, old].clone()
        pages = old[::PAGE] // PAGE
        old_index_k = [buf[pages].clone() for buf in h.pool.index_k_with_scale_buffer]
        h.finish(a)
        # Another request takes the freed locs (and overwrites them) first.
        c = h.new_req()
        h.transfer(c, 240)
        a2 = h.new_req()
        zero = torch.zeros(1, dtype=torch.int64)
        seq = torch.tensor([n], dtype=torch.int64)
        new = h.allocator.alloc_extend(
            zero.to(DEVICE), zero, seq.to(DEVICE), seq, zero.to(DEVICE) - 1, n
        )
        h.req_to_token[a2.req_pool_idx, :n] = new.int()
        a2.seq_len = a2.kv_committed_len = n
        h.allocator.load_cpu_copy(saved, new)
        h.ref[:, new] = old_ref
        h.check_host(new)
        new_pages = new[::PAGE] // PAGE
        for buf, before in zip(h.pool.index_k_with_scale_buffer, old_index_k):
            self.assertTrue(torch.equal(buf[new_pages], before))
        # Resumed: admitted by the next decode preparation, reads its KV exactly.
        h.decode_step([b, a2, c], first_step_of=(a2, c))
        for _ in range(3):
            h.decode_step([b, a2, c])
        h.finish(b)
        h.finish(a2)
        h.finish(c)
        h.check_no_leaks()


class TestPDDecodeLifecycleUnits(TestPDDecodeLifecycle):
    """The same with units: free regions are the only source (no staging)."""

    MAX_UNITS = 4


class TestPDDecodeWarmUnits(unittest.TestCase):
    """Warm units: a request (PD decode: its KV transferred; colocated:
    prefilled) is warmed after the rebalance has granted its units, into
    every slot it holds."""

    def _start(self, colocated, seed, lens):
        """A harness with 4 regions and up to 4 units per request, and
        requests of ``lens`` tokens, prefilled or transferred."""
        h = torch_harness(
            self,
            kv_fp8=True,
            seed=seed,
            kv_arrives_in_host=not colocated,
            num_regions=4,
            max_units=4,
        )
        reqs = [h.new_req() for _ in lens]
        if colocated:
            h.prefill(list(zip(reqs, lens)))
        else:
            for req, n in zip(reqs, lens):
                h.transfer(req, n)
        return h, reqs

    @staticmethod
    def _finish(h, colocated, a, b):
        if colocated:
            h.finish(a)
            h.finish(b)
            h.check_no_leaks()
        else:
            h.replace_and_drain(a, b)

    def _first_step_misses(self, colocated=False):
        h, (a, b) = self._start(colocated, 4, (300, 190))
        if colocated:
            # Admitted at the prefill, their units granted and filled then,
            # from the staging rows: nothing read from host memory.
            self.assertEqual(h.co._deferred_warm, {})
            units = [h.controller.num_units(r.req_pool_idx) for r in (a, b)]
            self.assertEqual(units, [2, 2])
            self.assertEqual(h.controller.get_stats()["h2d_rows"], 0)
        # Two free regions: one unit each, 2 x C slots. The first step reads
        # the oldest positions those slots hold (300: from 37; 190: all),
        # none of which one unit's top-k warm-up covers.
        slots = 2 * h.C

        def oldest(n, first_step=False):
            lo = max(0, n - h.W - slots)
            return torch.arange(lo, lo + h.K)

        h.pick_topk = oldest
        h.decode_step([a, b])
        misses = h.controller.get_stats()["misses"]
        del h.pick_topk  # the harness' own top-k again
        self.assertEqual(
            [h.controller.num_units(r.req_pool_idx) for r in (a, b)], [2, 2]
        )
        for _ in range(4):
            h.decode_step([a, b])
        self._finish(h, colocated, a, b)
        return misses

    def test_granted_units_are_warm(self):
        for colocated in (False, True):
            with self.subTest(colocated=colocated):
                self.assertEqual(self._first_step_misses(colocated), 0)

    def test_direct_slots_across_granted_units(self):
        # With direct slots too, a request whose positions below its first
        # window fit the units it was granted is warmed position p into
        # slot p and swaps without the LRU walk; one that does not fit stays
        # on the LRU swap. Reads stay exact (the harness checks them).
        for colocated in (False, True):
            with self.subTest(colocated=colocated):
                # Two units each (2 x 128 slots): 300 tokens do not fit, 190 do.
                h, (a, b) = self._start(colocated, 7, (300, 190))
                h.decode_step([a, b])
                lru = h.controller.lru
                direct = [int(lru.direct[r.req_pool_idx]) for r in (a, b)]
                self.assertEqual(direct, [0, 1])
                # Both admissions warmed: A's window and as many positions
                # below it as its 256 slots hold, B's whole prompt.
                ctrl = h.controller
                win_start = 300 + 1 - ctrl.recent_window
                rows = (300 - win_start + min(256, win_start)) + 190
                warmed = ctrl.get_stats()
                self.assertEqual(warmed["warmed_requests"], 2)
                self.assertEqual(
                    warmed["warmed_bytes"], rows * ctrl.layer_num * ctrl.row_bytes
                )
                rb = b.req_pool_idx
                self.assertEqual(
                    lru.slot_loc[0, rb, :150].tolist(),
                    h.co.req_to_token[rb, :150].tolist(),
                )
                for _ in range(4):
                    h.decode_step([a, b])
                self.assertEqual(int(lru.direct[rb]), 1)
                # The decode log line counts the requests in direct mode.
                self.assertEqual(h.controller.get_stats()["direct_requests"], 1)
                line = h.co.get_decode_log_msg()
                self.assertIn(", direct: 1", line)
                gb = rows * ctrl.layer_num * ctrl.row_bytes / 1e9
                self.assertIn(f", warmed: 2 ({gb:.2f} GB)", line)
                # Read and reset: no admission since, no "warmed".
                self.assertNotIn("warmed", h.co.get_decode_log_msg())
                self._finish(h, colocated, a, b)
                self.assertEqual(h.controller.get_stats()["direct_requests"], 0)

    def test_units_sized_to_the_context(self):
        # A request is lent no unit beyond what holds its prompt plus
        # max_new_tokens: b (100 + 10 tokens) keeps one unit, so a gets the
        # three that hold its 300 tokens whole and swaps in direct mode (an
        # even split, 2 + 2, leaves a on the LRU swap: the test above).
        for colocated in (False, True):
            with self.subTest(colocated=colocated):
                h = torch_harness(
                    self,
                    kv_fp8=True,
                    seed=8,
                    kv_arrives_in_host=not colocated,
                    num_regions=4,
                    max_units=4,
                )
                a, b = h.new_req(), h.new_req()
                b.origin_input_ids = list(range(100))
                b.sampling_params.max_new_tokens = 10
                if colocated:
                    h.prefill([(a, 300), (b, 100)])
                else:
                    h.transfer(a, 300)
                    h.transfer(b, 100)
                h.decode_step([a, b])
                units = [h.controller.num_units(r.req_pool_idx) for r in (a, b)]
                self.assertEqual(units, [3, 1])
                direct = [int(h.controller.lru.direct[r.req_pool_idx]) for r in (a, b)]
                self.assertEqual(direct, [1, 1])
                for _ in range(4):
                    h.decode_step([a, b])
                self._finish(h, colocated, a, b)

    def test_finished_at_prefill(self):
        # Colocated: warmed with its units at the prefill's admission, then
        # released before any decode step (e.g. max_new_tokens 1): its units
        # go back, b takes them at the next rebalance, nothing leaks.
        h = torch_harness(
            self,
            kv_fp8=True,
            seed=6,
            num_regions=4,
            max_units=4,
        )
        a, b = h.new_req(), h.new_req()
        h.prefill([(a, 200), (b, 150)])
        self.assertEqual(h.co._deferred_warm, {})
        self.assertEqual(h.controller.num_units(a.req_pool_idx), 2)
        h.finish(a)
        for _ in range(3):
            h.decode_step([b])
        self.assertEqual(h.controller.num_units(b.req_pool_idx), 4)
        h.finish(b)
        h.check_no_leaks()


class TestPDDecodeLeveling(unittest.TestCase):
    """Two PD requests admitted together into a pool a running request's
    units fill: the rebalance moves region units to them, reads stay exact."""

    def test_burst_admission_moves_units(self):
        h = torch_harness(
            self,
            kv_fp8=True,
            seed=5,
            kv_arrives_in_host=True,
            num_regions=6,
            max_reqs=3,
            max_units=4,
        )
        units = h.controller.num_units
        a, b, c = h.new_req(), h.new_req(), h.new_req()
        h.transfer(a, 300)
        h.decode_step([a], first_step_of=(a,))
        self.assertEqual(units(a.req_pool_idx), 4)  # 3 of 5 free regions
        h.decode_step([a])
        h.transfer(b, 260)
        h.transfer(c, 200)
        h.decode_step([a, b, c], first_step_of=(b, c))
        # b and c took the two free regions; a gave 2 of its 3 units.
        self.assertEqual([units(r.req_pool_idx) for r in (a, b, c)], [2, 2, 2])
        self.assertEqual(h.controller.get_stats()["units_moved"], 2)
        for _ in range(4):
            h.decode_step([a, b, c])
        h.finish(a)
        h.replace_and_drain(b, c)


class TestPDDecodeTransferTarget(unittest.TestCase):
    def test_kv_manager_registers_the_host_pool(self):
        # Patch 0005: DecodePreallocQueue._init_kv_manager gives the KV transfer
        # the host pool's per-layer buffers (page p of a layer at p * page
        # bytes, like the device pool's) and the GPU indexer keys as NSA state.
        from sglang.srt.disaggregation import decode as decode_module
        from sglang.srt.disaggregation.utils import TransferBackend

        h = torch_harness(self, kv_fp8=True, kv_arrives_in_host=True)
        queue = decode_module.DecodePreallocQueue.__new__(
            decode_module.DecodePreallocQueue
        )
        queue.transfer_backend = TransferBackend.FAKE
        queue.tp_rank = queue.pp_rank = 0
        queue.scheduler = SimpleNamespace(
            enable_hisparse=False,
            nsa_kv_offload=h.co,
            dp_rank=0,
            # 0.5.17 reads these there:
            ps=SimpleNamespace(dp_rank=0, gpu_id=0),
            tp_worker=SimpleNamespace(
                model_runner=SimpleNamespace(kv_cache_dtype_str="fp8_e4m3")
            ),
            gpu_id=0,
            model_config=SimpleNamespace(num_hidden_layers=h.L),
            server_args=SimpleNamespace(disaggregation_ib_device=None),
        )
        queue.token_to_kv_pool = h.pool
        queue.draft_token_to_kv_pool = None
        queue.metadata_buffers = SimpleNamespace(get_buf_infos=lambda: ([], [], []))
        queue.is_mla_backend = True
        queue.enable_staging = False

        # The attention-TP size comes from the runtime context.
        def one_rank():
            stack = contextlib.ExitStack()
            parallel = SimpleNamespace(attn_tp_size=1, dp_rank=0)
            stack.enter_context(
                mock.patch.object(decode_module, "get_parallel", return_value=parallel)
            )
            if hasattr(decode_module, "get_disagg"):  # 0.5.23: no host receive
                disagg = SimpleNamespace(
                    disaggregation_decode_host_receive_threshold=1,
                    disaggregation_ib_device=None,
                )
                device = SimpleNamespace(gpu_id=0)
                for name, value in (("get_disagg", disagg), ("get_device", device)):
                    if hasattr(decode_module, name):
                        stack.enter_context(
                            mock.patch.object(decode_module, name, return_value=value)
                        )
            return stack

        with one_rank():
            kv_args = queue._init_kv_manager().kv_args
        host = h.controller.host_pool
        self.assertEqual(
            kv_args.kv_data_ptrs, [buf.data_ptr() for buf in host.kv_buffer]
        )
        self.assertEqual(kv_args.kv_item_lens, [PAGE * h.row_bytes] * h.L)
        self.assertEqual(kv_args.page_size, PAGE)
        self.assertEqual(  # one state component: the indexer keys
            kv_args.state_data_ptrs,
            [[buf.data_ptr() for buf in h.pool.index_k_with_scale_buffer]],
        )
        # Without the offload the device pool stays the target.
        queue.scheduler.nsa_kv_offload = None
        with one_rank():
            kv_args = queue._init_kv_manager().kv_args
        self.assertEqual(
            kv_args.kv_data_ptrs, [buf.data_ptr() for buf in h.pool.kv_buffer]
        )


class TestIdleLeakCheck(unittest.TestCase):
    """The offload's check at sglang's idle leak check: a region, a lent unit
    or a staging page left behind is reported, through the scheduler's own
    ``on_idle`` and as loudly as its pool check (it raises by default)."""

    def _on_idle(self, coordinator):
        # Scheduler.on_idle reports through its InvariantChecker.
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components.invariant_checker import (
            SchedulerInvariantChecker,
        )

        checker = types.SimpleNamespace(
            _check_all_pools=lambda ps: (False, []),
            _check_req_pool=lambda: None,
            _check_tree_cache=lambda: None,
        )
        checker._report_leak = lambda *a: SchedulerInvariantChecker._report_leak(
            checker, *a
        )
        noop = types.SimpleNamespace(
            get_pool_stats=lambda: None,
            _maybe_log_idle_metrics=lambda: None,
            publish_kv_events=lambda: None,
            reset=lambda: None,
            # 0.5.23's on_idle reads these too.
            drop_sync_wait_carry=lambda: None,
            record_scheduler_idle=lambda: None,
            record=lambda stage: contextlib.nullcontext(),
            enter=lambda stage: None,
            exit=lambda previous: None,
            _trace_stage=None,
            verify_byte_accounting=lambda: [],
            publish_load_stat=lambda *args, **kwargs: None,
            get_loads=None,
        )
        sched = types.SimpleNamespace(
            dp_attn_adapter=noop,
            scheduler_stage_metrics=noop,
            disaggregation_mode=None,
            token_to_kv_pool_allocator=noop,
            load_publisher=noop,
            load_inquirer=noop,
            maybe_send_health_check_signal=lambda: None,
            is_fully_idle=lambda: True,
            enable_unified_memory=False,
            enable_hisparse=False,
            invariant_checker=checker,
            pool_stats_observer=noop,
            metrics_reporter=noop,
            kv_events_publisher=noop,
            new_token_ratio_tracker=noop,
            publish_load_snapshot=lambda force: None,
            maybe_sleep_on_idle=lambda: None,
            nsa_kv_offload=coordinator,
        )
        Scheduler.on_idle(sched)

    def test_clean_after_lifecycle(self):
        h = torch_harness(self, max_units=4, lend_staging_pages=4)
        a = h.new_req()
        h.prefill([(a, 190)])
        h.decode_step([a], first_step_of=(a,))
        self.assertGreater(h.controller.num_units(a.req_pool_idx), 1)
        self.assertIn("still admitted", h.co.check_idle())
        h.finish(a)
        self.assertEqual(h.co.check_idle(), "")
        self._on_idle(h.co)  # does not raise

    def test_leaked_region_and_units_reported(self):
        h = torch_harness(self, max_units=4, lend_staging_pages=4)
        a = h.new_req()
        h.prefill([(a, 190)])
        h.decode_step([a], first_step_of=(a,))
        # Inject: the scheduler goes idle without the request's release.
        msg = h.co.check_idle()
        self.assertIn("1 request(s) still admitted", msg)
        self.assertIn("decode regions free: 0 of 2", msg)
        self.assertIn("still lent by", msg)
        with self.assertRaises(ValueError) as ctx:
            self._on_idle(h.co)
        self.assertIn("NSA KV offload memory leak detected!", str(ctx.exception))
        self.assertIn("still admitted", str(ctx.exception))

    def test_leaked_staging_page_reported(self):
        h = torch_harness(self)
        pages = h.allocator.staging.alloc(1)  # inject: a page never freed
        self.assertIsNotNone(pages)
        self.assertIn("staging pages free: 9 of 10", h.co.check_idle())
        with self.assertRaises(ValueError):
            self._on_idle(h.co)
        h.allocator.staging.free(pages)
        self.assertEqual(h.co.check_idle(), "")


class TestMetrics(unittest.TestCase):
    """The coordinator feeds its Prometheus collector where the decode log
    reads its counters: the exported totals are what the logs reported."""

    def test_decode_log_feeds_metrics(self):
        from prometheus_client import CollectorRegistry

        h = torch_harness(self, max_units=4, lend_staging_pages=4)
        registry, labels = CollectorRegistry(), {"tp_rank": "0"}
        h.co.enable_metrics(labels, registry)

        def value(name):
            return registry.get_sample_value("sglang:nsa_kv_offload_" + name, labels)

        a = h.new_req()
        h.prefill([(a, 300)])
        h.decode_step([a], first_step_of=(a,))
        stats = h.co.get_stats()
        self.assertGreater(stats["d2h_bytes"], 0)  # the prefill's backup
        self.assertEqual(value("d2h_bytes_total"), stats["d2h_bytes"])
        # Alone, A holds its region and the other one as an extra unit.
        self.assertEqual(value("decode_regions_used"), 2)
        self.assertEqual(value("extra_units_used"), stats["extra_units"])
        self.assertEqual(value("host_pool_used_tokens"), stats["host_used_tokens"])
        self.assertGreaterEqual(stats["host_used_tokens"], 300)
        self.assertEqual(value("host_pool_total_tokens"), h.allocator.size)
        misses_before, logged = value("misses_total") or 0, 0
        for _ in range(4):
            h.decode_step([a])
            line = h.co.get_decode_log_msg()
            logged += int(re.search(r"misses: (\d+)", line).group(1))
        # Each read reset the controller: the total adds up the intervals.
        self.assertEqual((value("misses_total") or 0) - misses_before, logged)
        lookups = sum(
            value(name) or 0
            for name in ("lru_hits_total", "window_hits_total", "misses_total")
        )
        self.assertGreater(lookups, 0)
        h.finish(a)
        # No decode log at idle: the idle check refreshes the gauges and adds
        # the counts of the decode steps no log line read.
        b = h.new_req()
        h.prefill([(b, 200)])
        h.decode_step([b], first_step_of=(b,))
        logged = h.co.get_stats()
        self.assertGreater(logged["regions_used"], 0)
        self.assertEqual(value("decode_regions_used"), logged["regions_used"])
        h.decode_step([b])
        tail = h.co.controller.get_stats()  # read, not reset
        unlogged = tail["lru_hits"] + tail["window_hits"] + tail["misses"]
        self.assertGreater(unlogged, 0)
        h.finish(b)

        def lookups():
            names = ("lru_hits_total", "window_hits_total", "misses_total")
            return sum(value(n) or 0 for n in names)

        before = lookups()
        self.assertEqual(h.co.check_idle(), "")
        self.assertEqual(value("decode_regions_used"), 0)
        self.assertEqual(value("extra_units_used"), 0)
        self.assertEqual(value("staging_rows_used"), 0)
        self.assertEqual(lookups() - before, unlogged)
        # While idle, at most once a second (sglang checks every iteration).
        reads = []
        h.co.get_stats = lambda: reads.append(1)
        self.assertEqual(h.co.check_idle(), "")
        self.assertEqual(reads, [])
        h.check_no_leaks()


if __name__ == "__main__":
    unittest.main()
