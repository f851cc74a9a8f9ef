"""The exactness tooling of benchmark/nsa_offload (CPU): the checkpoint
generator and the negative control's accounting.

* ``make_checkpoint``: every tensor a DeepSeek-V3.2 checkpoint has, by layer
  kind (dense MLP before ``first_k_dense_replace``, MoE after, the NextN
  layer's own tensors), with the shapes the config gives; the written
  checkpoint holds exactly those, at the documented scales, and the same
  seed gives the same bytes whatever the order;
* ``exactness``: the boundary prompt lengths, when a control request
  counts as flipped (one corrupted step, or every step), and the MTP
  servers' flags and accept-count comparison;
* ``sorted_topk``: the top-k set picked on a total order (score, then the
  lower column) against a brute-force reference on scores full of ties,
  handed to the kernel as 0/1 logits, rows sorted with ``-1`` padding last,
  and only on the unfused (positional) path.
"""

import importlib.util
import json
import math
import os
import sys
import tempfile
import types
import unittest
from pathlib import Path
from unittest import mock

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR / "server"))

import exactness  # noqa: E402
import exactness_headline  # noqa: E402
import make_checkpoint as mc  # noqa: E402
import mtp_summary  # noqa: E402
import server_utils  # noqa: E402

# By path: another sitecustomize may already be imported.
_spec = importlib.util.spec_from_file_location(
    "sorted_topk_sitecustomize",
    BENCH_DIR / "server" / "sorted_topk" / "sitecustomize.py",
)
sorted_topk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sorted_topk)


def small_config(**over):
    config = mc.load_config("tiny")
    config.update(
        hidden_size=64,
        num_attention_heads=2,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        index_n_heads=2,
        index_head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=4,
        vocab_size=50,
        num_hidden_layers=3,
        first_k_dense_replace=2,
    )
    config.update(over)
    return config


class TestCheckpointTensors(unittest.TestCase):
    def test_layer_kinds(self):
        c = small_config()
        names = {n: (shape, kind) for n, shape, kind in mc.checkpoint_tensors(c)}
        for i in (0, 1):  # dense
            self.assertIn(f"model.layers.{i}.mlp.gate_proj.weight", names)
            self.assertNotIn(f"model.layers.{i}.mlp.gate.weight", names)
        for i in (2, 3):  # MoE; 3 is the NextN layer
            self.assertNotIn(f"model.layers.{i}.mlp.gate_proj.weight", names)
            self.assertIn(f"model.layers.{i}.mlp.gate.e_score_correction_bias", names)
            self.assertIn(f"model.layers.{i}.mlp.experts.3.down_proj.weight", names)
            self.assertIn(f"model.layers.{i}.self_attn.indexer.wk.weight", names)
        for s in ("enorm", "hnorm", "eh_proj", "shared_head.head", "embed_tokens"):
            self.assertIn(f"model.layers.3.{s}.weight", names)
            self.assertNotIn(f"model.layers.2.{s}.weight", names)
        self.assertNotIn("model.layers.4.input_layernorm.weight", names)
        h = c["hidden_size"]
        self.assertEqual(
            names["model.layers.0.self_attn.kv_b_proj.weight"][0], (32, 16)
        )
        self.assertEqual(names["model.layers.0.self_attn.q_b_proj.weight"][0], (24, 32))
        self.assertEqual(names["model.layers.0.self_attn.o_proj.weight"][0], (h, 16))
        self.assertEqual(names["model.layers.3.eh_proj.weight"][0], (h, 2 * h))
        self.assertEqual(names["lm_head.weight"][0], (50, h))

    def test_written_checkpoint(self):
        from safetensors import safe_open

        c = small_config()
        with tempfile.TemporaryDirectory() as d:
            meta = mc.write_checkpoint(
                c, d, seed=3, qk_gain=2.0, progress=lambda m: 0, attn_out_gain=3.0
            )
            self.assertEqual(meta["attn_out_gain"], 3.0)
            with open(os.path.join(d, "model.safetensors.index.json")) as f:
                index = json.load(f)
            expected = {n for n, _, _ in mc.checkpoint_tensors(c)}
            self.assertEqual(set(index["weight_map"]), expected)
            self.assertEqual(meta["num_tensors"], len(expected))
            tensors = {}
            for fname in set(index["weight_map"].values()):
                with safe_open(os.path.join(d, fname), "pt") as f:
                    tensors.update({k: f.get_tensor(k) for k in f.keys()})
            self.assertEqual(set(tensors), expected)
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            self.assertEqual(size, index["metadata"]["total_size"])
            p = "model.layers.2."
            self.assertTrue(bool((tensors[p + "input_layernorm.weight"] == 1).all()))
            self.assertTrue(
                bool((tensors[p + "self_attn.indexer.k_norm.bias"] == 0).all())
            )
            bias = tensors[p + "mlp.gate.e_score_correction_bias"]
            self.assertEqual(bias.dtype, torch.float32)
            # N(0, 1/fan_in): std ~ fan_in ** -0.5 (gain 1), x qk_gain on q,
            # x attn_out_gain on o_proj alone.
            w = tensors[p + "self_attn.o_proj.weight"].float()
            self.assertAlmostEqual(w.std().item(), 3 * 16**-0.5, delta=0.3 * 16**-0.5)
            w = tensors["model.layers.0.mlp.down_proj.weight"].float()
            fan_in = w.shape[1]
            self.assertAlmostEqual(
                w.std().item(), fan_in**-0.5, delta=0.1 * fan_in**-0.5
            )
            q = tensors[p + "self_attn.q_b_proj.weight"].float()
            self.assertAlmostEqual(q.std().item(), 2 * 32**-0.5, delta=0.2 * 32**-0.5)
            kvb = tensors[p + "self_attn.kv_b_proj.weight"].float().view(2, 16, 16)
            k_std, v_std = kvb[:, :8].std().item(), kvb[:, 8:].std().item()
            self.assertAlmostEqual(k_std / v_std, 2.0, delta=0.4)
            emb = tensors["model.embed_tokens.weight"].float()
            self.assertAlmostEqual(emb.std().item(), 1.0, delta=0.1)

    def test_seeded_per_tensor(self):
        c = small_config()
        name, shape, kind = mc.checkpoint_tensors(c)[5]
        a = mc.make_tensor(name, shape, kind, c, 1, 1.0, 1.0, "cpu")
        mc.make_tensor("other", (7, 7), "linear", c, 1, 1.0, 1.0, "cpu")
        b = mc.make_tensor(name, shape, kind, c, 1, 1.0, 1.0, "cpu")
        d = mc.make_tensor(name, shape, kind, c, 2, 1.0, 1.0, "cpu")
        self.assertTrue(torch.equal(a, b))
        self.assertFalse(torch.equal(a, d))

    def test_unknown_config_is_one_line_error(self):
        with self.assertRaises(SystemExit) as cm:
            mc.load_config("nope")
        self.assertIn("tiny", str(cm.exception))


