"""Speculative decoding with --enable-decode-nsa-kv-offload (docs/MTP.md).

The server still refuses --speculative-algorithm with the offload (the target
verify path is not wired yet). ``check_nsa_kv_offload_speculative`` holds the
refusals that stay once it is: only EAGLE / NEXTN MTP with one draft chain,
1-3 steps, draft tokens = steps + 1, and a buffer and window that fit the
verify step's query tokens.
"""

import os
import shutil
import tempfile
import unittest
from pathlib import Path

from sglang.srt.arg_groups.nsa_kv_offload_args import (
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

    def test_default_buffer_size(self):
        self.assertEqual(nsa_kv_offload_default_buffer_size(INDEX_TOPK, 1), 4096)
        self.assertEqual(nsa_kv_offload_default_buffer_size(INDEX_TOPK, 4), 10240)


class TestStillRefused(unittest.TestCase):
    """Valid MTP flags are refused today: the verify path is not wired."""

    def test_mtp_refused_at_startup(self):
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp)
        shutil.copy(TINY_DSV32_CONFIG, os.path.join(tmp, "config.json"))
        args = ServerArgs(model_path="dummy")
        for name, value in dict(
            model_path=tmp,
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
        ).items():
            setattr(args, name, value)
        with self.assertRaises(ValueError) as ctx:
            args._handle_decode_nsa_kv_offload()
        self.assertIn("--speculative-algorithm EAGLE", str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
