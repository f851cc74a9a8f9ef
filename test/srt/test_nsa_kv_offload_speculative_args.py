"""Speculative decoding with --enable-decode-nsa-kv-offload (docs/MTP.md).

The MTP target verify path is wired but has not run on a GPU: the server
refuses --speculative-algorithm with the offload unless
SGLANG_NSA_KV_OFFLOAD_UNPROVEN_SPECULATIVE=1. With it,
``check_nsa_kv_offload_speculative`` holds the refusals that stay: only
EAGLE / NEXTN MTP with one draft chain, 1-3 steps, draft tokens = steps + 1,
spec v1 (no overlap scheduler), no cross-layer prefetch, and a buffer and
window that fit the verify step's query tokens.
"""

import os
import shutil
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from sglang.srt.arg_groups.nsa_kv_offload_args import (
    ENV_CROSS_LAYER_PREFETCH,
    ENV_UNPROVEN_SPECULATIVE,
    check_nsa_kv_offload_speculative,
    nsa_kv_offload_default_buffer_size,
)
from sglang.srt.server_args import ServerArgs

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_DSV32_CONFIG = (
    REPO_ROOT / "benchmark" / "nsa_offload" / "server" / "tiny_dsv32_config.json"
)
INDEX_TOPK = 2048


class TestSpeculativeChecks(unittest.TestCase):
    def _args(self, **overrides) -> ServerArgs:
        # What sglang's speculative step leaves for DeepSeek-V3.2 MTP (NEXTN
        # resolved to EAGLE, draft tokens = steps + 1), offload defaults.
        args = ServerArgs(model_path="dummy")
        fields = dict(
            enable_decode_nsa_kv_offload=True,
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
            nsa_kv_offload_gpu_buffer_size=5 * INDEX_TOPK,
            nsa_kv_offload_recent_window=64,
            disable_overlap_schedule=True,  # spec v1
        )
        fields.update(overrides)
        for name, value in fields.items():
            setattr(args, name, value)
        return args

    def _assert_refused(self, message: str, **overrides):
        with self.assertRaises(ValueError) as ctx:
            check_nsa_kv_offload_speculative(self._args(**overrides), INDEX_TOPK)
        self.assertIn("--enable-decode-nsa-kv-offload", str(ctx.exception))
        self.assertIn(message, str(ctx.exception))

    def test_mtp_accepted(self):
        for steps in (1, 2, 3):
            args = self._args(
                speculative_num_steps=steps, speculative_num_draft_tokens=steps + 1
            )
            self.assertEqual(
                check_nsa_kv_offload_speculative(args, INDEX_TOPK), steps + 1
            )
        args = self._args(speculative_algorithm="nextn")
        self.assertEqual(check_nsa_kv_offload_speculative(args, INDEX_TOPK), 4)

    def test_no_speculative_decoding(self):
        args = self._args(speculative_algorithm=None, nsa_kv_offload_recent_window=1)
        self.assertEqual(check_nsa_kv_offload_speculative(args, INDEX_TOPK), 1)

    def test_other_algorithms_refused(self):
        for algorithm in ("EAGLE3", "STANDALONE", "NGRAM", "DFLASH", "FROZEN_KV_MTP"):
            self._assert_refused(
                f"--speculative-algorithm {algorithm}",
                speculative_algorithm=algorithm,
            )

    def test_draft_tree_refused(self):
        self._assert_refused(
            "--speculative-eagle-topk 2",
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=8,
        )

    def test_steps_refused(self):
        self._assert_refused(
            "--speculative-num-steps 4",
            speculative_num_steps=4,
            speculative_num_draft_tokens=5,
        )
        self._assert_refused("--speculative-num-steps None", speculative_num_steps=None)

    def test_draft_tokens_refused(self):
        self._assert_refused(
            "--speculative-num-draft-tokens (3) must be --speculative-num-steps + 1",
            speculative_num_draft_tokens=3,
        )

    def test_buffer_and_window_refused(self):
        self._assert_refused(
            "--nsa-kv-offload-gpu-buffer-size (4096) must be at least "
            "--speculative-num-draft-tokens (4) x the model's index_topk (2048)",
            nsa_kv_offload_gpu_buffer_size=4096,
        )
        self._assert_refused(
            "--nsa-kv-offload-recent-window (6) must be at least 2 x "
            "--speculative-num-draft-tokens - 1 (7)",
            nsa_kv_offload_recent_window=6,
        )
        args = self._args(nsa_kv_offload_gpu_buffer_size=4 * INDEX_TOPK)
        args.nsa_kv_offload_recent_window = 7
        self.assertEqual(check_nsa_kv_offload_speculative(args, INDEX_TOPK), 4)

    def test_spec_v2_refused(self):
        self._assert_refused(
            "with the overlap scheduler (spec v2) is not supported; pass "
            "--disable-overlap-schedule",
            disable_overlap_schedule=False,
        )

    def test_cross_layer_prefetch_refused(self):
        with mock.patch.dict(os.environ, {ENV_CROSS_LAYER_PREFETCH: "1"}):
            self._assert_refused(
                f"{ENV_CROSS_LAYER_PREFETCH}=1 is not supported with "
                "--speculative-algorithm EAGLE"
            )
        with mock.patch.dict(os.environ, {ENV_CROSS_LAYER_PREFETCH: "0"}):
            self.assertEqual(
                check_nsa_kv_offload_speculative(self._args(), INDEX_TOPK), 4
            )

    def test_default_buffer_size(self):
        self.assertEqual(nsa_kv_offload_default_buffer_size(INDEX_TOPK, 1), 4096)
        self.assertEqual(nsa_kv_offload_default_buffer_size(INDEX_TOPK, 4), 10240)


