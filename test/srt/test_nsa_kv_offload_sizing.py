"""Pool sizing of the decode NSA KV offload, and the glue from server args to
the pools, allocator and coordinator ModelRunner builds (CPU, real sglang
classes)."""

import contextlib
import os
import shutil
import tempfile
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
from offload_harness import DEVICE, PAGE
from resolution import handle_offload_args
from sglang.srt.managers.nsa_kv_offload_coordinator import (
    create_nsa_kv_offload_coordinator,
)
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.nsa_kv_offload_compat import (
    CUDA_GRAPH_MAX_BS_FIELD,
    DECODE_BACKEND_FIELD,
    PREFILL_BACKEND_FIELD,
    RESOLUTION_PIPELINE,
    model_config_of,
)
from sglang.srt.mem_cache.nsa_kv_offload_lru_triton import TritonLRUSwap
from sglang.srt.mem_cache.nsa_kv_offload_pool import (
    NSAKVOffloadTokenToKVPool,
)
from sglang.srt.mem_cache.nsa_kv_offload_sizing import (
    NSAKVOffloadPoolConfigurator,
    compute_offload_pool_sizes,
    lru_unit_state_bytes,
    nsa_kv_offload_pool_kwargs,
    offload_bytes_per_loc,
    offload_bytes_per_region,
    spare_region_count,
    staging_lru_units,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
# The server-args fields the tests set by their NSA-era names (see _server_args).
ARG_NAMES = {
    "nsa_prefill_backend": PREFILL_BACKEND_FIELD,
    "nsa_decode_backend": DECODE_BACKEND_FIELD,
    "cuda_graph_max_bs": CUDA_GRAPH_MAX_BS_FIELD,
}
# The offload's server args (patch 0001) and their defaults.
OFFLOAD_ARG_DEFAULTS = dict(
    enable_decode_nsa_kv_offload=False,
    nsa_kv_offload_gpu_buffer_size=None,
    nsa_kv_offload_recent_window=64,
    nsa_kv_offload_host_pool_gb=None,
    nsa_kv_offload_max_units=None,
    nsa_kv_offload_verify=None,
)
TINY_DSV32_CONFIG = (
    REPO_ROOT / "benchmark" / "nsa_offload" / "server" / "tiny_dsv32_config.json"
)


class TestOffloadPoolSizing(unittest.TestCase):
    L, ROW, IDX, C, W = 3, 656, 132, 4096, 64

    def _sizes(self, available, regions=4, staging=10000, host=1 << 30, **kw):
        return compute_offload_pool_sizes(
            available_bytes=available,
            num_layers=self.L,
            row_bytes=self.ROW,
            indexer_bytes=self.IDX,
            page_size=PAGE,
            buffer_size=self.C,
            recent_window=self.W,
            num_regions=regions,
            staging_rows=staging,
            host_pool_bytes=host,
            **kw,
        )

    def _fixed(self, regions, staging_rows):
        return self.L * (PAGE + staging_rows) * self.ROW + regions * self.L * (
            (self.C + self.W) * self.ROW + self.C * 6
        )

    def test_per_unit_costs(self):
        # indexer keys + int16 loc_to_slot per layer, int64 loc_to_row.
        self.assertEqual(offload_bytes_per_loc(self.L, self.IDX), 3 * 134 + 8)
        # region rows + int32 slot_loc and int16 lru_order per LRU slot.
        self.assertEqual(
            offload_bytes_per_region(self.L, self.ROW, self.C, self.W),
            3 * (4160 * 656 + 4096 * 6),
        )
        # The LRU state is held per unit: a region pays for its own unit
        # whatever the units a request may hold.
        self.assertEqual(
            offload_bytes_per_region(self.L, self.ROW, self.C, self.W, max_units=3),
            3 * (4160 * 656 + 4096 * 6),
        )
        self.assertEqual(lru_unit_state_bytes(self.L, self.C, 3), 3 * 4096 * 6)
        # Staging rows lend whole runs of pages: 10048 rows of 64-row pages
        # hold two units of 4096 rows; nothing to lend with one unit.
        self.assertEqual(staging_lru_units(10048, PAGE, self.C, 4), 2)
        self.assertEqual(staging_lru_units(10048, PAGE, self.C, 1), 0)

    def test_gpu_bound_split(self):
        available = 2 << 30
        sizes = self._sizes(available, host=1 << 40)
        staging = 10048  # rounded up to a page
        per_loc = offload_bytes_per_loc(self.L, self.IDX)
        expect = (available - self._fixed(4, staging)) // per_loc // PAGE * PAGE
        self.assertEqual(sizes.num_locs, expect)
        self.assertEqual(sizes.num_locs % PAGE, 0)
        self.assertEqual(sizes.staging_rows, staging)
        self.assertEqual(sizes.region_rows, self.C + self.W)
        self.assertEqual(sizes.num_regions, 4)
        self.assertEqual(sizes.host_capacity_locs, (1 << 40) // (self.L * self.ROW))
        # Layout: [padding page][staging][regions], all inside the KV pool.
        self.assertEqual(sizes.staging_start_row, PAGE)
        self.assertEqual(sizes.region_start_row, PAGE + staging)
        self.assertEqual(sizes.kv_pool_size % PAGE, 0)
        self.assertGreaterEqual(
            PAGE + sizes.kv_pool_size,
            sizes.region_start_row + sizes.num_regions * sizes.region_rows,
        )
        self.assertLess(
            PAGE + sizes.kv_pool_size - PAGE,
            staging + 4 * (self.C + self.W) + PAGE,
        )
        # What the split reserves fits the budget.
        self.assertLessEqual(
            self._fixed(4, staging) + sizes.num_locs * per_loc, available
        )

    def test_host_and_user_caps(self):
        host = 100 * PAGE * self.L * self.ROW + 5
        sizes = self._sizes(4 << 30, host=host)
        self.assertEqual(sizes.host_capacity_locs, 100 * PAGE)
        self.assertEqual(sizes.num_locs, 100 * PAGE)
        capped = self._sizes(4 << 30, host=1 << 40, max_total_tokens=1000)
        self.assertEqual(capped.num_locs, 1000 // PAGE * PAGE)

    def test_spare_regions(self):
        # Host-bound: 100 pages of locs in a 4 GB budget. The bytes the locs
        # leave become spare regions (KV rows only), at most what the slots
        # can borrow: (units - 1) per slot.
        host = 100 * PAGE * self.L * self.ROW
        on = self._sizes(4 << 30, host=host, max_units=4)
        off = self._sizes(4 << 30, host=host)  # one unit: nothing to borrow
        self.assertEqual(off.num_spare_regions, 0)
        self.assertEqual(on.num_locs, off.num_locs)
        self.assertEqual(on.num_spare_regions, 4 * 3)
        self.assertEqual(on.total_regions, 16)
        self.assertEqual(on.kv_pool_size - off.kv_pool_size, 12 * (self.C + self.W))
        # Bytes for fewer than the slots could borrow: what fits. A spare
        # region is KV rows and its unit's LRU state.
        region = offload_bytes_per_region(self.L, self.ROW, self.C, self.W, 4)
        self.assertEqual(spare_region_count(5 * region + 1, region, 4, 4), 5)
        self.assertEqual(spare_region_count(5 * region - 1, region, 4, 4), 4)
        self.assertEqual(spare_region_count(-1, region, 4, 4), 0)
        # GPU-bound: the locs take the budget, nothing is left for spares.
        gpu_bound = self._sizes(64 << 20, host=1 << 40, max_units=4)
        self.assertEqual(gpu_bound.num_spare_regions, 0)
        # Everything fits the budget: the staging's two lendable units pay
        # for their LRU state too.
        per_loc = offload_bytes_per_loc(self.L, self.IDX)
        fixed = (
            self.L * (PAGE + on.staging_rows) * self.ROW
            + 4 * region
            + 2 * lru_unit_state_bytes(self.L, self.C, 4)
        )
        spent = fixed + on.num_locs * per_loc + on.num_spare_regions * region
        self.assertLessEqual(spent, 4 << 30)

    def test_requests_that_fit(self):
        # 8 regions and 40 pages of locs: short requests are region-bound,
        # long ones loc-bound (whole pages each).
        sizes = self._sizes(1 << 30, regions=8, host=40 * PAGE * self.L * self.ROW)
        self.assertEqual(sizes.num_locs, 40 * PAGE)
        self.assertEqual(sizes.requests_that_fit(PAGE), 8)
        self.assertEqual(sizes.requests_that_fit(5 * PAGE), 8)
        self.assertEqual(sizes.requests_that_fit(5 * PAGE + 1), 6)  # 6 pages each
        self.assertEqual(sizes.requests_that_fit(41 * PAGE), 0)
        self.assertEqual(
            sizes.describe_capacity(40000),
            "16K x 0, 32K x 0, 40000 x 0",
        )
        big = self._sizes(8 << 30, regions=8, host=1 << 40)
        text = big.describe_capacity(131072 + 512)
        self.assertEqual(text.count(" x "), 5)  # 16K, 32K, 64K, 128K, context
        self.assertTrue(text.startswith("16K x 8, "))

    def test_not_enough_memory(self):
        fixed = self._fixed(4, 10048)
        with self.assertRaises(RuntimeError) as ctx:
            self._sizes(fixed + PAGE * offload_bytes_per_loc(self.L, self.IDX) - 1)
        msg = str(ctx.exception)
        self.assertIn("NSA KV offload: not enough GPU memory", msg)
        self.assertIn("4 decode regions of 4160 rows", msg)
        self.assertIn("10048 staging rows", msg)
        self.assertIn("--max-running-requests", msg)
        self.assertIn("--nsa-kv-offload-gpu-buffer-size", msg)
        self.assertIn("--mem-fraction-static", msg)
        # One page of locs more is enough.
        sizes = self._sizes(fixed + PAGE * offload_bytes_per_loc(self.L, self.IDX))
        self.assertEqual(sizes.num_locs, PAGE)


class TinyConfigDirCase(unittest.TestCase):
    """A model dir holding the tiny DeepSeek-V3.2 config, and ServerArgs."""

    @classmethod
    def setUpClass(cls):
        from sglang.srt.server_args import ServerArgs

        cls.tmp_dir = tempfile.mkdtemp()
        shutil.copy(TINY_DSV32_CONFIG, os.path.join(cls.tmp_dir, "config.json"))
        cls.ServerArgs = ServerArgs

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp_dir, ignore_errors=True)


@contextlib.contextmanager
def config_bags(server_args):
    """The resolved config bags the configurators read: the record itself
    (its fields resolved), the exec bag's memory saver off."""
    from sglang import srt
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.model_executor import pool_configurator

    exec_bag = SimpleNamespace(
        features=SimpleNamespace(enable_memory_saver=False),
        kernel=server_args,
        graph=server_args,
    )
    bags = dict(
        get_memory=server_args,
        get_schedule=server_args,
        get_disagg=server_args,
        get_spec=server_args,
        get_exec=exec_bag,
    )
    with contextlib.ExitStack() as stack:
        if hasattr(kv_cache_configurator, "max_speculative_num_draft_tokens"):
            stack.enter_context(  # 0.5.23: the pool's MTP tail (no MTP here)
                mock.patch.object(
                    kv_cache_configurator,
                    "max_speculative_num_draft_tokens",
                    return_value=None,
                )
            )
        runtime_context = getattr(srt, "runtime_context", None)
        for module in (kv_cache_configurator, pool_configurator, runtime_context):
            for name, bag in bags.items():
                if hasattr(module, name):
                    stack.enter_context(
                        mock.patch.object(module, name, return_value=bag)
                    )
        yield


class TestServerArgsToPools(TinyConfigDirCase):
    """ServerArgs (tiny DeepSeek-V3.2 config) -> patched pool configurator ->
    ModelRunner's pool resolution -> pool kwargs, allocator, coordinator."""

    def _server_args(self, **overrides):
        # model_path="dummy" stops __post_init__ before the GPU-only steps; the
        # fields it would resolve for DSA on Hopper are set explicitly.
        args = self.ServerArgs(model_path="dummy")
        fields = dict(
            model_path=self.tmp_dir,
            skip_tokenizer_init=True,
            page_size=PAGE,
            kv_cache_dtype="fp8_e4m3",
            nsa_prefill_backend="flashmla_sparse",
            nsa_decode_backend="flashmla_kv",
            disable_radix_cache=True,
            enable_decode_nsa_kv_offload=True,
            nsa_kv_offload_host_pool_gb=0.01,
            context_length=2048,
            chunked_prefill_size=1024,
            max_prefill_tokens=1024,
            max_running_requests=2,
            # The default at a 2,048 context is one unit (it holds it whole).
            nsa_kv_offload_max_units=4,
        )
        fields.update(overrides)
        for name, value in fields.items():
            setattr(args, ARG_NAMES.get(name, name), value)
        # Independent of this machine's free RAM (the handler checks it).
        from sglang.srt.arg_groups import nsa_kv_offload_hook

        with mock.patch.object(
            nsa_kv_offload_hook, "pinnable_host_memory_gb", return_value=64.0
        ):
            handle_offload_args(args)
        # Until the test ends: the config bags sglang's configurators read.
        self.enterContext(config_bags(args))
        return args

    def _model_runner(self, server_args, available_bytes):
        """What the patched sglang builds the pools with and hands our
        configurator, a KVCacheConfigurator; one namespace is also the
        ModelRunner."""
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        model_config = model_config_of(server_args)
        layers = model_config.num_hidden_layers
        mr = SimpleNamespace(
            server_args=server_args,
            model_config=model_config,
            kv_cache_dtype=torch.float8_e4m3fn,
            kv_cache_dtype_str=server_args.kv_cache_dtype,
            is_draft_worker=False,
            is_hybrid_swa=False,
            use_mla_backend=True,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            page_size=server_args.page_size,
            device=DEVICE,
            mambaish_config=None,
            memory_pool_config=None,
        )
        mr._profile_available_bytes = lambda pre_model_load_memory: available_bytes
        from sglang.srt.mem_cache import kv_cache_configurator

        mr.layer_info = SimpleNamespace(
            num_effective_layers=layers, start_layer=0, end_layer=layers
        )
        mr.ps = SimpleNamespace(attn_dp_size=1, pp_size=1)
        mr.attn_dp_size, mr.pp_size = 1, 1  # 0.5.23: fields of the configurator
        kvc = kv_cache_configurator.KVCacheConfigurator
        for name in (
            "_apply_token_constraints",
            "resolve_max_num_reqs",
            "config_from_budget",
        ):
            setattr(mr, name, getattr(kvc, name).__get__(mr))

        def resolve(pre_model_load_memory):
            # The config bags hold the resolved server args.
            with config_bags(server_args):
                return kvc._resolve_memory_pool_config(mr, pre_model_load_memory)

        mr._resolve_memory_pool_config = resolve
        return mr

    def test_cuda_graph_coverage_warning(self):
        from sglang.srt.managers.nsa_kv_offload_coordinator import (
            cuda_graph_coverage_warning,
        )

        args = self._server_args(cuda_graph_max_bs=256, disable_cuda_graph=False)
        self.assertIsNone(cuda_graph_coverage_warning(args, 256))
        warning = cuda_graph_coverage_warning(args, 270)
        self.assertIn("270 decode regions", warning)
        flag = "--" + CUDA_GRAPH_MAX_BS_FIELD.replace("_", "-")
        self.assertIn(f"{flag} 270", warning)
        args.disable_cuda_graph = True  # eager anyway: nothing to say
        self.assertIsNone(cuda_graph_coverage_warning(args, 270))

    def test_configurator_fields(self):
        from sglang.srt.model_executor.pool_configurator import (
            create_memory_pool_configurator,
        )

        args = self._server_args()
        mr = self._model_runner(args, 1 << 30)
        configurator = create_memory_pool_configurator(mr)
        self.assertIsInstance(configurator, NSAKVOffloadPoolConfigurator)
        self.assertEqual(configurator.num_layers, 3)
        self.assertEqual(configurator.row_bytes, 656)  # fp8 FlashMLA layout
        self.assertEqual(configurator.indexer_bytes, 128 + 4)
        self.assertEqual(configurator.options.buffer_size, 2 * 2048)  # 2 x top-k
        self.assertEqual(configurator.options.recent_window, 64)
        self.assertEqual(configurator.host_pool_bytes, int(0.01 * (1 << 30)))
        # One max prompt, two prefill batches, a page per request of a batch.
        self.assertEqual(
            configurator.staging_rows(2, PAGE), 2048 + 2 * 1024 + 64 * PAGE
        )
        self.assertEqual(
            configurator.staging_rows(300, PAGE), 2048 + 2 * 1024 + 300 * PAGE
        )

        # Without the flag (or on a draft worker) upstream's configurator is
        # picked; the factory is only asked which class it would build.
        with mock.patch(
            "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"
        ) as default:
            mr.is_draft_worker = True
            self.assertIs(create_memory_pool_configurator(mr), default.return_value)
            mr.is_draft_worker = False
            args.enable_decode_nsa_kv_offload = False
            self.assertIs(create_memory_pool_configurator(mr), default.return_value)

        bf16 = self._model_runner(
            self._server_args(
                kv_cache_dtype="bfloat16", nsa_decode_backend="flashmla_sparse"
            ),
            1 << 30,
        )
        bf16.kv_cache_dtype = torch.bfloat16
        self.assertEqual(NSAKVOffloadPoolConfigurator(bf16).row_bytes, 1152)

    def test_pools_take_what_sglangs_pool_takes(self):
        # sglang's own pool counts tokens by the real (656 B fp8) row: with the
        # offload on, the same --mem-fraction-static gives the pools that
        # footprint (the budget as given, whole cells).
        from sglang.srt.model_executor import pool_configurator

        if hasattr(pool_configurator, "get_attention_tp_size"):
            tp_size = mock.patch.object(
                pool_configurator, "get_attention_tp_size", return_value=1
            )
        else:
            tp_size = mock.patch.object(
                pool_configurator,
                "get_parallel",
                return_value=SimpleNamespace(attn_tp_size=1, attn_dcp_size=1),
            )

        available = 1 << 30
        for dtype, backend in (
            ("fp8_e4m3", "flashmla_kv"),
            ("bfloat16", "flashmla_sparse"),
        ):
            with self.subTest(dtype=dtype):
                args = self._server_args(
                    kv_cache_dtype=dtype, nsa_decode_backend=backend
                )
                mr = self._model_runner(args, available)
                mr.kv_cache_dtype = (
                    torch.float8_e4m3fn if dtype == "fp8_e4m3" else torch.bfloat16
                )
                with tp_size:
                    upstream = pool_configurator.DefaultPoolConfigurator(mr)
                ours = NSAKVOffloadPoolConfigurator(mr)
                tokens = available // upstream._cell_size
                real_cell = 3 * (ours.row_bytes + ours.indexer_bytes)
                self.assertEqual(ours.budget_bytes(available), tokens * real_cell)
                self.assertEqual(ours.row_bytes, 1152 if dtype == "bfloat16" else 656)
                self.assertLessEqual(available - tokens * real_cell, real_cell)
                # The pools are sized from that footprint.
                with mock.patch.object(
                    NSAKVOffloadPoolConfigurator,
                    "compute_sizes",
                    wraps=ours.compute_sizes,
                ) as sized:
                    ours.calculate_pool_sizes(available, PAGE)
                self.assertEqual(sized.call_args.args[0], ours.budget_bytes(available))

    def test_pd_decode_has_no_staging(self):
        # The prefill server writes KV into the host pool: no staging rows, so
        # the same budget holds more token locs than a colocated server's.
        # One unit a request: no staging or idle-loc units (their LRU state
        # would pay from the locs' share too).
        sizes = {}
        for mode in ("null", "decode"):
            args = self._server_args(
                disaggregation_mode=mode, nsa_kv_offload_max_units=1
            )
            configurator = NSAKVOffloadPoolConfigurator(self._model_runner(args, 0))
            configurator.host_pool_bytes = 1 << 40  # GPU-bound split
            sizes[mode] = configurator.compute_sizes(64 << 20, PAGE)
        colocated, decode = sizes["null"], sizes["decode"]
        self.assertGreater(colocated.staging_rows, 0)
        self.assertEqual(decode.staging_rows, 0)
        self.assertEqual(decode.region_start_row, PAGE)
        self.assertEqual(decode.idle_loc_units + colocated.idle_loc_units, 0)
        freed = 3 * colocated.staging_rows * 656 // offload_bytes_per_loc(3, 132)
        self.assertAlmostEqual(decode.num_locs - colocated.num_locs, freed, delta=PAGE)

    def test_swap_scratch_comes_out_of_the_budget(self):
        # The LRU swap's per-batch-row scratch grows with the slots a request
        # may hold: the sizing pays for as many rows as the coordinator
        # allocates (the request slots or the CUDA-graph batches).
        locs = {}
        for max_bs in (0, 512):
            args = self._server_args(cuda_graph_max_bs=max_bs)
            configurator = NSAKVOffloadPoolConfigurator(self._model_runner(args, 0))
            configurator.host_pool_bytes = 1 << 40  # GPU-bound split
            sizes = configurator.compute_sizes(256 << 20, PAGE)
            self.assertEqual(sizes.num_regions, 2)
            locs[max_bs] = sizes.num_locs
        # 4 units of 4096 slots (int16 ids) per row, top-k 2048.
        per_row = 4 * 4096 * (1 + 2) + 2048 * 4 + 4 * 4 + 1
        self.assertEqual(
            TritonLRUSwap.scratch_bytes(510, 2048, 4096, 4, 2), 510 * per_row
        )
        self.assertEqual(configurator.swap_scratch_bytes(2), 512 * per_row)
        # 510 more rows: fewer locs by their bytes.
        per_loc = offload_bytes_per_loc(3, 132)
        self.assertAlmostEqual(
            locs[0] - locs[512], 510 * per_row // per_loc, delta=PAGE
        )

    def test_default_regions_from_budget(self):
        args = self._server_args(
            max_running_requests=None,
            nsa_kv_offload_max_units=None,
            context_length=163840,
        )
        configurator = NSAKVOffloadPoolConfigurator(self._model_runner(args, 1 << 30))
        # A region pays for its own unit's LRU state, whatever units a
        # request may hold (by default those of the model's context: int32
        # slot ids).
        self.assertEqual(args.nsa_kv_offload_max_units, 40)
        per_region = offload_bytes_per_region(3, 656, 4096, 64, max_units=40)
        sizes = configurator.compute_sizes(1 << 30, PAGE)
        self.assertEqual(sizes.num_regions, int(0.4 * (1 << 30)) // per_region)
        huge = configurator.compute_sizes(1 << 40, PAGE)
        self.assertEqual(huge.num_regions, 256)
        with self.assertRaises(RuntimeError):
            configurator.compute_sizes(1 << 20, PAGE)

    def _resolved_pools(self, **overrides):
        """Pools, allocator and coordinator as ModelRunner builds them
        (host-bound: 0.01 GB unless ``overrides`` of the server args say
        otherwise)."""
        args = self._server_args(**overrides)
        mr = self._model_runner(args, 256 << 20)
        config = mr._resolve_memory_pool_config(0)
        mr.memory_pool_config = config
        mr.max_total_num_tokens = config.max_total_num_tokens
        mr.max_running_requests = config.max_running_requests
        # What the patched model_runner_kv_cache_mixin builds: the layout from
        # the configurator that sized the pools (no second configurator).
        configurator = config.nsa_kv_offload_configurator
        self.assertIsInstance(configurator, NSAKVOffloadPoolConfigurator)
        with mock.patch.object(
            NSAKVOffloadPoolConfigurator, "__init__", side_effect=AssertionError
        ):
            kwargs = nsa_kv_offload_pool_kwargs(mr)
        sizes = kwargs["sizes"]
        self.assertEqual(
            kwargs, {"sizes": sizes, "verify": args.nsa_kv_offload_verify is not None}
        )
        mr.req_to_token_pool = ReqToTokenPool(
            size=mr.max_running_requests,
            max_context_len=mr.model_config.context_len + 4,
            device=DEVICE,
            enable_memory_saver=False,
        )
        self._build_pools(mr)
        self.assertEqual(mr.token_to_kv_pool.sizes, sizes)
        sizes = mr.token_to_kv_pool.sizes
        with self.assertLogs(
            "sglang.srt.managers.nsa_kv_offload_coordinator", "INFO"
        ) as logs:
            coordinator = create_nsa_kv_offload_coordinator(mr)
        return mr, sizes, coordinator, logs.output

    def _build_pools(self, mr):
        """The patched KVCacheConfigurator builds the pool (from the
        configurator in ``memory_pool_config``, no second one) and allocator."""
        from sglang.srt.mem_cache import kv_cache_configurator as module

        kvc, sa = module.KVCacheConfigurator, mr.server_args
        mr.pool_page_size = mr.page_size
        # 0.5.23: what _build_dsa_kv_pool reads beside the pool's sizes.
        mr.kv_shard_rank, mr.kv_shard_size, mr.loc_space_scale = None, 1, 1
        build_kw = dict(max_total_num_tokens=mr.max_total_num_tokens)
        if RESOLUTION_PIPELINE:
            build_kw.update(
                max_running_requests=mr.max_running_requests,
                dsa_pool_class=module.DSATokenToKVPool,
            )
        with config_bags(sa):
            with mock.patch.object(
                NSAKVOffloadPoolConfigurator, "__init__", side_effect=AssertionError
            ):
                mr.token_to_kv_pool = kvc._build_dsa_kv_pool(mr, **build_kw)
            self.assertIsInstance(mr.token_to_kv_pool, NSAKVOffloadTokenToKVPool)
            mr.token_to_kv_pool_allocator = kvc._build_token_to_kv_pool_allocator(
                mr,
                sizes=SimpleNamespace(max_total_num_tokens=mr.max_total_num_tokens),
                token_to_kv_pool=mr.token_to_kv_pool,
                is_dsv4_model=False,
                req_to_token_pool=mr.req_to_token_pool,
                token_to_kv_pool_allocator=None,
            )
        # A draft worker builds upstream's pool from the same config.
        mr.is_draft_worker = True
        with config_bags(sa):
            draft = kvc._build_dsa_kv_pool(mr, **build_kw)
        mr.is_draft_worker = False
        self.assertIs(type(draft), module.DSATokenToKVPool)

    def test_resolved_pools(self):
        mr, sizes, coordinator, logs = self._resolved_pools()
        self.assertEqual(mr.max_running_requests, 2)
        # Host-bound here: 0.01 GB of 3 x 656 B rows.
        host_locs = int(0.01 * (1 << 30)) // (3 * 656)
        self.assertEqual(mr.max_total_num_tokens, host_locs // PAGE * PAGE)
        self.assertEqual(sizes.num_locs, mr.max_total_num_tokens)
        self.assertEqual(sizes.num_regions, 2)
        self.assertEqual(sizes.num_spare_regions, 6)  # on by default
        self.assertEqual(sizes.region_rows, 4096 + 64)
        pool = mr.token_to_kv_pool
        self.assertIs(pool.sizes, sizes)
        self.assertEqual(pool.kv_buffer[0].shape, (sizes.kv_pool_size + PAGE, 1, 656))
        self.assertEqual(pool.num_locs, sizes.num_locs)
        self.assertEqual(pool.loc_to_row.numel(), sizes.num_locs + PAGE + 1)
        index_rows = pool.index_k_with_scale_buffer[0].shape[0] * PAGE
        self.assertGreaterEqual(index_rows, sizes.num_locs + PAGE)
        allocator = mr.token_to_kv_pool_allocator
        self.assertEqual(allocator.available_size(), sizes.num_locs)
        self.assertEqual(allocator.staging.start_row, PAGE)
        self.assertEqual(allocator.staging.num_pages * PAGE, sizes.staging_rows)

        held = sizes.describe_capacity(mr.model_config.context_len)
        self.assertTrue(any(held in line for line in logs), logs)
        # The early swap, warm units and direct slots, and the log says so.
        self.assertTrue(coordinator.options.warm_units)
        self.assertTrue(coordinator.lru.direct_slots)
        described = [x for x in logs if "Decode NSA KV offload: 4096 LRU rows" in x]
        self.assertEqual(len(described), 1, logs)
        for feature in ("early swap", "warm units", "direct slots", "6 spare regions"):
            self.assertIn(feature, described[0])
        # No link back from the pools: the allocator is given callables.
        for obj in (pool, allocator):
            self.assertFalse(hasattr(obj, "nsa_kv_offload"))
        self.assertEqual(allocator.reclaim_staging, coordinator.reclaim_staging)
        self.assertEqual(allocator.reclaim_idle_locs, None)  # no arena here
        self.assertIs(pool.host_pool, coordinator.host_pool)
        self.assertIs(coordinator.sizes, sizes)
        self.assertEqual(coordinator.options.top_k, 2048)
        self.assertEqual(coordinator.host_pool.size, sizes.num_locs)
        self.assertEqual(coordinator.host_pool.row_bytes, 656)
        controller = coordinator.controller
        self.assertEqual(controller.num_free_regions(), 8)
        self.assertEqual(controller.regions.start_row, sizes.region_start_row)
        self.assertLessEqual(controller.regions.end_row, pool.kv_buffer[0].shape[0])
        self.assertEqual(controller.lru.num_locs, sizes.num_locs + PAGE)

    def test_spare_regions(self):
        # The host pool caps the locs far below the 256 MB budget: the bytes
        # left become regions the 2 request slots borrow as units (up to 3
        # more each at 4 units), and nothing else changes ("0": none).
        plain = self._resolved_pools(nsa_kv_offload_max_units=1)  # nothing to lend
        self.assertEqual(plain[1].num_spare_regions, 0)
        mr, sizes, coordinator, logs = self._resolved_pools()
        self.assertEqual(mr.max_running_requests, 2)
        self.assertEqual(sizes.num_regions, 2)
        self.assertEqual(sizes.num_locs, plain[1].num_locs)
        self.assertEqual(sizes.num_spare_regions, 2 * 3)
        self.assertEqual(sizes.total_regions, 8)
        self.assertEqual(
            sizes.kv_pool_size - plain[1].kv_pool_size, 6 * sizes.region_rows
        )
        self.assertEqual(sizes.requests_that_fit(1024), 2)  # slots, not regions
        controller = coordinator.controller
        self.assertEqual(controller.num_free_regions(), 8)
        self.assertLessEqual(
            controller.regions.end_row, mr.token_to_kv_pool.kv_buffer[0].shape[0]
        )
        self.assertEqual(controller.idle_leaks(), [])

    def test_idle_loc_units(self):
        # GPU-bound (a 2 GB host pool): the locs' indexer keys hold many units
        # of 2,048 fp8 rows (160 pages each), no bytes are left for spare
        # regions, so the 2 request slots borrow their 6 units from the keys.
        # One unit a request: upstream's buffers, no lender.
        big = dict(nsa_kv_offload_host_pool_gb=2.0, nsa_kv_offload_gpu_buffer_size=2048)
        plain = self._resolved_pools(nsa_kv_offload_max_units=1, **big)
        self.assertEqual(plain[1].idle_loc_units, 0)
        self.assertFalse(plain[0].token_to_kv_pool.uses_arena)
        self.assertIsNone(plain[0].token_to_kv_pool_allocator.idle_loc_lender)
        mr, sizes, coordinator, logs = self._resolved_pools(**big)
        self.assertEqual(sizes.num_spare_regions, 0)
        self.assertEqual(sizes.idle_loc_units, 6)
        pool, allocator = mr.token_to_kv_pool, mr.token_to_kv_pool_allocator
        self.assertTrue(pool.uses_arena)
        self.assertEqual(allocator.reclaim_idle_locs, coordinator.reclaim_idle_locs)
        keys = pool.index_k_with_scale_buffer[0]
        self.assertEqual(keys.shape[1], PAGE * 132)
        self.assertGreaterEqual(keys.shape[0] * PAGE, sizes.num_locs + PAGE)
        self.assertEqual(
            keys.data_ptr(), pool.kv_buffer[0].data_ptr() + pool.index_offset
        )
        lender = allocator.idle_loc_lender
        self.assertEqual(lender.pages_per_unit, 160)
        # LRU state: the 2 regions, the staging's units and the 6.
        staging = staging_lru_units(sizes.staging_rows, PAGE, 2048, 4)
        self.assertEqual(coordinator.controller.lru.num_units, 2 + staging + 6)
        self.assertTrue(any("6 idle-loc units" in x for x in logs), logs)
        # Lent runs stay free to the scheduler.
        free = allocator.available_size()
        base = lender.take()
        self.assertIsNotNone(base)
        self.assertEqual(allocator.available_size(), free)
        self.assertEqual(allocator.free_page_count() * PAGE, free - 160 * PAGE)
        lender.give(base)
        self.assertEqual(allocator.free_page_count() * PAGE, free)


if __name__ == "__main__":
    unittest.main()
