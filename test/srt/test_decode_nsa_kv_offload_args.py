"""Server arguments of --enable-decode-nsa-kv-offload: CLI, defaults, validation.

The checks run through the patched ServerArgs (its offload resolution step,
``resolution.handle_offload_args``) on the tiny DeepSeek-V3.2-shaped config shipped with the benchmarks. The
upstream names that differ between the supported sglang releases (the DSA/NSA
backend flags, the prefill-CP flag) come from nsa_kv_offload_compat.
"""

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from resolution import handle_offload_args, resolve_dsa_backends
from sglang.srt.arg_groups import nsa_kv_offload_hook
from sglang.srt.arg_groups.nsa_kv_offload_hook import (
    GB,
    NSAKVOffloadOptions,
    NSAKVOffloadRankLayout,
)
from sglang.srt.mem_cache import nsa_kv_offload_sizing as sizing
from sglang.srt.mem_cache.nsa_kv_offload_compat import (
    DECODE_BACKEND_FIELD,
    PREFILL_BACKEND_FIELD,
    PREFILL_CP_FIELD,
    RESOLUTION_PIPELINE,
    model_config_of,
    resolved_view,
)
from sglang.srt.server_args import ServerArgs

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_UNPROVEN_PARALLEL = "SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL"
TINY_DSV32_CONFIG = (
    REPO_ROOT / "benchmark" / "nsa_offload" / "server" / "tiny_dsv32_config.json"
)
DECODE, PREFILL = DECODE_BACKEND_FIELD, PREFILL_BACKEND_FIELD


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def backends(**by_phase) -> dict:
    """``decode=`` / ``prefill=`` backends as this sglang release's fields."""
    return {DECODE if k == "decode" else PREFILL: v for k, v in by_phase.items()}