class TestStartup(unittest.TestCase):
    """``ServerArgs._handle_decode_nsa_kv_offload`` (the patched server-args
    step) with MTP flags as sglang's speculative step leaves them."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)
        shutil.copy(TINY_DSV32_CONFIG, os.path.join(self.tmp, "config.json"))

    def _args(self, **overrides) -> ServerArgs:
        args = ServerArgs(model_path="dummy")
        fields = dict(
            model_path=self.tmp,
            skip_tokenizer_init=True,
            page_size=64,
            kv_cache_dtype="fp8_e4m3",
            nsa_prefill_backend="flashmla_sparse",
            nsa_decode_backend="flashmla_kv",
            disable_radix_cache=True,
            enable_decode_nsa_kv_offload=True,
            nsa_kv_offload_host_pool_gb=0.5,
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
            disable_overlap_schedule=True,
        )
        fields.update(overrides)
        for name, value in fields.items():
            setattr(args, name, value)
        return args

    def _env(self, unproven: bool):
        return mock.patch.dict(
            os.environ,
            {ENV_UNPROVEN_SPECULATIVE: "1" if unproven else "0"},
        )

    def _refused(self, args) -> str:
        with self.assertRaises(ValueError) as ctx:
            args._handle_decode_nsa_kv_offload()
        message = str(ctx.exception)
        self.assertIn("--enable-decode-nsa-kv-offload", message)
        return message

    def test_refused_by_default(self):
        env = {k: v for k, v in os.environ.items() if k != ENV_UNPROVEN_SPECULATIVE}
        for extra in ({}, {ENV_UNPROVEN_SPECULATIVE: "0"}):
            with mock.patch.dict(os.environ, {**env, **extra}, clear=True):
                message = self._refused(self._args())
            self.assertIn("--speculative-algorithm EAGLE", message)
            self.assertIn(f"{ENV_UNPROVEN_SPECULATIVE}=1 lets it start", message)

    def test_starts_with_env(self):
        with self._env(True), self.assertLogs(
            "sglang.srt.arg_groups.nsa_kv_offload_args", "WARNING"
        ) as logs:
            args = self._args()
            args._handle_decode_nsa_kv_offload()
        self.assertIn(ENV_UNPROVEN_SPECULATIVE, "".join(logs.output))
        # Default buffer: (q + 1) x index_topk; units fit the int16 slot ids.
        self.assertEqual(args.nsa_kv_offload_gpu_buffer_size, 5 * INDEX_TOPK)
        self.assertEqual(args.nsa_kv_offload_max_units, 32767 // (5 * INDEX_TOPK))
        for steps in (1, 2):
            with self._env(True):
                args = self._args(
                    speculative_num_steps=steps,
                    speculative_num_draft_tokens=steps + 1,
                )
                args._handle_decode_nsa_kv_offload()
            self.assertEqual(
                args.nsa_kv_offload_gpu_buffer_size, (steps + 2) * INDEX_TOPK
            )
        # Without speculative decoding the default stays 2 x index_topk.
        args = self._args(speculative_algorithm=None)
        args._handle_decode_nsa_kv_offload()
        self.assertEqual(args.nsa_kv_offload_gpu_buffer_size, 2 * INDEX_TOPK)

    def test_rules_apply_with_env(self):
        cases = [
            ("--speculative-algorithm EAGLE3", dict(speculative_algorithm="EAGLE3")),
            (
                "--speculative-eagle-topk 4",
                dict(speculative_eagle_topk=4, speculative_num_draft_tokens=8),
            ),
            (
                "--speculative-num-steps 5",
                dict(speculative_num_steps=5, speculative_num_draft_tokens=6),
            ),
            (
                "--speculative-num-draft-tokens (3) must be",
                dict(speculative_num_draft_tokens=3),
            ),
            ("--disable-overlap-schedule", dict(disable_overlap_schedule=False)),
            (
                "--nsa-kv-offload-gpu-buffer-size (6144) must be at least "
                "--speculative-num-draft-tokens (4)",
                dict(nsa_kv_offload_gpu_buffer_size=3 * INDEX_TOPK),
            ),
            (
                "--nsa-kv-offload-recent-window (5) must be at least 2 x "
                "--speculative-num-draft-tokens - 1 (7)",
                dict(nsa_kv_offload_recent_window=5),
            ),
        ]
        for flag, overrides in cases:
            with self.subTest(flag=flag), self._env(True):
                self.assertIn(flag, self._refused(self._args(**overrides)))
        with self._env(True), mock.patch.dict(
            os.environ, {ENV_CROSS_LAYER_PREFETCH: "1"}
        ):
            self.assertIn(ENV_CROSS_LAYER_PREFETCH, self._refused(self._args()))


if __name__ == "__main__":
    unittest.main()
