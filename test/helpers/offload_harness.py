"""A real-pools harness of the decode NSA KV offload for CPU tests.

``OffloadHarness`` builds the real ``NSAKVOffloadTokenToKVPool`` (an sglang
``DSATokenToKVPool``), ``ReqToTokenPool``, ``NSAKVOffloadTokenToKVPoolAllocator``
(an sglang ``PagedTokenToKVPoolAllocator``), a disabled tree cache
(``ChunkCache``; 0.5.23: a ``UnifiedRadixCache`` with the radix cache off) and the
``NSAKVOffloadCoordinator``, then plays the scheduler and the model with small
fake ``Req`` / ``ScheduleBatch`` / ``ForwardBatch`` objects: chunked prefill,
admission, decode steps whose every layer's page table must hold exactly the
KV of the picked positions (against a full-KV reference the harness keeps),
PD transfers, and finish / abort / retract through sglang's own
``release_kv_cache``, with leak checks.

On CPU the Triton kernels run in the interpreter; upstream's
``alloc_extend_kernel`` does not, so ``setUpModule`` (of the tests that use
the harness) swaps in a torch transcription (``TorchAllocExtendKernel``).

The model's KV writes and reads (``set_mla_kv_buffer``, ``get_mla_kv_buffer``)
go through torch equivalents of sglang's Triton write, read and fp8
quantization kernels by default (:func:`set_mla_kv_rows_torch`,
:func:`get_mla_kv_rows_torch`, :func:`quantize_k_cache_separate_torch`;
``test_nsa_kv_offload_integration.TestKVWriteEquivalents`` holds them to
sglang's); under the CPU interpreter those kernels run one program per row
and took most of the harness' time. ``OffloadHarness(real_kv_write=True)`` keeps sglang's own.
``OffloadHarness(use_triton=False)`` builds the coordinator with the torch
reference swap and copies instead of the Triton kernels (for tests of the
offload's logic, not of its kernels; the default is the product's choice).
"""

import contextlib
import dataclasses
import sys
from types import SimpleNamespace
from unittest import mock