def resolve_default_backends(args, kv_cache_dtype: str):
    """Run sglang's DSA backend defaults (on Hopper: SM90) and return the
    resolved (prefill, decode) backends."""
    resolve_dsa_backends(args, 90)
    view = resolved_view(args)
    return getattr(view, PREFILL), getattr(view, DECODE)


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

        # Pooled indexer keys (index_kpool > 1, what 0.5.23 reads).
        cls.kpool_dir = os.path.join(cls.tmp_dir, "tiny_kpool")
        os.makedirs(cls.kpool_dir)
        with open(TINY_DSV32_CONFIG) as f:
            config = json.load(f)
        with open(os.path.join(cls.kpool_dir, "config.json"), "w") as f:
            json.dump({**config, "index_kpool": 4}, f)

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
            **backends(decode="flashmla_kv", prefill="flashmla_sparse"),
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
            handle_offload_args(args)
        self.assertIn("--enable-decode-nsa-kv-offload", str(ctx.exception))
        self.assertIn(message, str(ctx.exception))

    def test_full_resolution_on_a_hopper_gpu(self):
        # The whole ServerArgs resolution (its GPU queries answered as on an
        # H100): the offload's backends are the defaults, its sizes resolved.
        gpu = dict(
            is_available=True, get_device_capability=(9, 0), get_device_name="H100"
        )
        with contextlib.ExitStack() as stack:
            for name, value in gpu.items():
                stack.enter_context(
                    mock.patch(f"torch.cuda.{name}", return_value=value)
                )
            # 0.5.23: asked by the pipeline's memory and KV-sharding steps.
            for module in (
                ("arg_groups.memory_hook", "arg_groups.kv_shard_hook")
                if RESOLUTION_PIPELINE
                else ("server_args",)
            ):
                stack.enter_context(
                    mock.patch(
                        f"sglang.srt.{module}.get_device_memory_capacity",
                        return_value=80 * 1024,
                    )
                )
            for dtype, decode in (
                ("fp8_e4m3", "flashmla_kv"),
                ("auto", "flashmla_sparse"),
            ):
                with self.subTest(kv_cache_dtype=dtype):
                    args = ServerArgs(
                        model_path=self.dsv32_dir,
                        skip_tokenizer_init=True,
                        device="cuda",
                        page_size=64,
                        kv_cache_dtype=dtype,
                        disable_radix_cache=True,
                        enable_decode_nsa_kv_offload=True,
                        nsa_kv_offload_host_pool_gb=0.5,
                    )
                    if RESOLUTION_PIPELINE:
                        args.resolve_once()
                    view = resolved_view(args)
                    self.assertEqual(
                        (getattr(view, PREFILL), getattr(view, DECODE)),
                        ("flashmla_sparse", decode),
                    )
                    self.assertEqual(view.nsa_kv_offload_gpu_buffer_size, 4096)
                    self.assertEqual(view.nsa_kv_offload_max_units, 40)

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
                "--nsa-kv-offload-verify",
            ]
        )
        self.assertTrue(parsed.enable_decode_nsa_kv_offload)
        self.assertEqual(parsed.nsa_kv_offload_gpu_buffer_size, 3072)
        self.assertEqual(parsed.nsa_kv_offload_recent_window, 128)
        self.assertEqual(parsed.nsa_kv_offload_host_pool_gb, 12.5)
        self.assertEqual(parsed.nsa_kv_offload_max_units, 2)
        self.assertEqual(parsed.nsa_kv_offload_verify, "fail")  # bare flag
        for mode in ("fail", "count"):
            with_mode = parser.parse_args(
                ["--model-path", "m", "--nsa-kv-offload-verify", mode]
            )
            self.assertEqual(with_mode.nsa_kv_offload_verify, mode)
        with self.assertRaises(SystemExit), mock.patch("sys.stderr"):
            parser.parse_args(["--model-path", "m", "--nsa-kv-offload-verify", "x"])

        defaults = parser.parse_args(["--model-path", self.dsv32_dir])
        self.assertFalse(defaults.enable_decode_nsa_kv_offload)
        self.assertIsNone(defaults.nsa_kv_offload_gpu_buffer_size)
        self.assertEqual(defaults.nsa_kv_offload_recent_window, 64)
        self.assertIsNone(defaults.nsa_kv_offload_host_pool_gb)
        self.assertIsNone(defaults.nsa_kv_offload_max_units)
        self.assertIsNone(defaults.nsa_kv_offload_verify)

    def test_defaults_resolved(self):
        args = self._server_args(nsa_kv_offload_host_pool_gb=None)
        handle_offload_args(args)
        # 2 x index_topk of the tiny config (2048).
        self.assertEqual(args.nsa_kv_offload_gpu_buffer_size, 4096)
        self.assertEqual(args.nsa_kv_offload_recent_window, 64)
        self.assertGreater(args.nsa_kv_offload_host_pool_gb, 0)
        # Units holding the model's whole context (163,840 positions) below
        # the window: 163,776 / 4,096 -> 40.
        self.assertEqual(model_config_of(args).context_len, 163840)
        self.assertEqual(args.nsa_kv_offload_max_units, 40)

    def test_disabled_is_untouched(self):
        args = self._server_args(
            enable_decode_nsa_kv_offload=False, page_size=1, enable_hisparse=True
        )
        handle_offload_args(args)
        self.assertIsNone(args.nsa_kv_offload_gpu_buffer_size)

    def test_explicit_sizes_kept(self):
        args = self._server_args(
            nsa_kv_offload_gpu_buffer_size=2048, nsa_kv_offload_recent_window=32
        )
        handle_offload_args(args)
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
            handle_offload_args(args)
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
        # units x buffer above 32767 takes int32 slot ids; the pool sizes the
        # wider ids (2 more bytes per slot id).
        self.assertEqual(sizing.lru_slot_id_bytes(4096, 7), 2)
        self.assertEqual(sizing.lru_slot_id_bytes(4096, 8), 4)
        # A region pays for its own unit's LRU state: wide ids cost 2 more
        # bytes per slot and layer of it, more units per request nothing.
        self.assertEqual(
            sizing.offload_bytes_per_region(61, 656, 4096, 64, 24)
            - sizing.offload_bytes_per_region(61, 656, 4096, 64, 7),
            61 * 4096 * 2,
        )

    def test_bf16_with_flashmla_sparse_accepted(self):
        args = self._server_args(
            kv_cache_dtype="bfloat16", **backends(decode="flashmla_sparse")
        )
        handle_offload_args(args)

    def test_reject_non_nsa_model(self):
        self._assert_rejected("only DSA/NSA models", model_path=self.dense_dir)

    def test_reject_pooled_indexer_keys(self):
        self._assert_rejected(
            "(index_kpool > 1) are not supported", model_path=self.kpool_dir
        )

    def test_reject_page_size(self):
        self._assert_rejected("requires --page-size 64", page_size=1)

    def test_reject_hisparse(self):
        self._assert_rejected(
            "cannot be combined with --enable-hisparse", enable_hisparse=True
        )

    def test_verify_mode(self):
        # The verify mode needs the offload; its options follow the flag.
        for mode in (None, "fail", "count"):
            args = self._server_args(nsa_kv_offload_verify=mode)
            handle_offload_args(args)
            options = NSAKVOffloadOptions.from_server_args(args)
            self.assertEqual(options.verify, mode)
        self._assert_rejected(
            "--nsa-kv-offload-verify 'loud': expected one of fail, count",
            nsa_kv_offload_verify="loud",
        )
        args = self._server_args(
            enable_decode_nsa_kv_offload=False, nsa_kv_offload_verify="fail"
        )
        with self.assertRaisesRegex(ValueError, "needs --enable-decode-nsa-kv-offload"):
            handle_offload_args(args)

    def test_options_from_resolved_args(self):
        # What the offload is built with: the resolved args, and the won
        # features by what they need (warm units: units, one query token, a
        # host pool of its own; direct slots: one query token).
        args = self._server_args()
        handle_offload_args(args)
        o = NSAKVOffloadOptions.from_server_args(args)
        self.assertEqual(
            (o.top_k, o.buffer_size, o.recent_window, o.max_units), (2048, 4096, 64, 40)
        )
        self.assertEqual((o.query_tokens, o.kv_arrives_in_host), (1, False))
        self.assertTrue(o.warm_units and o.direct_slots)
        self.assertEqual(o.region_rows, 4160)
        one = self._server_args(nsa_kv_offload_max_units=1)
        handle_offload_args(one)
        o = NSAKVOffloadOptions.from_server_args(one)
        self.assertFalse(o.warm_units)
        self.assertTrue(o.direct_slots)
        pd = self._server_args(disaggregation_mode="decode")
        handle_offload_args(pd)
        self.assertTrue(NSAKVOffloadOptions.from_server_args(pd).kv_arrives_in_host)
        with self._with_unproven_parallel(True):
            tp = self._server_args(tp_size=2)
            handle_offload_args(tp)
        o = NSAKVOffloadOptions.from_server_args(tp)
        self.assertTrue(o.shares_host_pool)
        self.assertFalse(o.warm_units)

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
                "tensor parallelism (--tp-size 8) has not run on GPUs yet (tested on "
                f"CPU only); {ENV_UNPROVEN_PARALLEL}=1 lets it start",
                tp_size=8,
            )

    def test_reject_dp_attention(self):
        with self._with_unproven_parallel(False):
            self._assert_rejected(
                "DP attention (--enable-dp-attention --dp-size 8) has not run on GPUs "
                f"yet (tested on CPU only); {ENV_UNPROVEN_PARALLEL}=1",
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
                with self.assertLogs(nsa_kv_offload_hook.logger, "WARNING") as logs:
                    handle_offload_args(args)
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
                f"{flag(PREFILL_CP_FIELD)}) is not supported",
                dict(tp_size=2, dp_size=1, attn_cp_size=2),
            ),
            (
                "attention context parallelism (--attn-cp-size 1, "
                f"{flag(PREFILL_CP_FIELD)}) is not supported",
                {PREFILL_CP_FIELD: True},
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
            handle_offload_args(self._server_args(**overrides))

    def test_plain_data_parallelism_accepted(self):
        # --dp-size without DP attention: replicas of a one-GPU server, each
        # with its own host pool.
        args = self._server_args(dp_size=2)
        handle_offload_args(args)
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
                # 0.5.23: the DP-attention width is attn_dp_size, dp_size replicas.
                dp_size=1 if dpa and RESOLUTION_PIPELINE else dp,
                attn_dp_size=dp if dpa else 1,
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
                    nsa_kv_offload_hook.psutil, "virtual_memory", return_value=ram
                ):
                    handle_offload_args(args)
                self.assertAlmostEqual(
                    args.nsa_kv_offload_host_pool_gb, round(expect_gb, 2), places=6
                )

    def test_reject_host_pool_larger_than_the_node_share(self):
        ram = SimpleNamespace(total=1024 * GB, available=900 * GB)
        with self._with_unproven_parallel(True), mock.patch.object(
            nsa_kv_offload_hook.psutil, "virtual_memory", return_value=ram
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
            handle_offload_args(args)

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

    def test_reject_what_bypasses_the_offloads_pools(self):
        # Pools and transfers the offload does not see (those of this release).
        cases = [
            (
                "--enable-hierarchical-cache is not supported",
                "enable_hierarchical_cache",
                True,
            ),
            ("--enable-pdmux is not supported", "enable_pdmux", True),
            ("--enable-unified-memory is not supported", "enable_unified_memory", True),
            (
                "--enable-kv-cache-sharding is not supported",
                "enable_kv_cache_sharding",
                True,
            ),
            ("decode context parallelism (--dcp-size 2)", "dcp_size", 2),
            (
                "--disaggregation-decode-retraction-backup host_pool",
                "disaggregation_decode_retraction_backup",
                "host_pool",
            ),
        ]
        fields = set(vars(ServerArgs(model_path="dummy")))
        fields |= set(getattr(ServerArgs, "__struct_fields__", ()))
        for message, field, value in cases:
            if field not in fields:
                continue
            with self.subTest(field=field):
                self._assert_rejected(message, **{field: value})

    def test_reject_two_batch_overlap(self):
        self._assert_rejected(
            "--enable-two-batch-overlap is not supported",
            enable_two_batch_overlap=True,
        )

    def test_accept_pd_decode_server(self):
        # KV arrives in the host pool through the PD transfer.
        args = self._server_args(disaggregation_mode="decode")
        handle_offload_args(args)
        self.assertEqual(args.nsa_kv_offload_gpu_buffer_size, 4096)

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
            f"requires {flag(DECODE)} flashmla_kv, but got "
            f"{flag(DECODE)} flashmla_sparse",
            **backends(decode="flashmla_sparse"),
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
                    f"requires {flag(PREFILL)} flashmla_sparse (the prefill "
                    "path that reads KV through the offload's staging rows), but "
                    f"got {flag(PREFILL)} {backend}",
                    **backends(prefill=backend),
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
                        f"requires {flag(DECODE)} {expect}, but got "
                        f"{flag(DECODE)} {backend}",
                        kv_cache_dtype=dtype,
                        **backends(decode=backend),
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
                    kv_cache_dtype=dtype, **backends(decode=None, prefill=None)
                )
                self.assertEqual(
                    resolve_default_backends(args, dtype), ("flashmla_sparse", decode)
                )
                handle_offload_args(args)
        args = self._server_args(**backends(prefill="flashmla_kv", decode=None))
        self.assertEqual(
            resolve_default_backends(args, "fp8_e4m3"), ("flashmla_kv", "flashmla_kv")
        )
        off = self._server_args(
            enable_decode_nsa_kv_offload=False, **backends(decode=None, prefill=None)
        )
        self.assertEqual(  # sglang's own
            resolve_default_backends(off, "fp8_e4m3"), ("flashmla_kv", "flashmla_kv")
        )


if __name__ == "__main__":
    unittest.main()
