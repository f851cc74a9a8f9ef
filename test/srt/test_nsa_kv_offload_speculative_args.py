"""Speculative decoding with --enable-decode-nsa-kv-offload (docs/MTP.md).

MTP has run end to end on the H200 (benchmark/nsa_offload/results/mtp/), so
the supported settings start with no env var: EAGLE / NEXTN MTP with one draft
chain, 1-3 steps, draft tokens = steps + 1, sglang's spec v2 worker with the
overlap scheduler (the default) or without it (--disable-overlap-schedule).
``check_nsa_kv_offload_speculative`` refuses everything else, naming the
flag: other algorithms, draft trees, more steps, adaptive steps, multi-layer
EAGLE, the overlap scheduler on a PD decode server or with its plan stream, and a
buffer or window too small for the verify step's query tokens. Attention TP / DP attention keep their own gate, MTP or not.
"""

import os
import shutil
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from resolution import handle_offload_args
from sglang.srt.arg_groups.nsa_kv_offload_hook import (
    check_nsa_kv_offload_speculative,
)
from sglang.srt.mem_cache.nsa_kv_offload_compat import (
    DECODE_BACKEND_FIELD,
    PREFILL_BACKEND_FIELD,
)
from sglang.srt.server_args import ServerArgs

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_DSV32_CONFIG = (
    REPO_ROOT / "benchmark" / "nsa_offload" / "server" / "tiny_dsv32_config.json"
)
INDEX_TOPK = 2048
ENV_OVERLAP_PLAN_STREAM = "SGLANG_ENABLE_OVERLAP_PLAN_STREAM"
ENV_UNPROVEN_PARALLEL = "SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL"
# Gated MTP until it ran on the H200; must open nothing now.
REMOVED_SPECULATIVE_GATE = "SGLANG_NSA_KV_OFFLOAD_UNPROVEN_SPECULATIVE"


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
            disable_overlap_schedule=True,
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

    def test_spec_v2_accepted(self):
        # The overlap scheduler (spec v2, sglang's default with MTP), colocated,
        # no plan stream: accepted with no env var (run on the H200 with 1 and
        # 3 steps: results/mtp/spec_v2/).
        with mock.patch.dict(os.environ, {ENV_OVERLAP_PLAN_STREAM: "0"}):
            for steps in (1, 2, 3):
                args = self._args(
                    disable_overlap_schedule=False,
                    speculative_num_steps=steps,
                    speculative_num_draft_tokens=steps + 1,
                    nsa_kv_offload_gpu_buffer_size=(steps + 1) * INDEX_TOPK,
                    nsa_kv_offload_recent_window=2 * (steps + 1) - 1,
                )
                self.assertEqual(
                    check_nsa_kv_offload_speculative(args, INDEX_TOPK), steps + 1
                )

    def test_overlap_scheduler_refused_where_not_run(self):
        self._assert_refused(
            "with the overlap scheduler on a PD decode server (--disaggregation-mode "
            "decode) is not supported; pass --disable-overlap-schedule",
            disable_overlap_schedule=False,
            disaggregation_mode="decode",
        )
        with mock.patch.dict(os.environ, {ENV_OVERLAP_PLAN_STREAM: "1"}):
            self._assert_refused(
                f"{ENV_OVERLAP_PLAN_STREAM}=1 (the overlap scheduler's plan stream) "
                "is not supported",
                disable_overlap_schedule=False,
            )
            # Without the overlap scheduler it is never read.
            self.assertEqual(
                check_nsa_kv_offload_speculative(self._args(), INDEX_TOPK), 4
            )
        # Spec v1 on a PD decode server stays as it was.
        args = self._args(disaggregation_mode="decode")
        self.assertEqual(check_nsa_kv_offload_speculative(args, INDEX_TOPK), 4)

    def test_adaptive_and_multi_layer_refused(self):
        for overlap_off in (True, False):
            self._assert_refused(
                "--speculative-adaptive is not supported",
                speculative_adaptive=True,
                disable_overlap_schedule=overlap_off,
            )
            self._assert_refused(
                "--enable-multi-layer-eagle is not supported",
                enable_multi_layer_eagle=True,
                disable_overlap_schedule=overlap_off,
            )


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
            **{PREFILL_BACKEND_FIELD: "flashmla_sparse"},
            **{DECODE_BACKEND_FIELD: "flashmla_kv"},
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

    def _env(self, **extra):
        # No offload env var from the caller's shell, only the test's own.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("SGLANG_NSA_KV_OFFLOAD_")
        }
        return mock.patch.dict(os.environ, {**env, **extra}, clear=True)

    def _start(self, args) -> ServerArgs:
        with self.assertNoLogs("sglang.srt.arg_groups.nsa_kv_offload_hook", "WARNING"):
            handle_offload_args(args)
        return args

    def _refused(self, args) -> str:
        with self.assertRaises(ValueError) as ctx:
            handle_offload_args(args)
        message = str(ctx.exception)
        self.assertIn("--enable-decode-nsa-kv-offload", message)
        return message

    def test_supported_settings_start(self):
        for algorithm in ("EAGLE", "NEXTN"):
            for steps in (1, 2, 3):
                with self.subTest(algorithm=algorithm, steps=steps), self._env():
                    args = self._start(
                        self._args(
                            speculative_algorithm=algorithm,
                            speculative_num_steps=steps,
                            speculative_num_draft_tokens=steps + 1,
                        )
                    )
                    # Default buffer: (q + 1) x index_topk; units hold the
                    # model's context (163,840) below the window.
                    buffer_size = (steps + 2) * INDEX_TOPK
                    self.assertEqual(args.nsa_kv_offload_gpu_buffer_size, buffer_size)
                    self.assertEqual(
                        args.nsa_kv_offload_max_units,
                        -(-(163840 - 64) // buffer_size),
                    )
        # Spec v2 (the overlap scheduler, sglang's default with MTP).
        for steps in (1, 2, 3):
            with self.subTest(spec_v2=True, steps=steps), self._env():
                args = self._start(
                    self._args(
                        speculative_num_steps=steps,
                        speculative_num_draft_tokens=steps + 1,
                        disable_overlap_schedule=False,
                    )
                )
                self.assertFalse(args.disable_overlap_schedule)
        # The other KV dtype the offload runs with, as on the H200.
        with self._env():
            self._start(
                self._args(
                    kv_cache_dtype="bfloat16",
                    **{DECODE_BACKEND_FIELD: "flashmla_sparse"},
                )
            )
        # Verify's limits (the heavy server): buffer q x top-k, window 2q - 1, one unit.
        with self._env():
            args = self._start(
                self._args(
                    nsa_kv_offload_gpu_buffer_size=4 * INDEX_TOPK,
                    nsa_kv_offload_recent_window=7,
                    nsa_kv_offload_max_units=1,
                )
            )
        self.assertEqual(args.nsa_kv_offload_gpu_buffer_size, 4 * INDEX_TOPK)
        # Without speculative decoding the default stays 2 x index_topk.
        with self._env():
            args = self._start(self._args(speculative_algorithm=None))
        self.assertEqual(args.nsa_kv_offload_gpu_buffer_size, 2 * INDEX_TOPK)

    def test_unsupported_settings_refused(self):
        cases = [
            ("--speculative-algorithm EAGLE3", dict(speculative_algorithm="EAGLE3")),
            (
                "--speculative-algorithm STANDALONE",
                dict(speculative_algorithm="STANDALONE"),
            ),
            (
                "--speculative-eagle-topk 4",
                dict(speculative_eagle_topk=4, speculative_num_draft_tokens=8),
            ),
            (
                "--speculative-num-steps 4",
                dict(speculative_num_steps=4, speculative_num_draft_tokens=5),
            ),
            (
                "--speculative-num-draft-tokens (3) must be",
                dict(speculative_num_draft_tokens=3),
            ),
            (
                "overlap scheduler on a PD decode server (--disaggregation-mode decode)",
                dict(disable_overlap_schedule=False, disaggregation_mode="decode"),
            ),
            (
                "--speculative-adaptive is not supported",
                dict(speculative_adaptive=True, disable_overlap_schedule=False),
            ),
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
        # The removed gate's variable must not open any of them.
        for extra in ({}, {REMOVED_SPECULATIVE_GATE: "1"}):
            for flag, overrides in cases:
                with self.subTest(flag=flag, env=extra), self._env(**extra):
                    self.assertIn(flag, self._refused(self._args(**overrides)))

    def test_parallel_layouts_refused_with_mtp(self):
        # Multi-GPU has not run: TP and DP attention stay behind their own
        # variable without MTP, and with MTP are refused even with it set.
        layouts = [
            ("tensor parallelism (--tp-size 2)", dict(tp_size=2)),
            (
                "DP attention (--enable-dp-attention --dp-size 2)",
                dict(tp_size=2, dp_size=2, enable_dp_attention=True),
            ),
        ]
        for flag, overrides in layouts:
            with self.subTest(flag=flag), self._env():
                message = self._refused(self._args(**overrides))
                self.assertIn(flag, message)
                self.assertIn(f"{ENV_UNPROVEN_PARALLEL}=1 lets", message)
            with self.subTest(flag=flag, gate="open"), self._env(
                **{ENV_UNPROVEN_PARALLEL: "1"}
            ):
                self.assertIn(
                    "--speculative-algorithm EAGLE is not supported with "
                    "--tp-size > 1 or --enable-dp-attention",
                    self._refused(self._args(**overrides)),
                )


if __name__ == "__main__":
    unittest.main()