import torch
from sglang.srt.arg_groups.nsa_kv_offload_hook import NSAKVOffloadOptions
from sglang.srt.layers.attention import nsa_offload_hooks
from sglang.srt.managers.nsa_kv_offload_coordinator import NSAKVOffloadCoordinator
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache import common as common_module
from sglang.srt.mem_cache import lru_cache_state as lru_cache_state_module
from sglang.srt.mem_cache import memory_pool as memory_pool_module
from sglang.srt.mem_cache import sparse_cache_controller as controller_module
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.lru_cache_state import LayerSwapPlan
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.nsa_kv_offload_pool import (
    NSAKVOffloadTokenToKVPool,
    NSAKVOffloadTokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.nsa_kv_offload_sizing import NSAKVOffloadPoolSizes
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sparse_backend import forward_backend

# What moved between the sglang versions the harness runs on (0.5.17 and
# later): get_last_loc_torch, the module of the paged allocator's kernels
# (a package on 0.5.17) and the server args release_kv_cache reads.
try:
    from sglang.srt.mem_cache.common import get_last_loc_torch
except ImportError:
    from sglang.srt.mem_cache.allocation import get_last_loc_torch
allocator_module = sys.modules[NSAKVOffloadTokenToKVPoolAllocator.__mro__[1].__module__]
# 0.5.23: the request's KV record holds its row and lengths, the radix cache
# off is a disabled UnifiedRadixCache, release_kv_cache takes ``checkpoint``.
REQ_KV_RECORD = "req_pool_idx" in {f.name for f in dataclasses.fields(ReqKvInfo)}
RELEASE_ARGS = {"checkpoint": False} if REQ_KV_RECORD else {}


def disabled_tree_cache(req_to_token_pool, allocator):
    """The tree cache of ``--disable-radix-cache``."""
    params = CacheInitParams(
        disable=True,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
    )
    if not REQ_KV_RECORD:
        from sglang.srt.mem_cache.chunk_cache import ChunkCache

        return ChunkCache(params)
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params.tree_components = (ComponentType.FULL,)
    return UnifiedRadixCache(params)


RELEASE_KV_CACHE_ARGS = [
    name
    for name in ("get_global_server_args", "get_spec", "get_serving")
    if hasattr(common_module, name)
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

PAGE = 64
KV_LORA_RANK = 512
ROPE_DIM = 64
INDEX_HEAD_DIM = 128
KV_DIM_BF16 = KV_LORA_RANK + ROPE_DIM  # 576 x bf16 = 1152 B
KV_DIM_FP8 = 656  # FlashMLA fp8 layout: 512 fp8 + 4 x fp32 scales + 64 x bf16


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class TorchAllocExtendKernel:
    """Torch transcription of ``allocator.alloc_extend_kernel`` (same grid call
    and outputs) for CPU runs: the Triton original does not run under the
    interpreter. Per request: fill the old partial page after ``last_loc``,
    then the new pages taken in order from ``free_pages``."""

    def __getitem__(self, grid):
        def launch(pre_lens, seq_lens, last_loc, free_pages, out, bs_upper, page):
            out_start = page_start = 0
            arange = torch.arange(page, device=out.device)
            for pre, seq, last in zip(
                pre_lens.tolist(), seq_lens.tolist(), last_loc.tolist()
            ):
                new_pages = (seq + page - 1) // page - (pre + page - 1) // page
                part1 = min(seq, (pre + page - 1) // page * page) - pre
                out[out_start : out_start + part1] = last + 1 + arange[:part1]
                rest = seq - pre - part1
                if rest > 0:
                    pages = free_pages[page_start : page_start + new_pages]
                    locs = (pages[:, None] * page + arange).reshape(-1)[:rest]
                    out[out_start + part1 : out_start + seq - pre] = locs
                out_start += seq - pre
                page_start += new_pages

        return launch


UPSTREAM_ALLOC_EXTEND = allocator_module.alloc_extend_kernel
_alloc_extend_patch = mock.patch.object(
    allocator_module, "alloc_extend_kernel", TorchAllocExtendKernel()
)


def setUpModule():
    """``setUpModule`` of a test module that uses the harness (import it)."""
    if DEVICE == "cpu":
        _alloc_extend_patch.start()


def tearDownModule():
    if DEVICE == "cpu":
        _alloc_extend_patch.stop()


def make_pool(sizes, layer_num, kv_fp8=False, verify=False):
    return NSAKVOffloadTokenToKVPool(
        sizes.num_locs,
        sizes=sizes,
        verify=verify,
        page_size=PAGE,
        kv_lora_rank=KV_LORA_RANK,
        dtype=torch.float8_e4m3fn if kv_fp8 else torch.bfloat16,
        qk_rope_head_dim=ROPE_DIM,
        layer_num=layer_num,
        device=DEVICE,
        index_head_dim=INDEX_HEAD_DIM,
        enable_memory_saver=False,
        kv_cache_dim=KV_DIM_FP8 if kv_fp8 else KV_DIM_BF16,
    )


def set_mla_kv_rows_torch(kv_buffer, loc, cache_k_nope, cache_k_rope):
    """What sglang's ``set_mla_kv_buffer_triton`` does: row ``loc[i]`` of
    ``kv_buffer`` = ``[nope_i | rope_i]``, converted to the buffer's dtype."""
    n = loc.numel()
    nope = cache_k_nope.reshape(n, -1)
    rope = cache_k_rope.reshape(n, -1)
    rows = kv_buffer.view(kv_buffer.shape[0], -1)
    idx = loc.to(rows.device, torch.int64)
    rows[idx, : nope.shape[1]] = nope.to(rows.dtype)
    rows[idx, nope.shape[1] : nope.shape[1] + rope.shape[1]] = rope.to(rows.dtype)


def get_mla_kv_rows_torch(kv_buffer, loc, cache_k_nope, cache_k_rope):
    """What sglang's ``get_mla_kv_buffer_triton`` does: ``cache_k_nope[i]`` /
    ``cache_k_rope[i]`` = the two parts of row ``loc[i]`` of ``kv_buffer``,
    converted to their dtype."""
    n = loc.numel()
    nope_dim, rope_dim = cache_k_nope.shape[-1], cache_k_rope.shape[-1]
    rows = kv_buffer.view(kv_buffer.shape[0], -1)[loc.to(kv_buffer.device).long()]
    cache_k_nope.view(n, nope_dim).copy_(rows[:, :nope_dim])
    cache_k_rope.view(n, rope_dim).copy_(rows[:, nope_dim : nope_dim + rope_dim])


def quantize_k_cache_separate_torch(k_nope, k_rope, tile_size=128):
    """What sglang's ``quantize_k_cache_separate`` returns (its Triton
    ``_quantize_k_cache_fast_kernel``), in torch: per token, the 512 nope
    values as fp8 e4m3 in tiles of ``tile_size`` with one fp32 scale each
    (``amax / 448``), then the 64 rope values' bf16 bytes. Returns
    ``(nope_part, rope_part)``, uint8 of shapes (n, 1, 528) and (n, 1, 128)."""
    nope = (k_nope.squeeze(1) if k_nope.ndim == 3 else k_nope).float()
    rope = k_rope.squeeze(1) if k_rope.ndim == 3 else k_rope
    n, dim_nope = nope.shape
    fp8 = torch.finfo(torch.float8_e4m3fn)
    tiles = nope.view(n, dim_nope // tile_size, tile_size)
    scale = tiles.abs().amax(dim=-1) / fp8.max
    quant = (tiles * (1.0 / scale).unsqueeze(-1)).clamp(fp8.min, fp8.max)
    quant = quant.to(torch.float8_e4m3fn).view(n, dim_nope).view(torch.uint8)
    nope_part = torch.cat([quant, scale.contiguous().view(torch.uint8)], dim=1)
    rope_part = rope.contiguous().view(torch.uint8)
    return nope_part.unsqueeze(1), rope_part.unsqueeze(1)


def torch_kv_write_patches():
    """Patchers putting :func:`set_mla_kv_rows_torch`,
    :func:`get_mla_kv_rows_torch` and :func:`quantize_k_cache_separate_torch`
    in place of sglang's Triton KV write, read and fp8 quantization (what
    ``set_mla_kv_buffer`` / ``get_mla_kv_buffer`` call)."""
    return [
        mock.patch.object(
            memory_pool_module, "set_mla_kv_buffer_triton", set_mla_kv_rows_torch
        ),
        mock.patch.object(
            memory_pool_module, "get_mla_kv_buffer_triton", get_mla_kv_rows_torch
        ),
        mock.patch.object(
            memory_pool_module,
            "quantize_k_cache_separate",
            quantize_k_cache_separate_torch,
        ),
    ]


@contextlib.contextmanager
def torch_swap_and_copies():
    """Controllers built inside pick the torch reference LRU swap and the
    torch row copies (what they run without CUDA or the interpreter)."""
    with mock.patch.object(
        lru_cache_state_module, "default_use_triton", lambda device: False
    ), mock.patch.object(controller_module, "copy_kernels_interpreted", lambda: False):
        yield


def layer_arg(layer_id):
    # set_mla_kv_buffer / get_mla_kv_buffer only read ``layer.layer_id``.
    return SimpleNamespace(layer_id=layer_id)


def make_options(top_k=64, buffer_size=128, recent_window=8, max_units=1, **kw):
    """``NSAKVOffloadOptions`` for a coordinator built by hand (the server
    derives them from its args); ``kw`` overrides the other fields."""
    fields = dict(
        host_pool_gb=1.0,
        query_tokens=1,
        kv_arrives_in_host=False,
        shares_host_pool=False,
        prefill_budget=0,
        cuda_graph_max_bs=0,
        verify=None,
    )
    fields.update(kw)
    return NSAKVOffloadOptions(
        top_k=top_k,
        buffer_size=buffer_size,
        recent_window=recent_window,
        max_units=max_units,
        **fields,
    )


class FakeReq:
    """What the offload, ReqToTokenPool, ChunkCache and release_kv_cache read
    of a ``Req`` (no output tokens: ``seq_len`` is all committed KV)."""

    def __init__(self, rid):
        self.rid = rid
        self.req_pool_idx = None
        self.mamba_pool_idx = None
        self.is_chunked = 0
        self.inflight_middle_chunks = 0
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.fill_ids = []
        self.seq_len = 0
        # The offload caps a request's units by prompt + max_new_tokens;
        # None (no cap) unless a test sets it.
        self.origin_input_ids = []
        self.sampling_params = SimpleNamespace(max_new_tokens=None)

    @property
    def kv(self):
        """0.5.17's ``ReqKvInfo``: held with the request slot, all committed."""
        if self.req_pool_idx is None:
            return None
        return SimpleNamespace(kv_allocated_len=self.kv_committed_len)

    @kv.setter
    def kv(self, value):
        pass  # release_kv_cache drops it with the request slot

    def effective_kv_committed_len(self):
        return self.kv_committed_len

    def pop_committed_kv_cache(self):
        return self.kv_committed_len

    def pop_overallocated_kv_cache(self):
        return self.kv_committed_len, self.kv_committed_len


class FakeReq23(FakeReq):
    """0.5.23: the row and the KV lengths on a real ``ReqKvInfo``."""

    kv = None  # the record (an attribute, not FakeReq's view)

    def __init__(self, rid):
        self.kv = ReqKvInfo()
        super().__init__(rid)
        self.lock, self.session, self.skip_radix_cache_insert = None, None, True

    def _on_kv(name):
        return property(
            lambda req: getattr(req.kv, name),
            lambda req, value: setattr(req.kv, name, value),
        )

    req_pool_idx = _on_kv("req_pool_idx")
    kv_allocated_len = _on_kv("kv_allocated_len")
    cache_protected_len = _on_kv("cache_protected_len")
    del _on_kv

    @property
    def kv_committed_len(self):
        return self.kv.kv_committed_len

    @kv_committed_len.setter
    def kv_committed_len(self, value):
        # Committed KV is allocated KV (no over-allocation unless a test sets it).
        self.kv.kv_committed_len = value
        self.kv.kv_allocated_len = max(self.kv.kv_allocated_len, value)

    def owned_kv_len(self):
        return self.kv.kv_committed_len

    def finished(self):
        return True


if REQ_KV_RECORD:
    FakeReq = FakeReq23  # noqa: F811


# The fields of the global ServerArgs that release_kv_cache reads.
GLOBAL_SERVER_ARGS = SimpleNamespace(
    page_size=PAGE, speculative_algorithm=None, strip_thinking_cache=False
)


@contextlib.contextmanager
def release_kv_cache_args(server_args=GLOBAL_SERVER_ARGS):
    """``release_kv_cache`` (and what it calls) reading ``server_args``."""
    with contextlib.ExitStack() as stack:
        for name in RELEASE_KV_CACHE_ARGS:
            patch = mock.patch.object(common_module, name, return_value=server_args)
            stack.enter_context(patch)
        yield


class OffloadHarness:
    """Real pools + coordinator; the test plays scheduler and model."""

    def __init__(
        self,
        test,
        kv_fp8=False,
        layers=2,
        top_k=64,
        buffer_size=128,
        window=8,
        num_locs=16 * PAGE,
        num_regions=2,
        staging_pages=10,
        max_reqs=2,
        max_ctx=768,
        seed=0,
        kv_arrives_in_host=False,
        max_units=1,
        lend_staging_pages=0,
        spare_regions=0,
        idle_loc_units=0,
        host_pool_group=None,
        query_tokens=1,
        verify=None,
        use_triton=None,
        real_kv_write=False,
    ):
        self.t = test
        if not real_kv_write:
            for patcher in torch_kv_write_patches():
                patcher.start()
                test.addCleanup(patcher.stop)
        if kv_arrives_in_host:
            staging_pages = 0  # a PD decode server runs no prefill
        self.L, self.K, self.C, self.W = layers, top_k, buffer_size, window
        self.kv_fp8 = kv_fp8
        self.sizes = NSAKVOffloadPoolSizes(
            num_locs=num_locs,
            num_regions=num_regions,
            region_rows=buffer_size + window,
            staging_rows=staging_pages * PAGE,
            page_size=PAGE,
            host_capacity_locs=num_locs,
            num_spare_regions=spare_regions,
            idle_loc_units=idle_loc_units,
        )
        self.options = make_options(
            top_k=top_k,
            buffer_size=buffer_size,
            recent_window=window,
            max_units=max_units,
            query_tokens=query_tokens,
            kv_arrives_in_host=kv_arrives_in_host,
            shares_host_pool=host_pool_group is not None,
            verify=verify,
        )
        self.pool = make_pool(self.sizes, layers, kv_fp8, verify=verify is not None)
        self.allocator = NSAKVOffloadTokenToKVPoolAllocator(
            num_locs,
            page_size=PAGE,
            dtype=self.pool.dtype,
            device=DEVICE,
            kvcache=self.pool,
            need_sort=False,
            staging_start_row=self.sizes.staging_start_row,
            staging_rows=self.sizes.staging_rows,
            speculative=query_tokens > 1,
        )
        self.req_to_token_pool = ReqToTokenPool(
            size=max_reqs,
            max_context_len=max_ctx,
            device=DEVICE,
            enable_memory_saver=False,
        )
        self.req_to_token = self.req_to_token_pool.req_to_token
        kernels = contextlib.nullcontext()
        if use_triton is False:
            kernels = torch_swap_and_copies()
        with kernels:
            self.co = NSAKVOffloadCoordinator(
                self.pool,
                self.allocator,
                self.req_to_token,
                self.options,
                max_batch_size=max_reqs + 1,
                staging_reserve_pages=staging_pages - lend_staging_pages,
                host_pool_group=host_pool_group,
            )
        self.controller = self.co.controller
        if use_triton is not None:
            test.assertEqual(self.controller.lru.use_triton, use_triton)
            if DEVICE == "cpu":  # on CUDA the copies are always the kernels
                test.assertEqual(self.controller.use_triton_copy, use_triton)
        self.row_bytes = self.pool.kv_buffer[0][0].nbytes
        # Full KV of every loc and layer as stored bytes (the reference).
        self.ref = torch.zeros(
            (layers, num_locs + PAGE, self.row_bytes), dtype=torch.uint8, device=DEVICE
        )
        self.tree_cache = disabled_tree_cache(self.req_to_token_pool, self.allocator)
        # What the scheduler wires (get_nsa_kv_offload).
        self.tree_cache.nsa_kv_offload = self.co
        self.gen = torch.Generator().manual_seed(seed)
        # The indexer keys written per (layer, page): with the arena, KV rows
        # lent from free pages must never land on a page in use.
        self.index_ref = {}
        self.page_tables = []  # every decode layer's, in order
        self.initial = self.snapshot()
        self.next_rid = 0
        # What the stream tests replace: the context a forward runs in (the
        # scheduler's forward stream under the overlap scheduler; it is given
        # the batch's tensors, which the scheduler keeps until the forward's
        # result is processed) and the one a decode forward's layers run in
        # (a CUDA-graph replay).
        self.forward_context = contextlib.nullcontext
        self.decode_graph_context = contextlib.nullcontext

    # -------------------------------------------------------------- helpers

    def staging_room(self):
        """Free staging pages plus those lent to requests as extra units
        (a prefill takes them back)."""
        lent = self.controller.get_stats()["extra_units_lent"]
        return self.allocator.staging.available_pages() + lent * -(-self.C // PAGE)

    def snapshot(self):
        return dict(
            locs=self.allocator.available_size(),
            staging=self.staging_room(),
            regions=self.controller.admission_room(),
            req_slots=self.req_to_token_pool.available_size(),
        )

    def rows_bytes(self, layer, rows):
        return (
            self.pool.kv_buffer[layer].view(torch.uint8).view(-1, self.row_bytes)[rows]
        )

    def host_bytes(self, layer, locs):
        host = self.controller.host_pool.kv_buffer[layer]
        return host[locs.to(host.device)].to(locs.device)

    def new_req(self):
        req = FakeReq(f"r{self.next_rid}")
        self.next_rid += 1
        self.t.assertIsNotNone(self.req_to_token_pool.alloc([req]))
        return req

    def write_kv(self, locs):
        """The model's KV write of every layer for ``locs``; records the reference."""
        n = locs.numel()
        for layer in range(self.L):
            nope = torch.randn((n, 1, KV_LORA_RANK), generator=self.gen)
            rope = torch.randn((n, 1, ROPE_DIM), generator=self.gen)
            nope = nope.to(DEVICE, torch.bfloat16)
            rope = rope.to(DEVICE, torch.bfloat16)
            self.pool.set_mla_kv_buffer(layer_arg(layer), locs, nope, rope)
            stored = self.rows_bytes(layer, self.pool.loc_to_row[locs])
            if not self.kv_fp8:
                # bf16 rows are the inputs, bit for bit.
                expect = torch.cat([nope, rope], dim=-1).reshape(n, -1)
                self.t.assertTrue(torch.equal(stored.view(torch.bfloat16), expect))
                k_nope, k_rope = self.pool.get_mla_kv_buffer(layer_arg(layer), locs)
                self.t.assertTrue(torch.equal(k_nope, nope))
                self.t.assertTrue(torch.equal(k_rope, rope))
            self.ref[layer, locs] = stored

    def check_host(self, locs):
        self.controller.synchronize()
        sync()
        for layer in range(self.L):
            self.t.assertTrue(
                torch.equal(self.host_bytes(layer, locs), self.ref[layer, locs]),
                f"host rows of layer {layer} differ from the written KV",
            )

    # -------------------------------------------------------------- phases

    def transfer(self, req, n):
        """PD decode: ``DecodePreallocQueue._pre_alloc`` takes ``n`` locs with
        ``alloc_extend``, then the prefill server's KV transfer writes every
        layer's rows into host slots = locs and the indexer keys into their
        pages (through the host pool's ``get_contiguous_buf_infos``)."""
        zero = torch.zeros(1, dtype=torch.int64)
        seq = torch.tensor([n], dtype=torch.int64)
        out = self.allocator.alloc_extend(
            zero.to(DEVICE), zero, seq.to(DEVICE), seq, zero.to(DEVICE) - 1, n
        )
        self.t.assertIsNotNone(out)
        # No GPU row: the decode step writes its new tokens into the window.
        self.t.assertTrue(bool((self.pool.loc_to_row[out] == 0).all()))
        self.req_to_token[req.req_pool_idx, :n] = out.int()
        req.seq_len = req.kv_committed_len = n
        req.fill_ids = list(range(n))
        ptrs, lens, item_lens = self.controller.host_pool.get_contiguous_buf_infos()
        self.t.assertEqual(item_lens, [PAGE * self.row_bytes] * self.L)
        for layer in range(self.L):
            host = self.controller.host_pool.kv_buffer[layer]
            self.t.assertEqual(host.data_ptr(), ptrs[layer])
            rows = torch.randint(
                0, 256, (n, self.row_bytes), dtype=torch.uint8, generator=self.gen
            )
            host[out.cpu()] = rows
            self.ref[layer, out] = rows.to(DEVICE)
            pages = out[::PAGE] // PAGE
            index_k = self.pool.index_k_with_scale_buffer[layer]
            index_k[pages] = torch.randint(
                0, 256, index_k[pages].shape, dtype=torch.uint8, generator=self.gen
            ).to(DEVICE)
            for page, keys in zip(pages.tolist(), index_k[pages]):
                self.index_ref[layer, page] = keys.clone()
        return out

    def check_index_keys(self, reqs):
        """The indexer keys of every page ``reqs`` hold are as written."""
        for req in reqs:
            locs = self.req_to_token[req.req_pool_idx, : req.seq_len].long()
            for page in torch.unique(locs // PAGE).tolist():
                for layer in range(self.L):
                    keys = self.index_ref.get((layer, page))
                    if keys is None:
                        continue  # a page only decode steps wrote
                    got = self.pool.index_k_with_scale_buffer[layer][page]
                    self.t.assertTrue(
                        torch.equal(got, keys),
                        f"{req.rid}: indexer keys of page {page} layer {layer} "
                        "were overwritten",
                    )

    def prefill(self, chunks, chunked_req=None, admit=True):
        """One extend batch: ``chunks`` = [(req, extend_len)]. ``chunked_req``
        is the scheduler's request still being prefilled after this batch.
        With ``admit`` the scheduler's hook right after the forward admits the
        other requests of the batch (``admit_prefilled_batch``)."""
        idx = torch.tensor([r.req_pool_idx for r, _ in chunks], device=DEVICE)
        pre = torch.tensor([r.seq_len for r, _ in chunks], dtype=torch.int64)
        seq = torch.tensor([r.seq_len + e for r, e in chunks], dtype=torch.int64)
        last = get_last_loc_torch(self.req_to_token, idx, pre.to(DEVICE))
        staging_before = self.staging_room()
        out = self.allocator.alloc_extend(
            pre.to(DEVICE), pre, seq.to(DEVICE), seq, last, int((seq - pre).sum())
        )
        self.t.assertIsNotNone(out)
        new_pages = sum(
            (p + e + PAGE - 1) // PAGE - (p + PAGE - 1) // PAGE
            for p, e in zip(pre.tolist(), (seq - pre).tolist())
        )
        self.t.assertEqual(self.staging_room(), staging_before - new_pages)
        start = 0
        for req, e in chunks:
            self.req_to_token[req.req_pool_idx, req.seq_len : req.seq_len + e] = out[
                start : start + e
            ].int()
            req.seq_len += e
            req.fill_ids = list(range(req.seq_len))
            req.kv_committed_len = req.seq_len
            start += e
        rows = self.pool.loc_to_row[out]
        staging_end = self.sizes.staging_start_row + self.sizes.staging_rows
        self.t.assertTrue(bool((rows >= self.sizes.staging_start_row).all()))
        self.t.assertTrue(bool((rows < staging_end).all()))
        fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=len(chunks))
        with self.forward_context((fb, out)):
            self.co.before_forward(fb)
            self.write_kv(out)
            self.check_prompt_rows(chunks)
        if admit:
            reqs = [r for r, _ in chunks]
            done = [r for r in reqs if r is not chunked_req]
            staging_before = self.staging_room()
            regions_before = self.controller.admission_room()
            self.co.admit_prefilled_batch(SimpleNamespace(reqs=reqs), chunked_req)
            self.check_admitted(done, staging_before, regions_before)
            if chunked_req is not None:
                self.t.assertFalse(self.co.is_admitted(chunked_req))
        return out

    def check_prompt_rows(self, chunks):
        # Prefill attention reads every prompt token through loc -> row.
        for req, _ in chunks:
            locs = self.req_to_token[req.req_pool_idx, : req.seq_len]
            rows = nsa_offload_hooks.translate_locs_to_rows(self.co, locs)
            for layer in range(self.L):
                self.t.assertTrue(
                    torch.equal(
                        self.rows_bytes(layer, rows.long()),
                        self.ref[layer, locs.long()],
                    )
                )

    def check_admitted(self, reqs, staging_before, regions_before, prompt_lens=None):
        """``reqs`` were just admitted with prompts of ``prompt_lens`` tokens."""
        if prompt_lens is None:
            prompt_lens = [r.seq_len for r in reqs]
        self.t.assertEqual(self.controller.admission_room(), regions_before - len(reqs))
        staged_pages = sum((n + PAGE - 1) // PAGE for n in prompt_lens)
        self.t.assertEqual(
            self.staging_room(),
            staging_before + (0 if self.options.kv_arrives_in_host else staged_pages),
        )
        for req, n in zip(reqs, prompt_lens):
            r = req.req_pool_idx
            self.t.assertTrue(self.co.is_admitted(req))
            base = int(self.co.lru.region_base[r])
            self.t.assertEqual(base, self.controller.region_base(r))
            region = base - self.sizes.region_start_row
            self.t.assertEqual(region % (self.C + self.W), 0)
            locs = self.req_to_token[r, :n].long()
            self.t.assertTrue(
                bool((self.allocator.page_to_staging_row[locs // PAGE] == -1).all())
            )
            self.check_host(locs)
            if r in self.co._deferred_warm:
                # Warm units: the window rows load after the next rebalance,
                # in prepare_decode (the decode steps' reads check them).
                continue
            # The first decode step's window rows hold the newest prompt tokens.
            pos = torch.arange(max(0, n + 1 - self.W), n, device=DEVICE)
            rows = base + self.C + pos % self.W
            for layer in range(self.L):
                self.t.assertTrue(
                    torch.equal(
                        self.rows_bytes(layer, rows), self.ref[layer, locs[pos]]
                    )
                )

    def pick_topk(self, n, first_step=False):
        """Unique positions of one request (``-1`` padded, shuffled)."""
        K, W = self.K, self.W
        if first_step:
            # Window + the warmed tokens just below it: no miss expected.
            lo = max(0, n - W - (K - W))
            cand = torch.arange(lo, n)
        else:
            must = [n - 1, n - W]  # window edges
            if n - W - 1 >= 0:
                must.append(n - W - 1)  # just left the window
            hot = torch.arange(0, n, 7)[:24]  # re-used often: LRU hits
            rand = torch.randperm(n, generator=self.gen)[:K]
            cand = torch.cat([torch.tensor(must), hot, rand])
            cand = cand[(cand >= 0) & (cand < n)]
            # Unique, first occurrence order.
            keep, seen = [], set()
            for p in cand.tolist():
                if p not in seen:
                    seen.add(p)
                    keep.append(p)
            cand = torch.tensor(keep[: K - 5])  # leave room for padding
        out = torch.full((K,), -1, dtype=torch.int64)
        out[: cand.numel()] = cand
        return out[torch.randperm(K, generator=self.gen)]

    def decode_step(self, reqs, pad_rows=0, first_step_of=(), shared_topk=False):
        """One decode step; ``shared_topk``: every layer picks the same top-k."""
        bs = len(reqs)
        idx = torch.tensor([r.req_pool_idx for r in reqs], device=DEVICE)
        seq_cpu = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        # ScheduleBatch.prepare_for_decode: alloc, req_to_token, seq_lens + 1.
        last = self.req_to_token[idx, seq_cpu.to(DEVICE) - 1].long()
        out = self.allocator.alloc_decode((seq_cpu + 1).to(DEVICE), seq_cpu + 1, last)
        self.t.assertIsNotNone(out)
        self.req_to_token[idx, seq_cpu.to(DEVICE)] = out.int()
        for r in reqs:
            r.seq_len += 1
            r.kv_committed_len += 1
        seq_cpu = seq_cpu + 1
        batch = SimpleNamespace(
            reqs=reqs,
            seq_lens=seq_cpu.to(DEVICE),
            seq_lens_cpu=seq_cpu,
            req_pool_indices=idx,
            out_cache_loc=out,
        )
        not_admitted = [r for r in reqs if not self.co.is_admitted(r)]
        staging_before = self.staging_room()
        regions_before = self.controller.admission_room()
        self.co.prepare_decode(batch)
        # Requests the prefill hook missed are admitted here, with a prompt of
        # seq_len - 1 tokens.
        self.check_admitted(
            not_admitted,
            staging_before,
            regions_before,
            [r.seq_len - 1 for r in not_admitted],
        )
        base = self.co.lru.region_base[idx].long()
        self.t.assertTrue(
            torch.equal(
                self.pool.loc_to_row[out],
                base + self.C + (seq_cpu.to(DEVICE) - 1) % self.W,
            )
        )

        # ForwardBatch, padded like a CUDA-graph replay: stale pool index 0,
        # seq_len 1, out_cache_loc 0, while batch_size counts the real rows.
        pad_idx = torch.zeros(pad_rows, dtype=idx.dtype, device=DEVICE)
        pad_seq = torch.ones(pad_rows, dtype=torch.int64, device=DEVICE)
        pad_loc = torch.zeros(pad_rows, dtype=out.dtype, device=DEVICE)
        fb = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            out_cache_loc=torch.cat([out, pad_loc]),
            req_pool_indices=torch.cat([idx, pad_idx]),
            seq_lens=torch.cat([batch.seq_lens, pad_seq]),
            attn_backend=SimpleNamespace(nsa_kv_offload=self.co),
        )
        with self.forward_context((fb, batch, idx)), forward_backend(fb.attn_backend):
            self.co.before_forward(fb)
            self.co.num_real_reqs.fill_(-1)  # left over from another batch
            with self.decode_graph_context():
                self.decode_layers(fb, reqs, out, pad_rows, first_step_of, shared_topk)
        # The last layer's hook wrote the new tokens of every layer back.
        self.check_host(out)
        self.check_index_keys(reqs)
        return out

    def decode_layers(self, fb, reqs, out, pad_rows, first_step_of, shared_topk):
        """The decode forward's layers: swap hooks, KV write, page table."""
        bs = len(reqs)
        topk = None
        for layer in range(self.L):
            if topk is None or not shared_topk:
                topk = torch.stack(
                    [self.pick_topk(r.seq_len, r in first_step_of) for r in reqs]
                    + [self.pick_topk(8) for _ in range(pad_rows)]
                ).to(DEVICE, torch.int32)
            # The model hands the indexer's top-k over (the early swap
            # starts), the layer writes its new KV (window row), then attends.
            nsa_offload_hooks.begin_layer_swap(fb, layer, topk)
            self.t.assertIn(layer, self.co._early_page_tables)
            self.write_kvlayer_arg(layer, out)
            page_table = nsa_offload_hooks.decode_page_table(self.co, fb, layer, topk)
            self.page_tables.append(page_table.clone())
            # The first layer counted the real rows (out_cache_loc != 0).
            self.t.assertEqual(int(self.co.num_real_reqs[0]), bs)
            self.check_page_table(layer, reqs, topk, page_table, pad_rows)
            # The coordinator's swap writes its plan into its static buffers.
            plan = LayerSwapPlan(*(t[: topk.shape[0]] for t in self.co._plan_buffers))
            for b, r in enumerate(reqs):
                if r in first_step_of:
                    self.t.assertEqual(int(plan.miss_count[b]), 0)

    def write_kvlayer_arg(self, layer, locs):
        n = locs.numel()
        nope = torch.randn((n, 1, KV_LORA_RANK), generator=self.gen)
        rope = torch.randn((n, 1, ROPE_DIM), generator=self.gen)
        self.pool.set_mla_kv_buffer(
            layer_arg(layer),
            locs,
            nope.to(DEVICE, torch.bfloat16),
            rope.to(DEVICE, torch.bfloat16),
        )
        self.ref[layer, locs] = self.rows_bytes(layer, self.pool.loc_to_row[locs])

    def check_page_table(self, layer, reqs, topk, page_table, pad_rows):
        bs = len(reqs)
        self.t.assertEqual(page_table.shape, (bs + pad_rows, self.K))
        self.t.assertEqual(page_table.dtype, torch.int32)
        self.t.assertTrue(bool((page_table[bs:] == -1).all()), "padding rows")
        for b, req in enumerate(reqs):
            r, n = req.req_pool_idx, req.seq_len
            pos = topk[b]
            valid = (pos >= 0) & (pos < n)
            rows = page_table[b]
            self.t.assertTrue(bool((rows[~valid] == -1).all()))
            rows, pos = rows[valid].long(), pos[valid]
            base = int(self.co.lru.region_base[r])
            # Rows of the request's region or of its extra units (LRU rows).
            in_units = (rows >= base) & (rows < base + self.C + self.W)
            for unit in self.co.lru.unit_base[r, 1:].tolist():
                if unit >= 0:
                    in_units |= (rows >= unit) & (rows < unit + self.C)
            self.t.assertTrue(bool(in_units.all()))
            uniq, counts = torch.unique(rows, return_counts=True)
            lru = self.co.lru
            self.t.assertEqual(
                uniq.numel(),
                rows.numel(),
                f"layer {layer} req {req.rid} (length {n}, "
                f"{self.controller.num_units(r)} "
                f"units at rows {lru.unit_base[r].tolist()}, direct "
                f"{int(lru.direct[r])}): positions "
                + "; ".join(
                    f"{pos[rows == d].tolist()} on row {d}"
                    for d in uniq[counts > 1].tolist()[:4]
                )
                + f" (window from {n - self.W})",
            )
            window = pos >= n - self.W
            self.t.assertTrue(
                torch.equal(rows[window], base + self.C + pos[window] % self.W)
            )
            locs = self.req_to_token[r, pos].long()
            got = self.rows_bytes(layer, rows)
            bad = (got != self.ref[layer, locs]).any(dim=1)
            self.t.assertFalse(
                bool(bad.any()),
                f"layer {layer} req {req.rid}: positions "
                f"{pos[bad].tolist()} read wrong KV",
            )

    def replace_and_drain(self, done, kept, prompt_len=250):
        """PD decode: ``done`` finishes, a new request of ``prompt_len``
        tokens arrives beside ``kept``, both decode, then everything ends
        without a leak."""
        self.finish(done)
        new = self.new_req()
        self.transfer(new, prompt_len)
        self.decode_step([kept, new], first_step_of=(new,))
        self.decode_step([kept, new])
        self.finish(kept)
        self.finish(new)
        self.check_no_leaks()

    def finish(self, req):
        """Finish, abort or retract: sglang's ``release_kv_cache`` (radix cache
        off) drops the offload state of ``req``, then frees its
        token locs (= host slots, staging pages) and its request slot."""
        r = req.req_pool_idx
        admitted = self.co.is_admitted(req)
        locs = self.req_to_token[r, : req.seq_len].long()
        for page in torch.unique(locs // PAGE).tolist():
            for layer in range(self.L):
                self.index_ref.pop((layer, page), None)
        regions_before = self.controller.admission_room()
        locs_before = self.allocator.available_size()
        with release_kv_cache_args():
            release_kv_cache(req, self.tree_cache, **RELEASE_ARGS)
        self.t.assertIsNone(req.req_pool_idx)
        self.t.assertFalse(self.co.controller.is_admitted(r))
        self.t.assertEqual(
            self.controller.admission_room(), regions_before + int(admitted)
        )
        self.t.assertEqual(int(self.co.lru.region_base[r]), -1)
        self.t.assertTrue(bool((self.co.lru.loc_to_slot[:, locs] == -1).all()))
        self.t.assertTrue(bool((self.co.lru.slot_loc[:, r] == -1).all()))
        pages = (req.seq_len + PAGE - 1) // PAGE
        self.t.assertEqual(self.allocator.available_size(), locs_before + pages * PAGE)
        self.t.assertTrue(
            bool((self.allocator.page_to_staging_row[locs // PAGE] == -1).all())
        )
        self.co.release(req)  # no-op once released

    def check_no_leaks(self):
        # The scheduler's idle check agrees (and so can never cry wolf on a
        # lifecycle the tests below run).
        self.t.assertEqual(self.co.check_idle(), "")
        self.t.assertEqual(self.snapshot(), self.initial)
        self.t.assertTrue(bool((self.allocator.page_to_staging_row == -1).all()))
        self.t.assertTrue(bool((self.co.lru.loc_to_slot == -1).all()))
        self.t.assertTrue(bool((self.co.lru.slot_loc == -1).all()))
        self.t.assertTrue(bool((self.co.lru.region_base == -1).all()))
        self.t.assertEqual(
            self.controller.regions.available_size(), self.sizes.total_regions
        )
