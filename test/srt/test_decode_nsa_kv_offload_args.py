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
        self.assertEqual(args.nsa_kv_offload_max_units, 4)

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
        # 1 turns lending off; the default shrinks so that a request's LRU
        # slot ids still fit int16 (12288 x 2 <= 32767 < 12288 x 3).
        for overrides, expect in (
            (dict(nsa_kv_offload_max_units=1), 1),
            (dict(nsa_kv_offload_max_units=7), 7),
            (dict(nsa_kv_offload_gpu_buffer_size=12288), 2),
            (dict(nsa_kv_offload_gpu_buffer_size=32767), 1),
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
            "use at most 2",
            nsa_kv_offload_gpu_buffer_size=12288,
            nsa_kv_offload_max_units=3,
        )
        self._assert_rejected(
            "--nsa-kv-offload-gpu-buffer-size (40000) must be at most 32767",
            nsa_kv_offload_gpu_buffer_size=40000,
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

    def test_reject_speculative_decoding(self):
        self._assert_rejected(
            "speculative decoding (--speculative-algorithm EAGLE)",
            speculative_algorithm="EAGLE",
        )

    def test_reject_pipeline_parallelism(self):
        self._assert_rejected("pipeline parallelism (--pp-size 2)", pp_size=2)

    def test_reject_tensor_parallelism(self):
        self._assert_rejected("tensor parallelism (--tp-size 8)", tp_size=8)

    def test_reject_dp_attention(self):
        self._assert_rejected(
            "--enable-dp-attention is not supported", enable_dp_attention=True
        )

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
            "memory this rank can pin",
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