class TestExactnessAccounting(unittest.TestCase):
    def test_boundary_lengths(self):
        lengths = exactness.case_lengths(4096, 64, 33000)
        for n in (1, 63, 64, 65, 2047, 2048, 2049, 4095, 4096, 4097, 4159, 4161):
            self.assertIn(n, lengths)
        self.assertIn(4096 - 32, lengths)  # decode crosses the buffer
        self.assertGreaterEqual(max(lengths), 30000)
        self.assertEqual(lengths, sorted(set(lengths)))
        # fewer new tokens: the crossing prompt moves closer to the buffer
        self.assertIn(4096 - 8, exactness.case_lengths(4096, 64, 33000, 17))

    def test_resume_keeps_earlier_servers(self):
        with tempfile.TemporaryDirectory() as d:
            first = os.path.join(d, "first")
            # No server to run: the prompts, an empty summary, no checkpoint.
            exactness.main(["--out", first, "--servers="])
            with open(os.path.join(first, "exactness.json")) as f:
                earlier = json.load(f)
            out = [[1, 2, 3]] * len(earlier["prompt_lens"])
            earlier["servers"] = {
                "base_fp8": {"seq": out},
                "ours_fp8": {"seq": out[:-1] + [[1, 2, 4]]},
            }
            earlier["specs"] = {
                n: exactness.SERVERS[n] for n in ("base_fp8", "ours_fp8")
            }
            with open(os.path.join(first, "exactness.json"), "w") as f:
                json.dump(earlier, f)
            second = os.path.join(d, "second")
            resume = ["--resume-from", os.path.join(first, "exactness.json")]
            exactness.main(["--out", second, "--servers="] + resume)
            with open(os.path.join(second, "summary.json")) as f:
                summary = json.load(f)
            n = len(out)
            self.assertEqual(summary["comparisons"]["ours_fp8"]["seq"]["total"], n)
            self.assertEqual(summary["identical"], n - 1)
            # other prompts (another seed) cannot be resumed
            with self.assertRaises(SystemExit):
                exactness.main(["--out", second, "--servers=", "--seed", "5"] + resume)
            # --nc-only: the control alone, on a server that has one and
            # earlier outputs to keep (refused before any server starts).
            for argv, why in (
                (["--servers", "base_fp8", "--nc-only"], "--resume-from"),
                (["--servers", "ours_fp8", "--nc-only"] + resume, "ours_fp8"),
                (["--servers", "dummy_fp8", "--nc-only"] + resume, "no earlier"),
            ):
                with self.assertRaises(SystemExit) as cm:
                    exactness.main(["--out", second] + argv)
                self.assertIn(why, str(cm.exception))

    def test_merge_calls(self):
        """--report --merge: one result from the calls that each ran servers
        (an --nc-only call adds the control to the kept outputs)."""
        with tempfile.TemporaryDirectory() as d:
            first = os.path.join(d, "first")
            exactness.main(["--out", first, "--servers="])
            path = os.path.join(first, "exactness.json")
            with open(path) as f:
                base = json.load(f)
            out = [[1, 2, 3]] * len(base["prompt_lens"])
            clean = [[1] * (2 * exactness.NC_PERIOD + 1)] * len(base["nc_lens"])

            def call(name, servers, **extra):
                run = {
                    **base,
                    "code_commit": name,
                    "servers": servers,
                    "specs": {n: exactness.SERVERS[n] for n in servers},
                    **extra,
                }
                with open(os.path.join(d, name + ".json"), "w") as f:
                    json.dump(run, f)
                return os.path.join(d, name + ".json")

            calls = [
                call("c1", {"base_fp8": {"seq": out}, "ours_fp8": {"seq": out}}),
                call(
                    "c2",
                    {"base_fp8": {"nc_clean": clean, "nc_armed_step": clean}},
                    resumed={"servers": []},
                    config={**base["config"], "servers": "base_fp8", "nc_only": True},
                ),
                call(
                    "c3",
                    {"ours_fp8_heavy": {"seq": out[:-1] + [[9]]}},
                    resumed={"servers": ["base_fp8", "ours_fp8"]},
                ),
                # ours_fp8 again (new code), its run cut before "concurrent".
                call(
                    "c3b",
                    {"ours_fp8": {"seq": out, "error": "cut"}},
                    resumed={"servers": ["base_fp8", "ours_fp8_heavy"]},
                ),
            ]
            with open(calls[0]) as f:
                c1 = json.load(f)
            c1["servers"]["ours_fp8"]["concurrent"] = out
            with open(calls[0], "w") as f:
                json.dump(c1, f)
            merged_dir = os.path.join(d, "merged")
            exactness.main(["--out", merged_dir, "--report", "--merge", *calls])
            with open(os.path.join(merged_dir, "summary.json")) as f:
                summary = json.load(f)
            self.assertEqual(
                [c["ran"] for c in summary["merged_from"]],
                [["base_fp8", "ours_fp8"], ["base_fp8 (negative control)"],
                 ["ours_fp8_heavy"], ["ours_fp8"]],
            )  # fmt: skip
            with open(os.path.join(merged_dir, "exactness.json")) as f:
                ours = json.load(f)["servers"]["ours_fp8"]
            # c3b replaced c1's record: no concurrent outputs of the old code.
            self.assertEqual(sorted(ours), ["error", "seq"])
            n = len(out)
            heavy = summary["comparisons"]["ours_fp8_heavy"]["seq"]
            self.assertEqual((heavy["identical"], heavy["total"]), (n - 1, n))
            nc = summary["negative_control"]["base_fp8"]["step"]
            self.assertEqual(nc["flipped"], 0)  # the seq outputs stayed too
            self.assertEqual(summary["comparisons"]["ours_fp8"]["seq"]["total"], n)
            # A merged result merged again with a later call keeps every call.
            again = os.path.join(d, "again")
            later = call(
                "c4",
                {"ours_bf16": {"seq": out}},
                resumed={"servers": ["base_fp8", "ours_fp8", "ours_fp8_heavy"]},
            )
            exactness.main(
                ["--out", again, "--report", "--merge",
                 os.path.join(merged_dir, "exactness.json"), later]
            )  # fmt: skip
            with open(os.path.join(again, "summary.json")) as f:
                self.assertEqual(
                    [c["code_commit"] for c in json.load(f)["merged_from"]],
                    ["c1", "c2", "c3", "c3b", "c4"],
                )
            # Another call's prompts (another seed) are refused; so is
            # --merge without --report.
            other = os.path.join(d, "other")
            exactness.main(["--out", other, "--servers=", "--seed", "5"])
            with self.assertRaises(SystemExit) as cm:
                exactness.main(
                    ["--out", merged_dir, "--report", "--merge", calls[0],
                     os.path.join(other, "exactness.json")]
                )  # fmt: skip
            self.assertIn("other prompts", str(cm.exception))
            with self.assertRaises(SystemExit):
                exactness.main(["--out", merged_dir, "--merge", calls[0]])

    def test_headline_lists_what_is_missing(self):
        clean = [[1] * (2 * exactness.NC_PERIOD + 1)] * 10
        flipped = [c[:30] + [2] * (len(c) - 30) for c in clean]
        out = [[1, 2, 3]] * 4

        def run(model, servers, nc_flips, retracted=2, control=out):
            # control: sglang's own retracting batches (base_bf16_retract).
            srv = {
                "base_fp8": {
                    "seq": out,
                    "nc_clean": clean,
                    "nc_armed_step": flipped[:nc_flips] + clean[nc_flips:],
                },
                "base_bf16": {"seq": out},
                "base_fp8_retract": {"seq": out},
                "base_bf16_retract": {
                    "seq": out,
                    "retracted_reqs": {"seq": 0, "concurrent": 3},
                },
            }
            if control is not None:
                srv["base_bf16_retract"]["concurrent"] = control
            for name in servers:
                srv[name] = {
                    "seq": out,
                    "abort_partial": [o[:1] for o in out[:2]],
                    "abort_again": out[:2],
                }
                if "retract" in name:
                    srv[name]["concurrent"] = out
                    srv[name]["retracted_reqs"] = {"seq": 0, "concurrent": retracted}
            result = {
                "servers": srv,
                "specs": {n: exactness.SERVERS[n] for n in srv},
                "prompt_lens": [5, 6, 7, 8],
                "nc_lens": [100] * 10,
                "code_commit": model,
                "logs": {
                    n: {"retractions": 3, "retracted_reqs": retracted}
                    for n in srv
                    if "retract" in n
                },
                "ckpt_meta": {"weights": "checkpoint", "seed": 0},
            }
            return exactness.summarize(result, model)

        every = exactness_headline.REQUIRED_SERVERS + (
            exactness_headline.REQUIRED_RETRACT,
        )
        tiny = run("tiny", every, 10)
        rank = run("rank", every[:2], 9)
        head = exactness_headline.headline([tiny, rank], ["t/", "r/"])
        self.assertEqual(head["identical"], head["total"])
        # 4 seq + 2 abort each; the bf16 retraction server's 4 retract too.
        self.assertEqual(head["total"], 5 * 6 + 4 + 2 * 6)
        self.assertIn("tiny:ours_bf16_retract:retract", head["cases"])
        self.assertEqual(head["negative_control_flip_fraction"], 0.9)
        self.assertEqual(head["code_commits"], ["rank", "tiny"])
        self.assertFalse(head["met"])
        why, why_retract = head["why_not_met"]
        self.assertIn("rank:ours_fp8_heavy:seq", why)
        self.assertIn("rank: not run yet: ours_bf16_retract", why_retract)
        self.assertNotIn("tiny", why + why_retract)
        self.assertEqual(
            head["by_model"]["tiny"]["retracted_reqs"]["ours_bf16_retract"],
            {"seq": 0, "concurrent": 2},
        )
        case = head["by_model"]["tiny"]["retract_case"]
        self.assertEqual((case["kind"], case["retracted_reqs"]), ("retract", 2))
        self.assertEqual(case["control"]["retracted_reqs"], 3)
        # Every case on both, a control that flips enough: met.
        head = exactness_headline.headline([tiny, run("rank", every, 9)], ["t/", "r/"])
        self.assertTrue(head["met"], head["why_not_met"])
        # A control below the target is named; a second run of one
        # checkpoint is refused.
        head = exactness_headline.headline([tiny, run("rank", every, 8)], ["t/", "r/"])
        self.assertIn("rank: negative control 0.8", head["why_not_met"][0])
        # A retraction case in which nothing was retracted does not count.
        head = exactness_headline.headline(
            [tiny, run("rank", every, 9, retracted=0)], ["t/", "r/"]
        )
        self.assertEqual(
            head["why_not_met"],
            ["rank: the retraction case or its control retracted nothing"],
        )
        # A checkpoint whose own retracting batches differ from its batch-1
        # outputs (the first token from a batched prefill) reports the case
        # beside the control and does not count it; one strict case suffices.
        varies = [[9, 2, 3]] + out[1:]
        rank = run("rank", every, 9, control=varies)
        reported = rank["comparisons"]["ours_bf16_retract"]["retract_reported"]
        self.assertEqual(reported["control"]["identical"], 3)
        self.assertEqual(reported["control"]["at_first_token"], 1)
        self.assertNotIn("rank:ours_bf16_retract:retract", rank["cases"])
        head = exactness_headline.headline([tiny, rank], ["t/", "r/"])
        self.assertTrue(head["met"], head["why_not_met"])
        self.assertEqual(head["by_model"]["rank"]["retract_case"]["kind"],
                         "retract_reported")  # fmt: skip
        head = exactness_headline.headline(
            [run("tiny", every, 10, control=varies), rank], ["t/", "r/"]
        )
        self.assertEqual(
            head["why_not_met"], ["no checkpoint has the strict retraction case"]
        )
        # Without its control the case is reported only and has not run.
        rank = run("rank", every, 9, control=None)
        reported = rank["comparisons"]["ours_bf16_retract"]["retract_reported"]
        self.assertEqual((reported["identical"], reported["control"]), (4, None))
        head = exactness_headline.headline([tiny, rank], ["t/", "r/"])
        self.assertIn("rank: not run yet: ours_bf16_retract", head["why_not_met"][0])
        with self.assertRaises(SystemExit):
            exactness_headline.headline([tiny, tiny], ["t/", "t/"])
        # Runs of two releases: the newest's make the headline (a tiny run
        # alone: not met), each release's own below; a checkpoint may run
        # once per release.
        newer = run("tiny", every[:1], 10)
        newer["sglang_version"] = "0.5.17"
        rank = run("rank", every, 9)
        head = exactness_headline.versioned_headline(
            [tiny, rank, newer], ["t/", "r/", "t17/"]
        )
        self.assertEqual(head["sglang_version"], ["0.5.17"])
        self.assertEqual(head["by_model"]["tiny"]["folder"], "t17/")
        self.assertFalse(head["met"])
        self.assertIn("rank: no run", head["why_not_met"])
        by = head["by_sglang_version"]
        self.assertEqual(list(by), ["0.5.12.post1", "0.5.17"])
        self.assertTrue(by["0.5.12.post1"]["met"], by["0.5.12.post1"]["why_not_met"])
        self.assertEqual(by["0.5.17"]["total"], head["total"])
        # One release: the plain headline.
        self.assertNotIn(
            "by_sglang_version",
            exactness_headline.versioned_headline([tiny, rank], ["t/", "r/"]),
        )
        self.assertLess(
            server_utils.release_key("0.5.12.post1"),
            server_utils.release_key("0.5.17"),
        )

    def test_flip_window(self):
        period = exactness.NC_PERIOD
        clean = [1] * (2 * period + 1)
        # prompt 100: the corrupted step decodes token (64 - 100 % 64) = 28
        ic = period - 100 % period
        cases = {
            "same": clean,
            "in_window": clean[:ic] + [2] * (len(clean) - ic),
            "window_end": clean[: ic + period - 1]
            + [2] * (len(clean) - ic - period + 1),
            "after_window": clean[: ic + period] + [2] * (len(clean) - ic - period),
            "before": clean[: ic - 1] + [2] * (len(clean) - ic + 1),
        }
        res = {"nc_clean": [clean] * len(cases), "nc_armed_step": list(cases.values())}
        out = exactness.negative_control(res, [100] * len(cases))
        self.assertEqual(out["flipped"], 2)  # in_window, window_end
        self.assertEqual(out["changed_before_corruption"], 1)
        self.assertTrue(math.isclose(out["flip_fraction"], 2 / 5, rel_tol=1e-3))
        # A prompt whose length is a multiple of 64 is corrupted at token 64.
        res = {"nc_clean": [clean], "nc_armed_step": [clean[:63] + [2] * 66]}
        self.assertEqual(
            exactness.negative_control(res, [128])["changed_before_corruption"], 1
        )

    def test_persistent_mode(self):
        clean = [1] * (2 * exactness.NC_PERIOD + 1)
        res = {
            "nc_clean": [clean] * 3,
            "nc_armed_persistent": [
                clean[:1] + [2] * 128,
                clean[:64] + [2] * 65,
                clean,
            ],
        }
        out = exactness.negative_control(res, [100, 4096, 7], "persistent")
        self.assertEqual(out["flipped"], 2)  # from token 1 on, within 64 tokens
        self.assertEqual(out["changed_before_corruption"], 0)


