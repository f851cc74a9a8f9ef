"""Server arguments of --enable-decode-nsa-kv-offload: CLI, defaults, validation.

The checks run through the patched ServerArgs (its _handle_decode_nsa_kv_offload
step) on the tiny DeepSeek-V3.2-shaped config shipped with the benchmarks.
"""

import argparse
import json
import os
import shutil
import tempfile
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from sglang.srt.arg_groups import nsa_kv_offload_args
from sglang.srt.arg_groups.nsa_kv_offload_args import (
    ENV_UNPROVEN_PARALLEL,
    GB,
    NSAKVOffloadRankLayout,
)
from sglang.srt.server_args import ServerArgs

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_DSV32_CONFIG = (
    REPO_ROOT / "benchmark" / "nsa_offload" / "server" / "tiny_dsv32_config.json"
)


class TestDecodeNSAKVOffloadArgs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp_dir = tempfile.mkdtemp()
        cls.dsv32_dir = os.path.join(cls.tmp_dir, "tiny_dsv32")
        os.makedirs(cls.dsv32_dir)
        shutil.copy(TINY_DSV32_CONFIG, os.path.join(cls.dsv32_dir, "config.json"))

        # A dense (non-DSA) model: same family without the indexer.
        cls.dense_dir = os.path.join(cls.tmp_dir, "tiny_dense")
        os.makedirs(cls.dense_dir)
        with open(TINY_DSV32_CONFIG) as f:
            config = json.load(f)
        config["architectures"] = ["DeepseekV3ForCausalLM"]
        config["model_type"] = "deepseek_v3"
        for key in ("index_topk", "index_head_dim", "index_n_heads"):
            config.pop(key)
        with open(os.path.join(cls.dense_dir, "config.json"), "w") as f:
            json.dump(config, f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp_dir)

    def _server_args(self, **overrides) -> ServerArgs:
        # model_path="dummy" stops __post_init__ before the GPU-only steps; the
        # fields it would have resolved for DSA on Hopper are set explicitly.
        args = ServerArgs(model_path="dummy")
        fields = dict(
            model_path=self.dsv32_dir,
            skip_tokenizer_init=True,
            page_size=64,
            kv_cache_dtype="fp8_e4m3",
            nsa_prefill_backend="flashmla_sparse",
            nsa_decode_backend="flashmla_kv",
            disable_radix_cache=True,
            enable_decode_nsa_kv_offload=True,
            nsa_kv_offload_host_pool_gb=0.5,
        )
        fields.update(overrides)
        for name, value in fields.items():
            setattr(args, name, value)
        return args

    def _assert_rejected(self, message: str, **overrides):
        args = self._server_args(**overrides)
        with self.assertRaises(ValueError) as ctx:
            args._handle_decode_nsa_kv_offload()
        self.assertIn("--enable-decode-nsa-kv-offload", str(ctx.exception))
        self.assertIn(message, str(ctx.exception))

    def test_cli_flags_parse(self):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        parsed = parser.parse_args(
            [
                "--model-path",
                self.dsv32_dir,
                "--enable-decode-nsa-kv-offload",
                "--nsa-kv-offload-gpu-buffer-size",
                "3072",
                "--nsa-kv-offload-recent-window",
                "128",
                "--nsa-kv-offload-host-pool-gb",
                "12.5",
                "--nsa-kv-offload-max-units",
                "2",
            ]
        )
        self.assertTrue(parsed.enable_decode_nsa_kv_offload)
        self.assertEqual(parsed.nsa_kv_offload_gpu_buffer_size, 3072)
        self.assertEqual(parsed.nsa_kv_offload_recent_window, 128)
        self.assertEqual(parsed.nsa_kv_offload_host_pool_gb, 12.5)
        self.assertEqual(parsed.nsa_kv_offload_max_units, 2)

        defaults = parser.parse_args(["--model-path", self.dsv32_dir])
        self.assertFalse(defaults.enable_decode_nsa_kv_offload)
        self.assertIsNone(defaults.nsa_kv_offload_gpu_buffer_size)
        self.assertEqual(defaults.nsa_kv_offload_recent_window, 64)
        self.assertIsNone(defaults.nsa_kv_offload_host_pool_gb)
        self.assertIsNone(defaults.nsa_kv_offload_max_units)

    def test_defaults_resolved(self):
        args = self._server_args(nsa_kv_offload_host_pool_gb=None)
        args._handle_decode_nsa_kv_offload()
        # 2 x index_topk of the tiny config (2048).
        self.assertEqual(args.nsa_kv_offload_gpu_buffer_size, 4096)
        self.assertEqual(args.nsa_kv_offload_recent_window, 64)
        self.assertGreater(args.nsa_kv_offload_host_pool_gb, 0)
        # Units holding the model's whole context (163,840 positions) below
        # the window: 163,776 / 4,096 -> 40.
        self.assertEqual(args.get_model_config().context_len, 163840)
        self.assertEqual(args.nsa_kv_offload_max_units, 40)

    def test_disabled_is_untouched(self):
        args = self._server_args(
            enable_decode_nsa_kv_offload=False, page_size=1, enable_hisparse=True
        )
        args._handle_decode_nsa_kv_offload()
        self.assertIsNone(args.nsa_kv_offload_gpu_buffer_size)

    def test_explicit_sizes_kept(self):
        args = self._server_args(
            nsa_kv_offload_gpu_buffer_size=2048, nsa_kv_offload_recent_window=32
        )
        args._handle_decode_nsa_kv_offload()
        self.assertEqual(args.nsa_kv_offload_gpu_buffer_size, 2048)
        self.assertEqual(args.nsa_kv_offload_recent_window, 32)
        self.assertEqual(args.nsa_kv_offload_host_pool_gb, 0.5)

    def test_max_units(self):
        # 1 turns lending off; the default holds the context below the
        # window: ceil((163,840 - W) / buffer), --context-length included.
        for overrides, expect in (
            (dict(nsa_kv_offload_max_units=1), 1),
            (dict(nsa_kv_offload_max_units=7), 7),
            (dict(nsa_kv_offload_gpu_buffer_size=12288), 14),
            (dict(nsa_kv_offload_gpu_buffer_size=32767), 5),
            (dict(context_length=32768), 8),
            (dict(context_length=32768, nsa_kv_offload_recent_window=512), 8),
            (dict(context_length=32768 + 65), 9),
            (dict(context_length=64), 1),
        ):
            args = self._server_args(**overrides)
            args._handle_decode_nsa_kv_offload()
            self.assertEqual(args.nsa_kv_offload_max_units, expect, overrides)

    def test_reject_max_units(self):
        self._assert_rejected(
            "--nsa-kv-offload-max-units (0) must be at least 1",
            nsa_kv_offload_max_units=0,
        )
        self._assert_rejected(
            "--nsa-kv-offload-gpu-buffer-size (40000) must be at most 32767",
            nsa_kv_offload_gpu_buffer_size=40000,
        )

    def test_wide_slot_ids_beyond_int16(self):
        # units x buffer above 32767 takes int32 slot ids, said in the log;
        # the pool sizes the wider ids (2 more bytes per slot id).
        args = self._server_args(nsa_kv_offload_max_units=24)
        with self.assertLogs(nsa_kv_offload_args.logger, "INFO") as logs:
            args._handle_decode_nsa_kv_offload()
        self.assertEqual(args.nsa_kv_offload_max_units, 24)
        self.assertIn("int32 LRU slot ids for 24 units", "".join(logs.output))
        args = self._server_args(nsa_kv_offload_max_units=7)
        with self.assertLogs(nsa_kv_offload_args.logger, "INFO") as logs:
            args._handle_decode_nsa_kv_offload()
        self.assertNotIn("int32 LRU slot ids", "".join(logs.output))
        from sglang.srt.mem_cache import nsa_kv_offload_pool as pool

        self.assertEqual(pool.lru_slot_id_bytes(4096, 7), 2)
        self.assertEqual(pool.lru_slot_id_bytes(4096, 8), 4)
        # A region pays for its own unit's LRU state: wide ids cost 2 more
        # bytes per slot and layer of it, more units per request nothing.
        self.assertEqual(
            pool.offload_bytes_per_region(61, 656, 4096, 64, 24)
            - pool.offload_bytes_per_region(61, 656, 4096, 64, 7),
            61 * 4096 * 2,
        )

    def test_bf16_with_flashmla_sparse_accepted(self):
        args = self._server_args(
            kv_cache_dtype="bfloat16", nsa_decode_backend="flashmla_sparse"
        )
        args._handle_decode_nsa_kv_offload()

    def test_reject_non_nsa_model(self):
        self._assert_rejected("only DSA/NSA models", model_path=self.dense_dir)

    def test_reject_page_size(self):
        self._assert_rejected("requires --page-size 64", page_size=1)

    def test_reject_hisparse(self):
        self._assert_rejected(
            "cannot be combined with --enable-hisparse", enable_hisparse=True
        )

    def test_early_swap_with_prefetch_starts(self):
        # The prefetch then runs on the early swap's stream (coordinator).
        both = {
            nsa_kv_offload_args.ENV_EARLY_SWAP: "1",
            nsa_kv_offload_args.ENV_CROSS_LAYER_PREFETCH: "1",
        }
        for env in (both, {nsa_kv_offload_args.ENV_EARLY_SWAP: "1"}):
            with self.subTest(env=env), mock.patch.dict(os.environ, env):
                self._server_args()._handle_decode_nsa_kv_offload()

    def test_early_swap_default(self):
        # On by default, with the prefetch too (MTP or not: the coordinator
        # asks without it); 0 / 1 choose.
        early, prefetch = (
            nsa_kv_offload_args.ENV_EARLY_SWAP,
            nsa_kv_offload_args.ENV_CROSS_LAYER_PREFETCH,
        )
        enabled = nsa_kv_offload_args.early_swap_enabled
        cases = [
            ({}, True),
            ({early: ""}, True),
            ({prefetch: "1"}, True),
            ({early: "0"}, False),
            ({early: "0", prefetch: "1"}, False),
            ({early: "1"}, True),
        ]
        for env, expected in cases:
            with self.subTest(env=env):
                clean = {
                    k: v for k, v in os.environ.items() if k not in (early, prefetch)
                }
                with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
                    self.assertEqual(enabled(), expected)

    def test_gather_programs_env(self):
        # The experimental flat miss copy: unset = the default grid; a
        # positive integer = that many programs; anything else fails at start.
        var = nsa_kv_offload_args.ENV_GATHER_PROGRAMS
        parse = nsa_kv_offload_args.gather_programs_from_env
        clean = {k: v for k, v in os.environ.items() if k != var}
        for value, expected in (("", None), ("16", 16), ("1", 1)):
            with self.subTest(value=value):
                with mock.patch.dict(os.environ, {**clean, var: value}, clear=True):
                    self.assertEqual(parse(), expected)
        with mock.patch.dict(os.environ, clean, clear=True):
            self.assertIsNone(parse())
        for value in ("0", "-4", "x", "2.5"):
            with self.subTest(value=value):
                with mock.patch.dict(os.environ, {**clean, var: value}, clear=True):
                    with self.assertRaisesRegex(ValueError, "expected an integer"):
                        parse()

    def test_direct_warm_positions_env(self):
        # The experimental bounded direct warm-up: unset = every position; 0
        # or more = at most that many; anything else fails at start.
        var = nsa_kv_offload_args.ENV_DIRECT_WARM_POSITIONS
        parse = nsa_kv_offload_args.direct_warm_positions_from_env
        clean = {k: v for k, v in os.environ.items() if k != var}
        for value, expected in (("", None), ("0", 0), ("4096", 4096)):
            with self.subTest(value=value):
                with mock.patch.dict(os.environ, {**clean, var: value}, clear=True):
                    self.assertEqual(parse(), expected)
        for value in ("-1", "x", "1e3"):
            with self.subTest(value=value):
                with mock.patch.dict(os.environ, {**clean, var: value}, clear=True):
                    with self.assertRaisesRegex(ValueError, "expected an integer >= 0"):
                        parse()

    def test_reject_unsupported_speculative_decoding(self):
        # MTP's supported settings start (test_nsa_kv_offload_speculative_args).
        self._assert_rejected(
            "--speculative-algorithm NGRAM is not supported; only EAGLE / NEXTN",
            speculative_algorithm="NGRAM",
        )
        self._assert_rejected(
            "--speculative-eagle-topk 4 is not supported; only 1",
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=4,
            speculative_num_draft_tokens=8,
            disable_overlap_schedule=True,
        )

    def test_reject_pipeline_parallelism(self):
        self._assert_rejected("pipeline parallelism (--pp-size 2)", pp_size=2)

    # Multi-GPU layouts (docs/MULTI_GPU.md). What is only unproven on GPUs is
    # refused unless SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL=1; what the design
    # cannot run is refused either way.

    def _with_unproven_parallel(self, on: bool):
        return mock.patch.dict(os.environ, {ENV_UNPROVEN_PARALLEL: "1" if on else "0"})

    def test_reject_tensor_parallelism(self):
        with self._with_unproven_parallel(False):
            self._assert_rejected(
                "tensor parallelism (--tp-size 8) has not run on GPUs yet: the host "
                "pool its attention-TP ranks share (rank 0 writes, every rank reads) "
                f"is simulated on CPU only ({ENV_UNPROVEN_PARALLEL}=1",
                tp_size=8,
            )

    def test_reject_dp_attention(self):
        with self._with_unproven_parallel(False):
            self._assert_rejected(
                "DP attention (--enable-dp-attention --dp-size 8) has not run on GPUs "
                "yet: its IDLE batches, the DP-attention padding of decode batches "
                "(eager and CUDA graphs) and admission per rank are tested on CPU only",
                tp_size=8,
                dp_size=8,
                enable_dp_attention=True,
            )

    def test_unproven_layouts_start_with_the_env(self):
        # For the GPU runs that prove them: attention TP and DP attention
        # (dp = tp) start, with a warning.
        for overrides in (
            dict(tp_size=2),
            dict(tp_size=8, dp_size=8, enable_dp_attention=True),
        ):
            with self.subTest(**overrides), self._with_unproven_parallel(True):
                args = self._server_args(**overrides)
                with self.assertLogs(nsa_kv_offload_args.logger, "WARNING") as logs:
                    args._handle_decode_nsa_kv_offload()
                self.assertIn(ENV_UNPROVEN_PARALLEL, "".join(logs.output))

    def test_reject_what_the_design_cannot_run(self):
        # Refused with or without the env: the message names the flags.
        cases = [
            (
                "--enable-dp-attention with --dp-size 2 smaller than --tp-size 8 "
                "(attention TP of 4 GPUs inside each DP group) is not supported; use "
                "--dp-size 8",
                dict(tp_size=8, dp_size=2, enable_dp_attention=True),
            ),
            (
                "tensor parallelism across nodes (--tp-size 16 over --nnodes 2) is not "
                "supported",
                dict(tp_size=16, nnodes=2),
            ),
            (
                "tensor parallelism (--tp-size 2) on a PD decode server is not "
                "supported",
                dict(tp_size=2, disaggregation_mode="decode"),
            ),
            (
                "attention context parallelism (--attn-cp-size 2, "
                "--enable-nsa-prefill-context-parallel) is not supported",
                dict(tp_size=2, dp_size=1, attn_cp_size=2),
            ),
            (
                "attention context parallelism (--attn-cp-size 1, "
                "--enable-nsa-prefill-context-parallel) is not supported",
                dict(enable_nsa_prefill_context_parallel=True),
            ),
        ]
        for message, overrides in cases:
            for env in (False, True):
                with self.subTest(env=env, **overrides):
                    with self._with_unproven_parallel(env):
                        self._assert_rejected(message, **overrides)

    def test_multi_node_dp_attention_is_only_unproven(self):
        # DP attention over 2 nodes: every rank its own pool, nothing shared
        # across nodes; refused only as not run on GPUs yet.
        overrides = dict(tp_size=16, dp_size=16, enable_dp_attention=True, nnodes=2)
        with self._with_unproven_parallel(False):
            self._assert_rejected("DP attention (--enable-dp-attention", **overrides)
        with self._with_unproven_parallel(True):
            self._server_args(**overrides)._handle_decode_nsa_kv_offload()

    def test_plain_data_parallelism_accepted(self):
        # --dp-size without DP attention: replicas of a one-GPU server, each
        # with its own host pool.
        args = self._server_args(dp_size=2)
        args._handle_decode_nsa_kv_offload()
        self.assertEqual(args.nsa_kv_offload_gpu_buffer_size, 4096)

    def test_rank_layout(self):
        # (tp, dp, dp attention, nnodes, pp) -> local ranks, attention TP,
        # ranks per host pool, host pools per node.
        cases = {
            (1, 1, False, 1, 1): (1, 1, 1, 1),
            (8, 1, False, 1, 1): (8, 8, 8, 1),  # attention TP: one shared pool
            (8, 8, True, 1, 1): (8, 1, 1, 8),  # DP attention: a pool per rank
            (16, 16, True, 2, 1): (8, 1, 1, 8),
            (8, 2, True, 1, 1): (8, 4, 4, 2),  # (refused: dp < tp)
            (1, 2, False, 1, 1): (2, 1, 1, 2),  # plain DP: a pool per replica
            (2, 2, False, 1, 1): (4, 2, 2, 2),
            (16, 1, False, 2, 1): (8, 16, 8, 1),  # (refused: TP across nodes)
            (4, 1, False, 1, 2): (8, 4, 4, 2),  # (refused: pp) one per stage
        }
        for (tp, dp, dpa, nnodes, pp), expect in cases.items():
            sa = SimpleNamespace(
                tp_size=tp,
                dp_size=dp,
                enable_dp_attention=dpa,
                nnodes=nnodes,
                pp_size=pp,
            )
            layout = NSAKVOffloadRankLayout.from_server_args(sa)
            got = (
                layout.local_ranks,
                layout.attn_tp_size,
                layout.ranks_per_pool,
                layout.host_pools_per_node,
            )
            with self.subTest(tp=tp, dp=dp, dp_attention=dpa, nnodes=nnodes, pp=pp):
                self.assertEqual(got, expect)
                self.assertEqual(
                    layout.attn_tp_spans_nodes, (tp, dp, nnodes) == (16, 1, 2)
                )

    def test_default_host_pool_per_node(self):
        # 1 TiB node, 900 GiB available: the reserve is max(8 GB, 10%) = 102.4
        # GB; the rest is split over the host pools this node pins.
        ram = SimpleNamespace(total=1024 * GB, available=900 * GB)
        usable = 900 - 102.4
        cases = [
            (dict(), usable),
            (dict(tp_size=8), usable),  # one pool the 8 ranks share
            (dict(tp_size=8, dp_size=8, enable_dp_attention=True), usable / 8),
            (dict(dp_size=2), usable / 2),
        ]
        for overrides, expect_gb in cases:
            with self.subTest(**overrides), self._with_unproven_parallel(True):
                args = self._server_args(nsa_kv_offload_host_pool_gb=None, **overrides)
                with mock.patch.object(
                    nsa_kv_offload_args.psutil, "virtual_memory", return_value=ram
                ):
                    args._handle_decode_nsa_kv_offload()
                self.assertAlmostEqual(
                    args.nsa_kv_offload_host_pool_gb, round(expect_gb, 2), places=6
                )

    def test_reject_host_pool_larger_than_the_node_share(self):
        ram = SimpleNamespace(total=1024 * GB, available=900 * GB)
        with self._with_unproven_parallel(True), mock.patch.object(
            nsa_kv_offload_args.psutil, "virtual_memory", return_value=ram
        ):
            # 8 DP-attention ranks: 99.7 GB each.
            self._assert_rejected(
                "--nsa-kv-offload-host-pool-gb (200.0) is larger than the host memory "
                "one host pool can pin (99.70 GB: available RAM minus a reserve, split "
                "over the 8 host pool(s) of this node)",
                tp_size=8,
                dp_size=8,
                enable_dp_attention=True,
                nsa_kv_offload_host_pool_gb=200.0,
            )
            # The same 200 GB for 8 attention-TP ranks: one pool, accepted.
            args = self._server_args(tp_size=8, nsa_kv_offload_host_pool_gb=200.0)
            args._handle_decode_nsa_kv_offload()

    def test_reject_radix_cache(self):
        self._assert_rejected(
            "requires --disable-radix-cache", disable_radix_cache=False
        )

    def test_reject_prefill_server(self):
        self._assert_rejected(
            "--disaggregation-mode prefill", disaggregation_mode="prefill"
        )

    def test_reject_mixed_chunk(self):
        self._assert_rejected(
            "--enable-mixed-chunk is not supported", enable_mixed_chunk=True
        )

    def test_reject_two_batch_overlap(self):
        self._assert_rejected(
            "--enable-two-batch-overlap is not supported",
            enable_two_batch_overlap=True,
        )

    def test_accept_pd_decode_server(self):
        # KV arrives in the host pool through the PD transfer.
        args = self._server_args(disaggregation_mode="decode")
        args._handle_decode_nsa_kv_offload()
        self.assertEqual(args.nsa_kv_offload_gpu_buffer_size, 4096)

    def test_default_on_settings(self):
        # Warm units, direct slots, spare regions and idle-loc units are on
        # unless their variable is "0"; warm units only where they apply, direct slots
        # only without MTP (there "1" is refused at startup).
        m = nsa_kv_offload_args
        names = (
            m.ENV_WARM_UNITS,
            m.ENV_DIRECT_SLOTS,
            m.ENV_SPARE_REGIONS,
            m.ENV_IDLE_LOC_UNITS,
        )
        clean = {k: v for k, v in os.environ.items() if k not in names}
        for value, on in (("", True), ("1", True), ("0", False), ("false", False)):
            env = {**clean, **{name: value for name in names}}
            with self.subTest(value=value), mock.patch.dict(os.environ, env, True):
                self.assertEqual(m.spare_regions_enabled(), on)
                self.assertEqual(m.idle_loc_units_enabled(), on)
                self.assertEqual(m.direct_slots_enabled(False), on)
                self.assertFalse(m.direct_slots_enabled(True))
                # CLOCK places every slot itself: direct slots stay off.
                with mock.patch.dict(os.environ, {m.ENV_SLOT_POLICY: "clock"}):
                    self.assertFalse(m.direct_slots_enabled(False))
                self.assertEqual(m.warm_units_enabled(40, False, False), on)
                for refused in (
                    (1, False, False),
                    (40, True, False),
                    (40, False, True),
                ):
                    self.assertFalse(m.warm_units_enabled(*refused), refused)
        # Where warm units cannot apply, the default starts without them.
        with mock.patch.dict(os.environ, clean, clear=True):
            self._server_args(
                nsa_kv_offload_max_units=1
            )._handle_decode_nsa_kv_offload()

    def test_warm_units_only_where_they_apply(self):
        # Warm units forced on ("1"): PD decode or colocated, with units, no
        # MTP, no host pool shared by attention-TP ranks.
        env = {nsa_kv_offload_args.ENV_WARM_UNITS: "1"}
        with mock.patch.dict(os.environ, env):
            for overrides in ({}, dict(disaggregation_mode="decode")):
                with self.subTest(**overrides):
                    self._server_args(**overrides)._handle_decode_nsa_kv_offload()
            self._assert_rejected(
                "SGLANG_NSA_KV_OFFLOAD_WARM_UNITS=1 needs "
                "--nsa-kv-offload-max-units above 1",
                nsa_kv_offload_max_units=1,
            )
            with self._with_unproven_parallel(True):
                # DP attention: a pool per rank; attention TP: one shared.
                self._server_args(
                    tp_size=8, dp_size=8, enable_dp_attention=True
                )._handle_decode_nsa_kv_offload()
                self._assert_rejected(
                    "SGLANG_NSA_KV_OFFLOAD_WARM_UNITS=1 does not combine with a "
                    "host pool shared by attention-TP ranks",
                    tp_size=2,
                )
        # Direct slots combine with them: a request that fits its units
        # enters direct mode when it is warmed.
        direct = dict(env, **{nsa_kv_offload_args.ENV_DIRECT_SLOTS: "1"})
        with mock.patch.dict(os.environ, direct):
            self._server_args(
                disaggregation_mode="decode"
            )._handle_decode_nsa_kv_offload()
        refusal = nsa_kv_offload_args.warm_units_refusal
        self.assertIsNone(refusal(4, False, False))
        self.assertIn("--speculative-algorithm", refusal(4, True, False))

    def test_slot_policy(self):
        # SGLANG_NSA_KV_OFFLOAD_POLICY: "lru" (default) or "clock"; clock
        # swaps one query token per request, without direct slots.
        var = nsa_kv_offload_args.ENV_SLOT_POLICY
        parse = nsa_kv_offload_args.slot_policy_from_env
        with mock.patch.dict(os.environ, {var: ""}):
            self.assertEqual(parse(), "lru")
        with mock.patch.dict(os.environ, {var: "clock"}):
            self.assertEqual(parse(), "clock")
            self._server_args()._handle_decode_nsa_kv_offload()
            self._assert_rejected(
                "SGLANG_NSA_KV_OFFLOAD_POLICY=clock is not supported with MTP",
                speculative_algorithm="EAGLE",
                speculative_num_steps=1,
                speculative_eagle_topk=1,
                speculative_num_draft_tokens=2,
                disable_overlap_schedule=True,
            )
            direct = {nsa_kv_offload_args.ENV_DIRECT_SLOTS: "1"}
            with mock.patch.dict(os.environ, direct):
                self._assert_rejected(
                    "SGLANG_NSA_KV_OFFLOAD_POLICY=clock does not combine with "
                    "SGLANG_NSA_KV_OFFLOAD_DIRECT_SLOTS=1"
                )
        with mock.patch.dict(os.environ, {var: "lfu"}):
            self._assert_rejected(
                "SGLANG_NSA_KV_OFFLOAD_POLICY='lfu': expected one of lru, clock"
            )

    def test_reject_pd_decode_radix_cache(self):
        self._assert_rejected(
            "--disaggregation-decode-enable-radix-cache is not supported",
            disaggregation_mode="decode",
            disaggregation_decode_enable_radix_cache=True,
        )

    def test_reject_pd_decode_kvcache_offload(self):
        self._assert_rejected(
            "--disaggregation-decode-enable-offload-kvcache is not supported",
            disaggregation_mode="decode",
            disaggregation_decode_enable_offload_kvcache=True,
        )

    def test_reject_kv_cache_dtype(self):
        self._assert_rejected("--kv-cache-dtype fp8_e5m2", kv_cache_dtype="fp8_e5m2")

    def test_reject_decode_backend(self):
        self._assert_rejected(
            "requires --nsa-decode-backend flashmla_kv, but got "
            "--nsa-decode-backend flashmla_sparse",
            nsa_decode_backend="flashmla_sparse",
        )

    def test_reject_buffer_smaller_than_topk(self):
        self._assert_rejected(
            "--nsa-kv-offload-gpu-buffer-size (1024) must be at least the "
            "model's index_topk (2048)",
            nsa_kv_offload_gpu_buffer_size=1024,
        )

    def test_reject_window_not_smaller_than_buffer(self):
        self._assert_rejected(
            "--nsa-kv-offload-recent-window (4096) must be smaller than "
            "--nsa-kv-offload-gpu-buffer-size (4096)",
            nsa_kv_offload_gpu_buffer_size=4096,
            nsa_kv_offload_recent_window=4096,
        )

    def test_reject_empty_window(self):
        self._assert_rejected(
            "--nsa-kv-offload-recent-window (0) must be at least 1",
            nsa_kv_offload_recent_window=0,
        )

    def test_reject_host_pool_larger_than_pinnable(self):
        self._assert_rejected(
            "--nsa-kv-offload-host-pool-gb (1000000.0) is larger than the host "
            "memory one host pool can pin",
            nsa_kv_offload_host_pool_gb=1e6,
        )

    def test_reject_non_positive_host_pool(self):
        self._assert_rejected(
            "--nsa-kv-offload-host-pool-gb (0.0) must be positive",
            nsa_kv_offload_host_pool_gb=0.0,
        )

    # NSA backends: only the pairs run on the GPU with the offload pass.

    def test_reject_unproven_prefill_backends(self):
        # trtllm prefill reads KV by token loc before the offload's loc -> row
        # translation; the others were never run with the offload on.
        for backend in ("flashmla_kv", "flashmla_auto", "trtllm", "fa3", "tilelang"):
            with self.subTest(backend=backend):
                self._assert_rejected(
                    "requires --nsa-prefill-backend flashmla_sparse (the prefill "
                    "path that reads KV through the offload's staging rows), but "
                    f"got --nsa-prefill-backend {backend}",
                    nsa_prefill_backend=backend,
                )

    def test_reject_unproven_decode_backends(self):
        for dtype, expect in (
            ("fp8_e4m3", "flashmla_kv"),
            ("bfloat16", "flashmla_sparse"),
        ):
            for backend in (
                "flashmla_kv",
                "flashmla_sparse",
                "trtllm",
                "fa3",
                "tilelang",
            ):
                if backend == expect:
                    continue
                with self.subTest(dtype=dtype, backend=backend):
                    self._assert_rejected(
                        f"requires --nsa-decode-backend {expect}, but got "
                        f"--nsa-decode-backend {backend}",
                        kv_cache_dtype=dtype,
                        nsa_decode_backend=backend,
                    )

    def test_backend_defaults_with_offload(self):
        # sglang's Hopper defaults would be flashmla_kv prefill (fp8) and fa3
        # decode (bf16); with the offload on, unset flags get its backends and
        # an explicit choice is kept (then validated).
        for dtype, decode in (
            ("fp8_e4m3", "flashmla_kv"),
            ("bfloat16", "flashmla_sparse"),
        ):
            with self.subTest(dtype=dtype):
                args = self._server_args(
                    kv_cache_dtype=dtype,
                    nsa_prefill_backend=None,
                    nsa_decode_backend=None,
                )
                args._set_default_nsa_backends(dtype, 9)
                self.assertEqual(args.nsa_prefill_backend, "flashmla_sparse")
                self.assertEqual(args.nsa_decode_backend, decode)
                args._handle_decode_nsa_kv_offload()
        args = self._server_args(
            nsa_prefill_backend="flashmla_kv", nsa_decode_backend=None
        )
        args._set_default_nsa_backends("fp8_e4m3", 9)
        self.assertEqual(args.nsa_prefill_backend, "flashmla_kv")
        self.assertEqual(args.nsa_decode_backend, "flashmla_kv")
        off = self._server_args(
            enable_decode_nsa_kv_offload=False,
            nsa_prefill_backend=None,
            nsa_decode_backend=None,
        )
        off._set_default_nsa_backends("fp8_e4m3", 9)
        self.assertEqual(off.nsa_prefill_backend, "flashmla_kv")  # sglang's own


if __name__ == "__main__":
    unittest.main()