class TestMtpServers(unittest.TestCase):
    def _args(self, spec_name, d):
        args = exactness.parse_args(["--out", d])
        return exactness.server_args(exactness.SERVERS[spec_name], args, "/ckpt")

    def test_server_flags(self):
        with tempfile.TemporaryDirectory() as d:
            base, base_env = self._args("base_fp8_mtp", d)
            ours, ours_env = self._args("ours_fp8_mtp", d)
            heavy, _ = self._args("ours_fp8_mtp_heavy", d)
            one, _ = self._args("ours_fp8_mtp1", d)
            _, plain_env = self._args("ours_fp8", d)

        def flag(cmd, name):
            return cmd[cmd.index(name) + 1]

        for cmd in (base, ours):
            self.assertEqual(flag(cmd, "--speculative-algorithm"), "NEXTN")
            self.assertEqual(flag(cmd, "--speculative-num-steps"), "3")
            self.assertEqual(flag(cmd, "--speculative-eagle-topk"), "1")
            self.assertEqual(flag(cmd, "--speculative-num-draft-tokens"), "4")
            self.assertIn("--disable-overlap-schedule", cmd)
        self.assertEqual(flag(one, "--speculative-num-draft-tokens"), "2")
        # MTP starts with no gate: no offload env var on either server; the
        # offload one's env is that of the offload server without MTP.
        for env in (base_env, ours_env):
            self.assertEqual(
                [k for k in env if k.startswith("SGLANG_NSA_KV_OFFLOAD_")], []
            )
        self.assertEqual(ours_env, plain_env)
        self.assertNotIn("--enable-decode-nsa-kv-offload", base)
        self.assertIn("--enable-decode-nsa-kv-offload", ours)
        # The heavy server sits at verify's limits: C = q x top-k, W >= 2q - 1.
        q, topk = 4, 2048
        self.assertEqual(int(flag(heavy, "--nsa-kv-offload-gpu-buffer-size")), q * topk)
        self.assertGreaterEqual(
            int(flag(heavy, "--nsa-kv-offload-recent-window")), 2 * q - 1
        )
        # Every MTP offload server is compared with a no-offload MTP server
        # of the same steps and KV dtype.
        for name in exactness.MTP_SERVERS.split(","):
            spec = exactness.SERVERS[name]
            if spec.get("offload") is not None:
                base_spec = exactness.SERVERS[spec["base"]]
                self.assertEqual(base_spec["mtp"], spec["mtp"])
                self.assertEqual(base_spec.get("kv"), spec.get("kv"))
                self.assertIsNone(base_spec.get("offload"))
        self.assertNotIn("mtp", exactness.TINY_SERVERS)

    def test_spec_v2_servers(self):
        # The same MTP flags without --disable-overlap-schedule, each offload
        # server against a no-offload spec v2 server; a group of their own.
        names = exactness.MTP_V2_SERVERS.split(",")
        self.assertIn("base_fp8_mtp_v2", names)
        self.assertIn("ours_fp8_mtp_v2", names)
        self.assertEqual(exactness.server_names("mtp_v2"), names)
        for name in names:
            self.assertNotIn(name, exactness.MTP_SERVERS.split(","))
            self.assertNotIn(name, exactness.TINY_SERVERS.split(","))
        with tempfile.TemporaryDirectory() as d:
            v1, _ = self._args("ours_fp8_mtp", d)
            for name in names:
                spec = exactness.SERVERS[name]
                cmd, env = self._args(name, d)
                self.assertNotIn("--disable-overlap-schedule", cmd)
                self.assertEqual(env["SGLANG_ENABLE_SPEC_V2"], "1")
                if spec.get("offload") is not None:
                    base_spec = exactness.SERVERS[spec["base"]]
                    self.assertTrue(base_spec["spec_v2"])
                    self.assertEqual(base_spec["mtp"], spec["mtp"])
                    self.assertEqual(base_spec.get("kv"), spec.get("kv"))
                    self.assertIsNone(base_spec.get("offload"))
            ours, _ = self._args("ours_fp8_mtp_v2", d)
        v1.remove("--disable-overlap-schedule")
        self.assertEqual(ours, v1)

    def test_accept_counts_compared(self):
        def meta(ct, correct, hist):
            return {
                "spec_verify_ct": ct,
                "spec_num_correct_drafts": correct,
                "spec_correct_drafts_histogram": hist,
                "spec_accept_length": 65 / ct,
            }

        records = [
            exactness.accept_record(meta(20, 45, [2, 3, 5, 10])),
            exactness.accept_record(meta(30, 35, [10, 10, 5, 5])),
        ]
        self.assertIsNone(exactness.accept_record({}))  # no speculation reported
        out = [[1, 2]] * 2

        def summary(ours_accept):
            result = {
                "servers": {
                    "base_fp8_mtp": {"seq": out, "seq_accept": records},
                    "ours_fp8_mtp": {"seq": out, "seq_accept": ours_accept},
                },
                "specs": {
                    n: exactness.SERVERS[n] for n in ("base_fp8_mtp", "ours_fp8_mtp")
                },
                "prompt_lens": [5, 6],
                "nc_lens": [],
                "code_commit": "abc",
            }
            return exactness.summarize(result, "tiny")

        same = summary(list(records))
        self.assertEqual(same["mtp"]["identical"], 2)
        self.assertTrue(same["mtp"]["accept_length_equal"])
        self.assertEqual(same["mtp"]["num_steps"], [3])
        self.assertIn("MTP (steps [3])", exactness.summary_markdown(same))
        # The same tokens, one request verified in other steps: not equal.
        other = summary([records[0], exactness.accept_record(meta(31, 34, [11]))])
        self.assertEqual(other["mtp"]["identical"], 2)
        self.assertFalse(other["mtp"]["accept_length_equal"])
        self.assertEqual(other["mtp"]["accept"]["ours_fp8_mtp"]["first_differing"], [1])
        # A request with no record cannot count as equal.
        missing = summary([records[0], None])
        self.assertFalse(missing["mtp"]["accept_length_equal"])
        # Without MTP servers there is no MTP part.
        plain = exactness.summarize(
            {
                "servers": {"base_fp8": {"seq": out}, "ours_fp8": {"seq": out}},
                "specs": {n: exactness.SERVERS[n] for n in ("base_fp8", "ours_fp8")},
                "prompt_lens": [5, 6],
                "nc_lens": [],
                "code_commit": "abc",
            },
            "tiny",
        )
        self.assertNotIn("mtp", plain)

    def test_cut_seq_phase_keeps_its_prefix(self):
        # A server killed mid-phase (the call's time limit): the last save
        # holds the requests that ran, compared as reported, not counted.
        every = exactness.PARTIAL_EVERY
        prompts = [[i] for i in range(3 * every)]
        meta = {"spec_verify_ct": 4, "spec_num_correct_drafts": 1,
                "spec_correct_drafts_histogram": [3, 1],
                "spec_accept_length": 1.25}  # fmt: skip

        class Cut(Exception):
            pass

        class Server:
            def generate(self, ids, n):
                if ids[0] == 2 * every + 1:
                    raise Cut
                return {
                    "output_ids": [ids[0], 7 if ids[0] == 3 else 5],
                    "meta_info": meta,
                }

        saved = []
        res = {}
        args = types.SimpleNamespace(max_new_tokens=2)
        spec = exactness.SERVERS["ours_fp8_mtp"]
        with self.assertRaises(Cut):
            exactness.run_phases(
                Server(), spec, args, prompts, [], res,
                lambda: saved.append(json.loads(json.dumps(res))),
            )  # fmt: skip
        last = saved[-1]
        self.assertNotIn("seq", last)
        self.assertEqual(len(last["seq_partial"]), 2 * every)
        base_out = [[i, 5] for i in range(3 * every)]
        result = {
            "servers": {
                "base_fp8_mtp": {
                    "seq": base_out,
                    "seq_accept": [exactness.accept_record(meta)] * len(prompts),
                },
                "ours_fp8_mtp": last,
            },
            "specs": {
                n: exactness.SERVERS[n] for n in ("base_fp8_mtp", "ours_fp8_mtp")
            },
            "prompt_lens": [1] * len(prompts),
            "nc_lens": [],
            "code_commit": "abc",
        }
        summary = exactness.summarize(result, "tiny")
        cut = summary["seq_partial"]["ours_fp8_mtp"]
        self.assertEqual((cut["identical"], cut["total"]), (2 * every - 1, 2 * every))
        self.assertEqual(cut["accept"]["identical"], 2 * every)
        self.assertEqual((summary["identical"], summary["total"]), (0, 0))
        self.assertIn(
            "Cut before their seq phase ended", exactness.summary_markdown(summary)
        )
        # A phase that ends drops its partial record.
        done = {}
        with self.assertRaises(AttributeError):  # no streams on this server
            exactness.run_phases(
                Server(), spec, args, prompts[: every + 1], [], done, lambda: None
            )
        self.assertEqual(len(done["seq"]), every + 1)
        self.assertNotIn("seq_partial", done)

    def test_committed_summary_merges_both_halves(self):
        # results/mtp/summary.json: exactness.py's mtp part + bench_server's
        # summary_mtp_speed.json, the keys the issue names.
        out = [[1, 2]] * 2
        accept = [exactness.accept_record({"spec_verify_ct": 2})] * 2
        exact = exactness.summarize(
            {
                "servers": {
                    "base_fp8_mtp1": {"seq": out, "seq_accept": accept},
                    "ours_fp8_mtp1": {"seq": [[1, 2], [1, 3]], "seq_accept": accept},
                },
                "specs": {
                    n: exactness.SERVERS[n] for n in ("base_fp8_mtp1", "ours_fp8_mtp1")
                },
                "prompt_lens": [5, 6],
                "nc_lens": [],
                "code_commit": "abc",
            },
            "tiny",
        )
        speed = {
            "itl_ratio_vs_no_offload_mtp": {"model:32768x1": 1.05},
            "num_steps": [3],
            "code_commit": "def",
        }
        merged = mtp_summary.merge([exact], [speed])
        self.assertEqual((merged["identical"], merged["total"]), (1, 2))
        self.assertTrue(merged["accept_length_equal"])
        self.assertEqual(merged["itl_ratio_vs_no_offload_mtp"], {"model:32768x1": 1.05})
        self.assertEqual(merged["num_steps"], [1, 3])
        self.assertEqual(merged["code_commit"], ["abc", "def"])
        self.assertIsNone(merged["itl_ratio_caveat"])
        # Each release's figures apart: the speed run on another release.
        newer = dict(speed, sglang_version="0.5.17")
        by = mtp_summary.merge([exact], [newer])["by_sglang_version"]
        self.assertEqual(
            by,
            {
                "0.5.12.post1": {
                    "identical": 1,
                    "total": 2,
                    "accept_length_equal": True,
                },
                "0.5.17": {"itl_ratio_vs_no_offload_mtp": {"model:32768x1": 1.05}},
            },
        )
        caveat = mtp_summary.merge([exact], [speed], "baseline handicapped")
        self.assertEqual(caveat["itl_ratio_caveat"], "baseline handicapped")
        # Speed not run yet: the key says so instead of vanishing.
        self.assertIsNone(mtp_summary.merge([exact], [])["itl_ratio_vs_no_offload_mtp"])
        with self.assertRaises(SystemExit) as cm:  # one point from two runs
            mtp_summary.merge([exact], [speed, speed])
        self.assertIn("32768x1", str(cm.exception))
        with self.assertRaises(SystemExit):  # an exactness run without MTP
            mtp_summary.merge([exact, {"identical": 2}], [speed])
        # Two runs (with and without the overlap scheduler) add up; one unequal accept count
        # anywhere makes the whole key false.
        other = json.loads(json.dumps(exact))
        other["mtp"]["accept_length_equal"] = False
        other["mtp"]["code_commit"] = "ghi"
        both = mtp_summary.merge([exact, other], [])
        self.assertEqual((both["identical"], both["total"]), (2, 4))
        self.assertFalse(both["accept_length_equal"])
        self.assertEqual(both["code_commit"], ["abc", "ghi"])

    def test_server_groups_in_a_list(self):
        names = exactness.server_names("base_fp8,mtp,stock_fp8,base_fp8_mtp")
        self.assertEqual(names[0], "base_fp8")
        self.assertEqual(names[1:-1], exactness.MTP_SERVERS.split(","))
        self.assertEqual(names[-1], "stock_fp8")  # base_fp8_mtp once
        self.assertEqual(exactness.server_names(""), [])
        self.assertEqual(
            exactness.server_names("multigpu"), exactness.MULTIGPU_SERVERS.split(",")
        )

    def test_unknown_server_is_one_line_error(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(SystemExit) as cm:
                exactness.main(["--out", d, "--servers", "base_fp8,nope"])
        self.assertIn("nope", str(cm.exception))


class TestTunedServers(unittest.TestCase):
    def test_tuned_servers_run_the_bench_settings(self):
        # The exactness servers of the tuned settings run what the rank bench
        # timed (8 units; its warm units, direct slots and spare regions are
        # the design now, its flat miss copy was removed), each against the
        # no-offload server of its KV dtype.
        import bench_server

        self.assertEqual(
            exactness.TUNED_MAX_UNITS, bench_server.VARIANT_MAX_UNITS["ours_8units"]
        )
        # 8 units of 4,096 rows: int32 slot ids.
        self.assertGreater(exactness.TUNED_MAX_UNITS, server_utils.widest_units(None))
        names = [n for n in exactness.SERVERS if "_tuned" in n]
        self.assertEqual(
            sorted(names),
            ["ours_bf16_tuned", "ours_bf16_tuned_retract", "ours_fp8_tuned",
             "ours_fp8_tuned_4416"],
        )  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            args = exactness.parse_args(["--out", d])
            for name in names:
                spec = exactness.SERVERS[name]
                cmd, env = exactness.server_args(spec, args, "/c")
                units = cmd.index("--nsa-kv-offload-max-units")
                want = "7" if name.endswith("_4416") else str(exactness.TUNED_MAX_UNITS)
                self.assertEqual(cmd[units + 1], want, name)
                self.assertFalse(
                    [k for k in env if k.startswith("SGLANG_NSA_KV_OFFLOAD_")], name
                )
                self.assertIn("--enable-decode-nsa-kv-offload", cmd)
                base = exactness.SERVERS[spec["base"]]
                self.assertIsNone(base.get("offload"))
                self.assertEqual(base.get("kv"), spec.get("kv"))
                self.assertIn(name, exactness.TINY_SERVERS.split(","))


class TestMultiGpuServers(unittest.TestCase):
    # The offload's startup lines, as its modules format them.
    POOL = (
        "[TP{rank}] NSA KV-only host pool: 98304 tokens x 3 layers x 656 B = "
        "0.19 GB (pinned via cudaHostRegister{shared})\n"
    )
    SCOPE = (
        "Decode NSA KV offload: 4096 LRU rows + 64 recent-window rows per request "
        "per layer (index_topk=2048), up to 4 x 4096 LRU rows while GPU memory is "
        "idle, host pool 4.00 GB {scope}.\n"
    )

    def _log(self, d, name, pools, scope):
        path = os.path.join(d, name)
        with open(path, "w") as f:
            f.write(self.SCOPE.format(scope=scope))
            for rank in range(pools):
                f.write(
                    self.POOL.format(rank=rank, shared=", shared" if pools > 1 else "")
                )
        return exactness.scan_log(path)

    def test_flags_and_gates(self):
        with tempfile.TemporaryDirectory() as d:
            args = exactness.parse_args(["--out", d])
            tp, tp_env = exactness.server_args(
                exactness.SERVERS["ours_fp8_tp2"], args, "/c"
            )
            dp, _ = exactness.server_args(exactness.SERVERS["base_fp8_dp2"], args, "/c")
        self.assertEqual(tp[tp.index("--tp-size") + 1], "2")
        self.assertNotIn("--enable-dp-attention", tp)
        self.assertEqual(tp_env[exactness.ENV_UNPROVEN_PARALLEL], "1")
        self.assertIn("--enable-dp-attention", dp)
        self.assertEqual(dp[dp.index("--dp-size") + 1], "2")
        self.assertNotIn("tp2", exactness.TINY_SERVERS)
        self.assertEqual(
            exactness.MULTIGPU_SERVERS,
            "base_fp8_tp2,ours_fp8_tp2,base_fp8_dp2,ours_fp8_dp2",
        )

    def test_host_bytes_from_the_logs(self):
        out = [[1, 2]] * 3
        with tempfile.TemporaryDirectory() as d:
            logs = {
                "ours_fp8": self._log(d, "one", 1, "per rank"),
                "ours_fp8_tp2": self._log(d, "tp", 2, "shared by 2 attention-TP ranks"),
                "ours_fp8_dp2": self._log(d, "dp", 2, "per rank"),
            }
            unshared = self._log(d, "tp_unshared", 2, "per rank")
        self.assertEqual(logs["ours_fp8_tp2"]["host_pool_bytes_per_token"], [1968] * 2)
        self.assertEqual(logs["ours_fp8_tp2"]["host_pool_ranks"], 2)
        names = ("base_fp8_tp2", "ours_fp8_tp2", "base_fp8_dp2", "ours_fp8_dp2")

        def summary(logs):
            result = {
                "servers": {n: {"seq": out} for n in names},
                "specs": {n: exactness.SERVERS[n] for n in names},
                "prompt_lens": [1, 2, 3],
                "nc_lens": [],
                "code_commit": "abc",
                "logs": logs,
            }
            result["servers"]["ours_fp8_dp2"]["seq"] = out[:2] + [[1, 3]]
            return exactness.summarize(result, "tiny")["multigpu"]

        m = summary(logs)
        self.assertEqual(
            (m["tp2_identical"], m["dp2_identical"], m["total"]), (3, 2, 3)
        )
        # One shared pool under TP, one pool per request under DP: as one GPU.
        self.assertEqual(
            m["host_bytes_per_request_ratio_by_shape"], {"tp2": 1.0, "dp2": 1.0}
        )
        # A pool per TP rank holds every request twice.
        m = summary(dict(logs, ours_fp8_tp2=unshared))
        self.assertEqual(m["host_bytes_per_request_ratio"], 2.0)


class TestLevelCase(unittest.TestCase):
    # A decode-log line as the coordinator formats it with units.
    LINE = (
        "Decode batch, #running-req: 8, gen throughput (token/s): 900.00, "
        "nsa-offload hit rate: 0.950, misses: 1200, H2D: 0.10 GB/s, "
        "regions: 8/24, extra units: 16 (0 of staging, {moved} moved)\n"
    )

    def test_slots_units_and_moves_from_the_log(self):
        with tempfile.TemporaryDirectory() as d:
            args = exactness.parse_args(["--out", d])
            flags, _ = exactness.server_args(
                exactness.SERVERS["ours_bf16_level"], args, "/c"
            )
            base, _ = exactness.server_args(exactness.SERVERS["base_bf16"], args, "/c")
            path = os.path.join(d, "log")
            with open(path, "w") as f:
                f.write(self.LINE.format(moved=3) + self.LINE.format(moved=4))
            log = exactness.scan_log(path)
        self.assertEqual(
            flags[flags.index("--max-running-requests") + 1],
            str(exactness.LEVEL_MAX_RUNNING),
        )
        self.assertGreater(exactness.LEVEL_MAX_RUNNING, args.concurrency)
        self.assertEqual(base[base.index("--max-running-requests") + 1], "8")
        self.assertEqual(
            flags[flags.index("--nsa-kv-offload-max-units") + 1],
            str(exactness.LEVEL_MAX_UNITS),
        )
        self.assertEqual(log["units_moved"], 7)
        self.assertEqual(log["misses"], 2400)

    def test_strict_only_when_the_control_is(self):
        out = [[1, 2, 3]] * 4

        def summary(control, level=out):
            names = ("base_bf16", "ours_bf16_level")
            result = {
                "servers": {
                    "base_bf16": {"seq": out, "concurrent": control},
                    "ours_bf16_level": {"seq": out, "concurrent": level},
                },
                "specs": {n: exactness.SERVERS[n] for n in names},
                "prompt_lens": [1, 2, 3, 4],
                "nc_lens": [],
                "code_commit": "abc",
                "logs": {"ours_bf16_level": {"units_moved": 5}},
            }
            return exactness.summarize(result, "tiny")

        s = summary(out, level=out[:3] + [[1, 2, 4]])
        level = s["comparisons"]["ours_bf16_level"]["level"]
        self.assertEqual((level["identical"], level["units_moved"]), (3, 5))
        self.assertIn("tiny:ours_bf16_level:level", s["cases"])
        self.assertEqual((s["identical"], s["total"]), (4 + 3, 4 + 4))
        self.assertIn("3/4 identical, 5 units moved", exactness.summary_markdown(s))
        # The control's batches differ from its batch-1 outputs: reported only.
        s = summary([[9, 2, 3]] + out[1:])
        self.assertIn("level_reported", s["comparisons"]["ours_bf16_level"])
        self.assertNotIn("tiny:ours_bf16_level:level", s["cases"])


class TestSweepSpec(unittest.TestCase):
    def test_fields_and_defaults(self):
        self.assertEqual(
            exactness.parse_sweep("1:1,1.5:2:32,1:1:1:2,"),
            [(1.0, 1.0, 1.0, 0), (1.5, 2.0, 32.0, 0), (1.0, 1.0, 1.0, 2)],
        )
        self.assertEqual(exactness.parse_sweep(""), [])
        with self.assertRaises(SystemExit):
            exactness.parse_sweep("1")


class TestSortedTopk(unittest.TestCase):
    def test_rows_sorted_padding_last(self):
        x = torch.tensor([[5, -1, 2, 9, -1], [3, 1, 0, 2, 4]], dtype=torch.int32)
        out = sorted_topk._sorted_rows(x)
        self.assertEqual(out.tolist(), [[2, 5, 9, -1, -1], [0, 1, 2, 3, 4]])
        self.assertEqual(out.dtype, x.dtype)

    @staticmethod
    def tie_blind_topk(logits, topk, lengths, starts, gen):
        """An exact top-k whose choice among equal scores is random, as the
        radix select's atomics make it: positions relative to each row's
        start, -1 padding, in a random order."""
        out = torch.full((logits.shape[0], topk), -1, dtype=torch.int32)
        for r in range(logits.shape[0]):
            s, n = int(starts[r]), int(lengths[r])
            row = logits[r, s : s + n]
            noise = torch.rand(n, generator=gen) * 1e-3  # below every score gap
            order = sorted(range(n), key=lambda c: (-row[c].item(), noise[c].item()))
            pick = order[:topk]
            pick = [pick[i] for i in torch.randperm(len(pick), generator=gen)]
            out[r, : len(pick)] = torch.tensor(pick, dtype=torch.int32)
        return out

    def test_patch_only_unfused(self):
        gen = torch.Generator().manual_seed(1)
        seen = []

        class Metadata:
            force_unfused_topk = False

            def get_seqlens_expanded(self):
                return torch.tensor([4])

            def topk_transform(self, logits, topk, ks=None, ke_offset=None):
                seen.append(logits.clone())
                lengths = ke_offset if ke_offset is not None else torch.tensor([4])
                starts = ks if ks is not None else torch.zeros_like(lengths)
                return TestSortedTopk.tie_blind_topk(logits, topk, lengths, starts, gen)

        fused = [True]
        module = types.SimpleNamespace(DSAIndexerMetadata=Metadata)
        sorted_topk._patch(module, lambda: fused[0])
        logits = torch.tensor([[0.5, 2.0, 2.0, -1.0]])
        Metadata().topk_transform(logits.clone(), 2)  # fused: as is, once
        self.assertEqual(len(seen), 1)
        self.assertEqual(seen[-1].tolist(), logits.tolist())
        fused[0] = False
        for _ in range(5):  # ties at the cut: 0.5 vs nothing, 2.0 = 2.0 kept
            out = Metadata().topk_transform(logits.clone(), 2).tolist()
            self.assertEqual(out, [[1, 2]])
            # the second call got the picked columns as 1, the rest as 0
            self.assertEqual(seen[-1].tolist(), [[0.0, 1.0, 1.0, 0.0]])
        tie = torch.tensor([[0.5, 2.0, 2.0, 2.0]])
        for _ in range(5):  # three equal at the cut of two: the lower columns
            self.assertEqual(
                Metadata().topk_transform(tie.clone(), 2).tolist(), [[1, 2]]
            )
        out = Metadata().topk_transform(
            tie.clone(), 2, ks=torch.tensor([1]), ke_offset=torch.tensor([3])
        )
        self.assertEqual(out.tolist(), [[0, 1]])  # relative to the row start
        self.assertEqual(seen[-1].tolist(), [[0.0, 1.0, 1.0, 0.0]])
        out = Metadata().topk_transform(
            tie.clone(), 1, ks=torch.tensor([2]), ke_offset=torch.tensor([2])
        )
        self.assertEqual(out.tolist(), [[0]])
        self.assertEqual(seen[-1].tolist(), [[0.0, 0.0, 1.0, 0.0]])

    @staticmethod
    def reference_pick(row, topk, start, length):
        """Columns of the topk largest scores in [start, start + length),
        ties to the lower column."""
        cols = range(start, min(start + length, len(row)))
        return set(sorted(cols, key=lambda c: (-row[c], c))[:topk])

    def test_pick_matches_reference_with_ties(self):
        gen = torch.Generator().manual_seed(0)
        for trial in range(40):
            rows = int(torch.randint(1, 6, (1,), generator=gen))
            cols = int(torch.randint(1, 80, (1,), generator=gen))
            topk = int(torch.randint(1, 40, (1,), generator=gen))
            # few distinct values (many ties), both signs and -inf
            vals = torch.tensor([-3.0, -0.5, 0.0, 0.25, 1.5, float("-inf")])
            logits = vals[torch.randint(0, len(vals), (rows, cols), generator=gen)]
            starts = torch.randint(0, cols, (rows,), generator=gen)
            lengths = torch.randint(0, cols + 1, (rows,), generator=gen)
            lengths = torch.minimum(lengths, cols - starts)
            picked = self.tie_blind_topk(logits, topk, lengths, starts, gen)
            out = logits.clone()
            old = sorted_topk._CHUNK_ELEMS
            sorted_topk._CHUNK_ELEMS = 2 * cols if trial % 2 else old  # row chunks
            try:
                sorted_topk._pick_topk_inplace(out, topk, lengths, starts, picked)
            finally:
                sorted_topk._CHUNK_ELEMS = old
            for r in range(rows):
                want = self.reference_pick(
                    logits[r].tolist(), topk, int(starts[r]), int(lengths[r])
                )
                got = set(torch.nonzero(out[r]).flatten().tolist())
                self.assertEqual(got, want, (trial, r))
                self.assertTrue(set(out[r].unique().tolist()) <= {0.0, 1.0})

    @staticmethod
    def inexact_topk(logits, topk, lengths, starts, gen):
        """sglang's kernel on a long row: its refining passes keep only some
        of the candidates at the cut (16384, in atomic order), so it can
        return k positions that miss larger scores. Modelled as the top-k of
        a random half of each row's columns."""
        out = torch.full((logits.shape[0], topk), -1, dtype=torch.int32)
        for r in range(logits.shape[0]):
            s, n = int(starts[r]), int(lengths[r])
            cols = torch.randperm(n, generator=gen)[: max(topk, n // 2)].tolist()
            row = logits[r, s : s + n]
            pick = sorted(cols, key=lambda c: -row[c].item())[:topk]
            out[r, : len(pick)] = torch.tensor(pick, dtype=torch.int32)
        return out

    def test_pick_exact_when_the_kernel_is_not(self):
        gen = torch.Generator().manual_seed(3)
        wrong_seen = 0
        for trial in range(40):
            rows = int(torch.randint(1, 6, (1,), generator=gen))
            cols = int(torch.randint(8, 120, (1,), generator=gen))
            topk = int(torch.randint(1, 30, (1,), generator=gen))
            logits = torch.randn(rows, cols, generator=gen).round(decimals=1)
            starts = torch.randint(0, cols // 2, (rows,), generator=gen)
            lengths = cols - starts - torch.randint(0, 3, (rows,), generator=gen)
            picked = self.inexact_topk(logits, topk, lengths, starts, gen)
            for capturing in (False, True):  # eager: wrong rows only; graph: all
                out = logits.clone()
                before = sorted_topk._stats["rows_refined"]
                with mock.patch.object(
                    sorted_topk, "_in_graph_capture", return_value=capturing
                ):
                    sorted_topk._pick_topk_inplace(out, topk, lengths, starts, picked)
                wrong_seen += sorted_topk._stats["rows_refined"] - before
                for r in range(rows):
                    want = self.reference_pick(
                        logits[r].tolist(), topk, int(starts[r]), int(lengths[r])
                    )
                    got = set(torch.nonzero(out[r]).flatten().tolist())
                    self.assertEqual(got, want, (trial, r, capturing))
        self.assertGreater(wrong_seen, 20)  # the fallback really ran


class TestBenchHooksMissing(unittest.TestCase):
    """Whether the installed sglang has the benchmark-only top-k hooks (the GPU
    test skips its negative control, the demo its judgement, without them)."""

    def _missing(self, locations):
        spec = types.SimpleNamespace(submodule_search_locations=locations)
        with mock.patch.object(
            server_utils.importlib.util, "find_spec", return_value=spec
        ):
            return server_utils.bench_hooks_missing()

    def test_found_by_file(self):
        with tempfile.TemporaryDirectory() as root:
            attention = Path(root, "srt", "layers", "attention")
            attention.mkdir(parents=True)
            reason = self._missing([root])
            self.assertIn("--with-bench-hooks", reason)
            (attention / "nsa_topk_trace.py").write_text("")
            self.assertIsNone(self._missing(["/nonexistent", root]))

    def test_no_sglang(self):
        with mock.patch.object(
            server_utils.importlib.util, "find_spec", return_value=None
        ):
            self.assertEqual(
                server_utils.bench_hooks_missing(), "sglang is not installed"
            )


class TestVerifyTopkOneGather(unittest.TestCase):
    """bench_hooks/0003: with one page-table row per token (the unfused top-k
    of a target verify), sglang's per-row transform and the single gather
    the hook calls give the same locs."""

    def test_same_locs(self):
        from sglang.srt.layers.attention.nsa.transform_index import (
            transform_index_page_table_decode_ref,
            transform_index_page_table_prefill_ref,
        )

        g = torch.Generator().manual_seed(0)
        rows, max_len, topk = 4 * 8, 3000, 2048
        page_table = torch.randint(1, 1 << 20, (rows, max_len), generator=g)
        page_table = page_table.to(torch.int32)
        topk_indices = torch.randint(0, max_len, (rows, topk), generator=g)
        topk_indices[:, 1500:] = -1  # short contexts pad with -1
        per_row = transform_index_page_table_prefill_ref(
            page_table=page_table,
            topk_indices=topk_indices,
            extend_lens_cpu=[1] * rows,
        )
        one_gather = transform_index_page_table_decode_ref(page_table, topk_indices)
        self.assertTrue(torch.equal(per_row, one_gather))
        self.assertTrue(bool((one_gather[:, 1500:] == -1).all()))
        # Requests of several rows share a page-table row: not this case.
        two = transform_index_page_table_prefill_ref(
            page_table=page_table[: rows // 2],
            topk_indices=topk_indices,
            extend_lens_cpu=[2] * (rows // 2),
        )
        self.assertFalse(torch.equal(two, one_gather))


if __name__ == "__main__":
    unittest.main()
