"""What ``benchmark/nsa_offload/server/bench_server.py`` reads from server logs and how
it combines repeated runs (CPU; the servers themselves need a GPU)."""

import contextlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
import unittest
from pathlib import Path
from unittest import mock

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR / "server"))

import bench_server  # noqa: E402
import numpy as np  # noqa: E402
import server_utils  # noqa: E402


def decode_line(
    running,
    throughput,
    queue=0,
    misses=None,
    prefetched=None,
    units=None,
    moved=None,
    direct=None,
    warmed=None,
    per_request=None,
    reclaimed=None,
):
    line = (
        f"[t] Decode batch, #running-req: {running}, #token: 9, token usage: 0.5, "
        f"cuda graph: True, gen throughput (token/s): {throughput}, "
        f"#queue-req: {queue}"
    )
    if misses is not None:
        extra = "" if prefetched is None else f"prefetched: {prefetched}, "
        line += (
            f", nsa-offload hit rate: 0.800, misses: {misses}, {extra}"
            "H2D: 3.00 GB/s, regions: 4/8"
        )
    if units is not None:
        line += f", extra units: {units} (0 of staging"
        line += ")" if moved is None else f", {moved} moved)"
    if per_request is not None:
        line += f", units per request: {per_request[0]}-{per_request[1]}"
    if reclaimed is not None:
        line += f", units reclaimed: {reclaimed[0]} ({reclaimed[1]} kept by a copy)"
    if direct is not None:
        line += f", direct: {direct}"
    if warmed is not None:
        line += f", warmed: {warmed[0]} ({warmed[1]:.2f} GB)"
    return line


class TestModelSelection(unittest.TestCase):
    """``--model`` / ``--checkpoint``: what every server loads, and the
    weights the GPU budget leaves room for."""

    def tearDown(self):
        server_utils.use_model("tiny")

    def server_cmd(self):
        srv = server_utils.Server("x", ["--port-extra"], 0, tempfile.gettempdir())
        try:
            return srv.cmd
        finally:
            if srv.model_dir:
                shutil.rmtree(srv.model_dir, ignore_errors=True)

    def test_dummy_rank_and_checkpoint(self):
        args = bench_server.parse_args(["--out", "/tmp/x", "--model", "rank"])
        self.assertIsNone(bench_server.select_model(args))
        self.assertEqual(server_utils.num_model_layers(), 61)
        cmd = self.server_cmd()
        self.assertEqual(cmd[cmd.index("--load-format") + 1], "dummy")
        rank_weights = server_utils.model_weights_gib()
        self.assertGreater(rank_weights, 30)  # 61 layers at full attention width
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            os.makedirs(ckpt)
            shutil.copy(
                server_utils.HERE / "tiny_dsv32_config.json", ckpt + "/config.json"
            )
            for name in ("model.safetensors.index.json", "checkpoint_meta.json"):
                with open(os.path.join(ckpt, name), "w") as f:
                    f.write('{"seed": 0}')
            args = bench_server.parse_args(["--out", d, "--checkpoint", ckpt])
            self.assertEqual(bench_server.select_model(args), {"seed": 0})
            self.assertEqual(server_utils.num_model_layers(), 3)
            cmd = self.server_cmd()
            # sglang's argparse: the later --load-format wins
            formats = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--load-format"]
            self.assertEqual(formats[-1], "auto")
            self.assertEqual(cmd[cmd.index("--model-path") + 1], ckpt)
            self.assertLess(server_utils.model_weights_gib(), rank_weights / 50)
        with self.assertRaises(FileNotFoundError):
            server_utils.use_model("nope")


class TestOffloadNamesMatchTheProduct(unittest.TestCase):
    """server_utils keeps its own copy of the offload's env name and default
    units (the tools do not import the patched sglang for them): a rename
    there must not leave the benchmarks setting a variable nobody reads."""

    def test_every_offload_env_name_the_tools_set_is_read(self):
        from sglang.srt.environ import envs

        self.assertTrue(hasattr(envs, server_utils.ENV_UNPROVEN_PARALLEL))
        # No tool (results/ aside: history) names another offload variable:
        # the others were removed from the product.
        names = set()
        for path in BENCH_DIR.rglob("*"):
            if "results" in path.parts or path.suffix not in (".py", ".sh"):
                continue
            names |= set(re.findall(r"SGLANG_NSA_KV_OFFLOAD_\w+", path.read_text()))
        self.assertEqual(names, {server_utils.ENV_UNPROVEN_PARALLEL})

    def test_default_max_units(self):
        # The tools size ours' slot ids by the units the server defaults to.
        from sglang.srt.mem_cache.nsa_kv_offload_units import units_for_context

        for ctx, buffer_size, window in (
            (163840, None, 64),
            (163840, 10240, 64),
            (32768, 4096, 64),
            (32768 + 65, 4096, 64),
            (64, 4096, 64),
        ):
            with self.subTest(ctx=ctx, buffer_size=buffer_size, window=window):
                self.assertEqual(
                    server_utils.offload_max_units(None, buffer_size, ctx, window),
                    units_for_context(ctx, buffer_size or 4096, window),
                )
        self.assertEqual(server_utils.offload_max_units(7, 4096), 7)


class TestOverrideTraceLayers(unittest.TestCase):
    def test_generated_trace_holds_the_chosen_layers(self):
        import tempfile

        import trace_format

        with tempfile.TemporaryDirectory() as out:
            argv = ["--out", out, "--topk", "override", "--contexts", "4096"]
            argv += ["--trace-steps", "3", "--trace-layers", "29,30,31"]
            args = bench_server.parse_args(argv)
            bench_server.prepare_trace(args)
            trace = trace_format.load_trace(args.trace)
        self.assertEqual(trace.layer_ids.tolist(), [29, 30, 31])
        self.assertEqual(trace.topk.shape[0], 3)
        default = bench_server.parse_args(["--out", "/tmp/x"])
        self.assertEqual(default.trace_layers, "0,30,60")

    def test_reported_calibration_keeps_more_of_each_step(self):
        import tempfile

        import trace_format

        def step_overlap(calibration):
            with tempfile.TemporaryDirectory() as out:
                argv = ["--out", out, "--topk", "override", "--contexts", "8192"]
                argv += ["--trace-steps", "4", "--trace-layers", "30"]
                argv += ["--trace-calibration", calibration]
                args = bench_server.parse_args(argv)
                bench_server.prepare_trace(args)
                trace = trace_format.load_trace(args.trace)
            kept = []
            for r in range(trace.topk.shape[2]):
                rows = [set(trace.topk[s, 0, r].tolist()) for s in range(4)]
                kept += [len(a & b) / len(a) for a, b in zip(rows, rows[1:])]
            return sum(kept) / len(kept)

        pessimistic, reported = step_overlap("pessimistic"), step_overlap("reported")
        self.assertGreater(reported, 0.7)  # ~0.75 plus the sinks' and recent picks
        self.assertLess(pessimistic, 0.6)  # ~0.44 in layer 30
        with self.assertRaises(SystemExit):
            bench_server.parse_args(["--out", "/tmp/x", "--trace-calibration", "x"])


class TestOffloadLogLine(unittest.TestCase):
    def test_current_and_older_lines_parse(self):
        # The decode log of committed runs with the (removed) cross-layer
        # prefetch also named its loads: the demand misses still parse.
        for prefetched in (None, 9):
            m = bench_server.OFFLOAD_RE.search(
                decode_line(4, 100.0, misses=77, prefetched=prefetched)
            )
            self.assertEqual(m.group(2), "77")


class TestVariantKinds(unittest.TestCase):
    """The variants of ours that still run differ from it by real server
    flags only; the removed experiments' kinds name committed runs only."""

    def test_runnable_variants_set_no_env_of_their_own(self):
        args = bench_server.parse_args(["--out", "/tmp/x"])
        args.record = False
        ours = bench_server.server_env(args, "ours")
        for kind in bench_server.RUNNABLE_KINDS:
            with self.subTest(kind=kind):
                self.assertIn(kind, bench_server.LABELS)
                self.assertEqual(bench_server.server_env(args, kind), ours)
        for kind in bench_server.VARIANT_MAX_UNITS:
            with self.subTest(kind=kind):
                self.assertIn(kind, bench_server.RUNNABLE_KINDS)

    def test_removed_variants_are_refused_with_their_reason(self):
        for kind in ("ours_prefetch", "ours_clock", "ours_warm_flat", "ours_classic"):
            with self.subTest(kind=kind), tempfile.TemporaryDirectory() as d:
                self.assertNotIn(kind, bench_server.RUNNABLE_KINDS)
                self.assertIn(kind, bench_server.LABELS)  # --plot-only renders it
                with self.assertRaises(SystemExit) as ctx:
                    bench_server.main(["--out", d, "--servers", f"baseline,{kind}"])
                self.assertIn(bench_server.READ_ONLY_KINDS[kind], str(ctx.exception))
        # The removed switches are no options any more.
        for flag in ("--cross-layer-prefetch", "--spare-regions"):
            with self.subTest(flag=flag), self.assertRaises(SystemExit):
                with contextlib.redirect_stderr(io.StringIO()):
                    bench_server.parse_args(["--out", "/tmp/x", flag])


class TestRankSummaries(unittest.TestCase):
    """The two committed summaries of the rank-model runs (issues 18, 20)."""

    @staticmethod
    def make_run(
        topk, calibration, itl, h2d, profile_swap=None, commit="abc", elastic=True
    ):
        def point(kind, conc, at_cap=False):
            p = {
                "ctx": 32768,
                "conc": conc,
                "at_capacity": at_cap,
                "server": {
                    "itl_ms": itl[kind] * (1 + conc / 100),
                    "throughput_tok_s": conc * 1000.0 / itl[kind],
                    "h2d_gbps": h2d if kind == "ours" else None,
                },
                "client": {},
            }
            if profile_swap is not None and kind == "ours" and not at_cap:
                p["profile"] = {"gpu_us_per_step": {"swap": profile_swap * conc}}
            return p

        servers = {
            kind: {
                "points": [point(kind, 1), point(kind, 8), point(kind, 16, True)],
                "capacity": {"32768": cap, "131072": cap128},
            }
            for kind, cap, cap128 in (
                ("baseline", 10, 2),
                ("ours", 40, 11),
                ("hisparse", 20, 5),
            )
        }
        return {
            "config": {
                "model": "rank",
                "topk": topk,
                "trace_calibration": calibration,
                "cap_contexts": [32768],
                "layers": 61,
                "command": f"bench_server.py --topk {topk}",
                "code_commit": commit,
                "elastic_default": elastic,
            },
            "servers": servers,
        }

    def test_keys_and_figures(self):
        itl = {"baseline": 10.0, "ours": 10.4, "hisparse": 12.0}
        runs = [
            self.make_run("model", None, itl, 0.5, profile_swap=61 * 15.0),
            self.make_run("override", "reported", dict(itl, ours=10.3), 8.0),
            self.make_run("override", "pessimistic", dict(itl, ours=11.0), 20.0),
        ]
        out = bench_server.rank_summaries(runs)
        model, speed = out["rank_model"], out["rank_speed"]
        for key in (
            "p3_capacity_ratio",
            "p3_length",
            "p4_itl_overhead",
            "p5_vs_no_offload",
            "p5_vs_hisparse",
            "p5_h2d_gbps",
            "code_commit",
        ):
            self.assertIn(key, model)
        self.assertEqual(model["p3_length"], 131072)  # the longest with both
        self.assertAlmostEqual(model["p3_capacity_ratio"], 5.5)
        # A first run without servers at capacity (another budget) leaves P3
        # to the run that measured capacity.
        other = self.make_run("override", "reported", itl, 1.0)
        other["config"]["cap_contexts"] = []
        other["servers"]["baseline"]["capacity"]["131072"] = 10
        p3 = bench_server.rank_summaries([other] + runs)["rank_model"]
        self.assertAlmostEqual(p3["p3_capacity_ratio"], 5.5)
        p3 = bench_server.rank_summaries([other])["rank_model"]
        self.assertAlmostEqual(p3["p3_capacity_ratio"], 1.1)
        # Runs that do not record the schedule: "ours" was the inline swap.
        self.assertEqual(model["p4_itl_overhead"], {})
        self.assertEqual(
            model["p4_itl_overhead_inline"], {"32768x1": 0.04, "32768x8": 0.04}
        )
        # P5 from the run with the most PCIe traffic (the pessimistic trace).
        self.assertEqual(model["p5_trace"], "pessimistic")
        self.assertEqual(model["p5_h2d_gbps"], 20.0)
        self.assertAlmostEqual(model["p5_vs_no_offload"], 10.0 / 11.0)
        self.assertAlmostEqual(model["p5_vs_hisparse"], 12.0 / 11.0)
        self.assertEqual(
            set(speed["p4_itl_overhead_inline"]),
            {
                f"{t}:32768x{b}"
                for t in ("model", "reported", "pessimistic")
                for b in (1, 8)
            },
        )
        self.assertAlmostEqual(
            speed["p4_itl_overhead_inline"]["reported:32768x8"], 0.03
        )
        self.assertAlmostEqual(speed["hisparse_itl_overhead"]["model:32768x1"], 0.2)
        self.assertEqual(speed["swap_us_per_layer"], {"1": 15.0, "8": 120.0})
        self.assertEqual(speed["code_commit"], "abc")
        # Runs of other code are named, not merged silently.
        runs[1]["config"]["code_commit"] = "def"
        self.assertEqual(
            bench_server.rank_summaries(runs)["rank_speed"]["code_commit"],
            ["abc", "def"],
        )
        # No rank run: nothing to summarise.
        runs[0]["config"]["model"] = "tiny"
        self.assertEqual(bench_server.rank_summaries(runs[:1]), {})

    def test_figures_by_sglang_version(self):
        # Runs of two releases: each release's figures apart, the later run's
        # winning only in the whole summary.
        itl = {"baseline": 10.0, "ours": 10.4, "hisparse": 12.0}
        older = self.make_run("model", None, dict(itl, ours=10.8), 0.5)
        newer = self.make_run("model", None, itl, 0.5)
        for run in (older, newer):
            run["config"]["early_swap_default"] = True
        newer["config"].update(sglang_version="0.5.17", code_commit="new")
        out = bench_server.rank_summaries([older, newer])
        speed = out["rank_speed"]
        self.assertEqual(speed["sglang_version"], ["0.5.12.post1", "0.5.17"])
        self.assertAlmostEqual(speed["p4_itl_overhead"]["model:32768x8"], 0.04)
        by = speed["by_sglang_version"]
        self.assertEqual(set(by), {"0.5.12.post1", "0.5.17"})
        self.assertAlmostEqual(
            by["0.5.12.post1"]["p4_itl_overhead"]["model:32768x8"], 0.08
        )
        self.assertAlmostEqual(by["0.5.17"]["p4_itl_overhead"]["model:32768x8"], 0.04)
        self.assertEqual(by["0.5.17"]["code_commit"], "new")
        self.assertNotIn("traces", by["0.5.17"])
        self.assertNotIn("p4_itl_overhead_classic", by["0.5.17"])  # empty
        self.assertIn("0.5.17", out["rank_model"]["by_sglang_version"])
        # One release: no per-release block.
        self.assertNotIn(
            "by_sglang_version", bench_server.rank_summaries([newer])["rank_speed"]
        )

    def test_early_swap_is_the_default_schedule(self):
        def variant(run, kind, itl_ratio):
            # Another offload server of the run, ITL scaled from ours'.
            srv = json.loads(json.dumps(run["servers"]["ours"]))
            for p in srv["points"]:
                p["server"]["itl_ms"] *= itl_ratio
            run["servers"][kind] = srv

        itl = {"baseline": 10.0, "ours": 10.4, "hisparse": 12.0}
        # Before the flip: "ours" inline, the early swap as "ours_early".
        older = self.make_run("model", None, itl, 0.5)
        variant(older, "ours_early", 10.2 / 10.4)
        # After it (the run records it): "ours" early, "ours_inline" beside.
        newer = self.make_run("override", "reported", itl, 8.0)
        newer["config"]["early_swap_default"] = True
        variant(newer, "ours_inline", 10.6 / 10.4)
        out = bench_server.rank_summaries([older, newer])
        speed, model = out["rank_speed"], out["rank_model"]
        for conc in (1, 8):
            for key, want in (
                (f"model:32768x{conc}", (0.02, 0.04)),
                (f"reported:32768x{conc}", (0.04, 0.06)),
            ):
                with self.subTest(point=key):
                    self.assertAlmostEqual(speed["p4_itl_overhead"][key], want[0])
                    self.assertAlmostEqual(
                        speed["p4_itl_overhead_inline"][key], want[1]
                    )
            self.assertAlmostEqual(model["p4_itl_overhead"][f"32768x{conc}"], 0.02)
            self.assertAlmostEqual(
                model["p4_itl_overhead_inline"][f"32768x{conc}"], 0.04
            )

    def test_classic_default_before_the_elastic_one(self):
        # Runs before the elastic defaults: "ours" is the classic default
        # (its own keys), ours_idle_locs the elastic defaults' settings.
        itl = {"baseline": 10.0, "ours": 10.8, "hisparse": 12.0}
        older = self.make_run(
            "model", None, itl, 0.5, profile_swap=61 * 20.0, elastic=False
        )
        older["config"]["early_swap_default"] = True
        idle = json.loads(json.dumps(older["servers"]["ours"]))
        for p in idle["points"]:
            p["server"]["itl_ms"] *= 10.1 / 10.8
        older["servers"]["ours_idle_locs"] = idle
        newer = self.make_run(
            "override", "reported", dict(itl, ours=10.2), 8.0, elastic=False
        )
        newer["config"].update(early_swap_default=True, code_commit="722e45f")
        out = bench_server.rank_summaries([older, newer])
        speed, model = out["rank_speed"], out["rank_model"]
        for conc in (1, 8):
            with self.subTest(conc=conc):
                self.assertAlmostEqual(
                    speed["p4_itl_overhead_classic"][f"model:32768x{conc}"], 0.08
                )
                self.assertAlmostEqual(
                    speed["p4_itl_overhead"][f"model:32768x{conc}"], 0.01
                )
                # Unrecorded but listed: 722e45f ran the elastic defaults.
                self.assertAlmostEqual(
                    speed["p4_itl_overhead"][f"reported:32768x{conc}"], 0.02
                )
                # rank_model/summary.json keeps each run's default.
                self.assertAlmostEqual(model["p4_itl_overhead"][f"32768x{conc}"], 0.08)
        self.assertNotIn("reported:32768x1", speed["p4_itl_overhead_classic"])
        self.assertEqual(speed["swap_us_per_layer"], {})
        self.assertEqual(speed["swap_us_per_layer_classic"], {"1": 20.0, "8": 160.0})


class TestServerSpecs(unittest.TestCase):
    def test_default_servers(self):
        self.assertEqual(
            bench_server.parse_args(["--out", "/tmp/x"]).servers,
            "baseline,ours,hisparse",
        )

    def test_unit_caps(self):
        # ours_8units: 8 units whatever --max-units gives the others;
        # ours_fixed one.
        args = self._sized_args("--servers", "baseline,ours,ours_8units")
        units = "--nsa-kv-offload-max-units"
        args.max_units = 6
        specs = bench_server.server_specs(args)
        for kind, want in (("ours", "6"), ("ours_8units", "8"), ("ours_fixed", "1")):
            with self.subTest(kind=kind):
                spec = specs[kind]
                self.assertEqual(spec.count(units), 1)
                self.assertEqual(spec[spec.index(units) + 1], want)

    def test_extra_server_args_reach_every_server(self):
        args = self._sized_args(
            "--servers",
            "baseline,ours,hisparse",
            "--extra-server-args",
            "--disable-prefill-cuda-graph --chunked-prefill-size 4096",
        )
        for kind, spec in bench_server.server_specs(args).items():
            with self.subTest(kind=kind):
                self.assertEqual(spec.count("--disable-prefill-cuda-graph"), 1)
                i = spec.index("--chunked-prefill-size")
                self.assertEqual(spec[i + 1], "4096")

    def test_hisparse_budget_of_its_own(self):
        args = self._sized_args(
            "--servers", "baseline,ours,hisparse", "--kv-budget-gib", "60"
        )
        args.mem_fraction_static = 0.5

        def fraction(flags):
            return flags[flags.index("--mem-fraction-static") + 1]

        specs = bench_server.server_specs(args)
        self.assertEqual(fraction(specs["hisparse"]), "0.5")
        args.hisparse_kv_budget_gib = 14
        specs = bench_server.server_specs(args)
        self.assertEqual(fraction(specs["baseline"]), "0.5")
        self.assertEqual(fraction(specs["ours"]), "0.5")
        want = bench_server.mem_fraction_for_budget(14)[0]
        self.assertEqual(fraction(specs["hisparse"]), str(want))
        self.assertLess(want, bench_server.mem_fraction_for_budget(60)[0])
        # One flag each: sglang would take the last one.
        self.assertEqual(specs["hisparse"].count("--mem-fraction-static"), 1)

    def test_mtp_servers_are_the_pair_with_the_mtp_flags(self):
        args = self._sized_args(
            "--servers", "baseline_mtp,ours_mtp,ours", "--mtp-steps", "2"
        )
        specs = bench_server.server_specs(args)
        mtp = [
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-num-steps",
            "2",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "3",
            "--disable-overlap-schedule",
        ]
        self.assertEqual(specs["baseline_mtp"], specs["baseline"] + mtp)
        self.assertEqual(specs["ours_mtp"], specs["ours"] + mtp)
        # MTP starts with no gate: the MTP servers get the env of their
        # non-MTP counterparts.
        for mtp_kind, kind in (("ours_mtp", "ours"), ("baseline_mtp", "baseline")):
            self.assertEqual(
                bench_server.server_env(args, mtp_kind),
                bench_server.server_env(args, kind),
            )
        # Multi-GPU keeps its gate, MTP or not.
        args.shape = "dp2"
        gate = "SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL"
        self.assertEqual(bench_server.server_env(args, "ours_mtp")[gate], "1")
        self.assertNotIn(gate, bench_server.server_env(args, "baseline_mtp"))
        with self.assertRaises(SystemExit):  # 1-3 steps (docs/MTP.md)
            self._sized_args("--mtp-steps", "4")

    def test_two_gpu_shape_on_every_server(self):
        args = self._sized_args("--servers", "baseline,ours,hisparse", "--shape", "dp2")
        dp = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]
        for kind, flags in bench_server.server_specs(args).items():
            at = flags.index("--tp-size")
            self.assertEqual(flags[at : at + len(dp)], dp, kind)
        gate = "SGLANG_NSA_KV_OFFLOAD_UNPROVEN_PARALLEL"
        self.assertEqual(bench_server.server_env(args, "ours")[gate], "1")
        self.assertNotIn(gate, bench_server.server_env(args, "baseline"))
        self.assertNotIn(gate, bench_server.server_env(args, "hisparse"))
        args.shape = None
        self.assertNotIn("--tp-size", bench_server.server_specs(args)["ours"])
        self.assertNotIn(gate, bench_server.server_env(args, "ours"))

    @staticmethod
    def _sized_args(*argv):
        """Parsed flags with what main() fills in set by hand."""
        args = bench_server.parse_args(["--out", "/tmp/x", "--topk", "override", *argv])
        args.record = False
        args.host_pool_gb = 8
        args.max_running_requests = 4
        args.mem_fraction_static = 0.03
        return args

    def test_pd_decode_servers(self):
        args = self._sized_args("--pd-decode")
        pd = [
            "--disaggregation-mode",
            "decode",
            "--disaggregation-transfer-backend",
            "fake",
            "--num-reserved-decode-tokens",
            str(max(512, args.new_tokens)),
        ]
        for kind, flags in bench_server.server_specs(args).items():
            at = flags.index("--disaggregation-mode")
            self.assertEqual(flags[at : at + len(pd)], pd, kind)
        args.pd_decode = False
        self.assertNotIn(
            "--disaggregation-mode", bench_server.server_specs(args)["ours"]
        )
        # No prefill staging on a PD decode server: more decode regions.
        self.assertGreater(
            bench_server.ours_auto_slots(4.0, 3, 512, pd_decode=True),
            bench_server.ours_auto_slots(4.0, 3, 512),
        )
        # The model's top-k over unwritten KV: refused, as is spec v2 MTP
        # there (the offload refuses it on a PD decode server).
        with self.assertRaises(SystemExit):
            bench_server.parse_args(["--out", "/tmp/x", "--pd-decode"])
        with tempfile.TemporaryDirectory() as out:
            with self.assertRaises(SystemExit) as ctx:
                bench_server.main(
                    ["--out", out, "--pd-decode", "--topk", "override",
                     "--servers", "baseline_mtp,ours_mtp", "--mtp-spec-v2"]
                )  # fmt: skip
        self.assertIn("--mtp-spec-v2", str(ctx.exception))

    def test_servers_start_in_the_order_asked(self):
        # A tight budget must reach the pair named first (not SERVER_KINDS').
        started = []

        def fake_bench(args, kind, deadline, left, guess):
            started.append(kind)
            return {"points": []}

        patches = (
            mock.patch.object(bench_server, "bench_server", side_effect=fake_bench),
            mock.patch.object(bench_server, "prepare_trace"),
            mock.patch.object(bench_server, "select_model", return_value=None),
            mock.patch.object(bench_server, "num_model_layers", return_value=4),
            mock.patch.object(bench_server, "write_report", return_value=[]),
        )
        with tempfile.TemporaryDirectory() as out, contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            bench_server.main(
                ["--out", out, "--no-record", "--mem-fraction-static", "0.5",
                 "--servers", "baseline_mtp,ours_mtp,ours,baseline_mtp"]
            )  # fmt: skip
        self.assertEqual(started, ["baseline_mtp", "ours_mtp", "ours"])

    def test_started_server_keeps_its_first_point(self):
        # Four servers in a tight budget: the equal share is below the first
        # point's estimate; a started server keeps enough for it when the
        # time left allows (the runs of 83c5b32 and 88de4e2 started an
        # offload server only to skip its one point), the later servers get
        # what is left, or no start at all.
        args = self._sized_args("--contexts", "32768", "--concurrency", "32")
        need = bench_server.first_point_estimate_s(args)
        shares, kept = {}, {}

        def fake_measure(args, kind, server, share_end, layers, keep_first):
            shares[kind] = share_end - time.time()
            kept[kind] = keep_first
            return []

        patches = (
            mock.patch.object(bench_server, "BenchServer"),
            mock.patch.object(bench_server, "parse_startup", return_value={}),
            mock.patch.object(bench_server, "gpu_memory_mib", return_value=0),
            mock.patch.object(bench_server, "num_model_layers", return_value=4),
            mock.patch.object(bench_server, "measure", side_effect=fake_measure),
        )
        with contextlib.ExitStack() as stack:
            mocks = [stack.enter_context(p) for p in patches]
            for kind in ("baseline", "ours"):
                deadline = time.time() + 30 + 3 * 90 + 4 * need / 2 + 150
                bench_server.bench_server(args, kind, deadline, 4, 90.0)
            self.assertEqual(mocks[0].call_count, 2)
            # Too little left for a start and the first point: not started.
            deadline = time.time() + 90 + need + 20
            res = bench_server.bench_server(args, "ours_8units", deadline, 1, 90.0)
            self.assertEqual(mocks[0].call_count, 2)
        self.assertGreaterEqual(shares["baseline"], need - 1)
        self.assertGreaterEqual(shares["ours"], need - 1)
        # ... and its first point runs though the warm-up eats into the share.
        self.assertEqual(kept, {"baseline": True, "ours": True})
        self.assertNotIn("ours_8units", shares)
        self.assertTrue(res["error"].startswith("skipped: time budget"), res)
        # The message adds up: start + first point + the spare exceed what is
        # left (the 8K x 64 call of stop 60 read "280 s left for ... 90 s and
        # ... 170 s" without the spare).
        self.assertIn(f"and {bench_server.START_SPARE_S} s to spare)", res["error"])

    def test_first_point_runs_after_the_warm_up(self):
        # The H200 run of 17529c5 skipped the no-offload point: its share was
        # the first point's estimate, and the warm-up ate a second of it.
        args = self._sized_args("--contexts", "32768", "--concurrency", "32")
        need = bench_server.first_point_estimate_s(args)
        server = mock.Mock()
        server.proc.poll.return_value = None
        run = {"client": {}, "decode_log": [], "num_errors": 0}
        patches = (
            mock.patch.object(bench_server, "warm_up"),
            mock.patch.object(bench_server, "parse_startup", return_value={}),
            mock.patch.object(bench_server, "run_point", return_value=run),
            mock.patch.object(bench_server, "summarize_point"),
            mock.patch.object(bench_server, "measured_prefill_rate", return_value=1.0),
        )
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            for keep_first in (True, False):
                with self.subTest(keep_first=keep_first):
                    share_end = time.time() + need - 1
                    points = bench_server.measure(
                        args, "baseline", server, share_end, 4, keep_first
                    )
                    self.assertEqual("skipped" in points[0], not keep_first)

    def test_mtp_server_flags(self):
        args = self._sized_args()
        specs = bench_server.server_specs(args)
        self.assertIn("--disable-overlap-schedule", specs["ours_mtp"])
        self.assertEqual(specs["ours_mtp"][: len(specs["ours"])], specs["ours"])
        args.mtp_spec_v2 = True
        self.assertNotIn(
            "--disable-overlap-schedule", bench_server.server_specs(args)["ours_mtp"]
        )

    def test_trace_layer_cycle(self):
        self.assertEqual(
            bench_server.cycled_trace_layers("29,30,31", 7), "29,30,31,29,30,31,29"
        )
        argv = ["--out", "/tmp/x", "--topk", "override", "--trace-layers", "29,30,31"]
        args = bench_server.parse_args(argv)
        args.record, args.trace = False, "/tmp/t.npz"
        env = "SGLANG_NSA_TOPK_TRACE_LAYERS"
        self.assertNotIn(env, bench_server.server_env(args, "ours"))
        args.trace_layer_cycle = True
        with mock.patch.object(bench_server, "num_model_layers", return_value=4):
            for kind in ("baseline", "ours", "hisparse"):
                got = bench_server.server_env(args, kind)[env]
                self.assertEqual(got, "29,30,31,29,30", kind)  # + NextN

    def test_offload_default_slots(self):
        args = self._sized_args()
        flag = "--max-running-requests"
        self.assertIn(flag, bench_server.server_specs(args)["ours"])
        args.offload_default_slots = True
        specs = bench_server.server_specs(args)
        for kind in ("ours", "ours_mtp", "ours_fixed"):
            self.assertNotIn(flag, specs[kind], kind)
        for kind in ("baseline", "hisparse", "baseline_mtp"):
            self.assertIn(flag, specs[kind], kind)

    def test_baseline_fused_topk(self):
        args = bench_server.parse_args(["--out", "/tmp/x", "--baseline-fused-topk"])
        args.record = False
        fuse = "SGLANG_DSA_FUSE_TOPK"
        for kind in ("baseline", "baseline_mtp"):
            self.assertEqual(bench_server.server_env(args, kind)[fuse], "1", kind)
        for kind in ("ours", "ours_mtp", "hisparse"):
            self.assertEqual(bench_server.server_env(args, kind)[fuse], "0", kind)
        with self.assertRaises(SystemExit):  # the override needs positions
            bench_server.parse_args(
                ["--out", "/tmp/x", "--topk", "override", "--baseline-fused-topk"]
            )

    def test_max_point_tokens(self):
        argv = ["--out", "/tmp/x", "--contexts", "32768,131072"]
        args = bench_server.parse_args(argv + ["--concurrency", "8,32"])
        self.assertEqual(len(bench_server.equal_batch_points(args)), 4)
        args.max_point_tokens = 32768 * 32
        self.assertEqual(
            bench_server.equal_batch_points(args),
            [(32768, 8), (32768, 32), (131072, 8)],
        )

    def test_fake_transfer_requests_carry_a_bootstrap_room(self):
        sent = []

        class Reply:
            def __enter__(self):
                return iter(
                    [b'data: {"meta_info": {"completion_tokens": 1}}', b"data: [DONE]"]
                )

            def __exit__(self, *exc):
                return False

        def urlopen(req, timeout):
            sent.append(json.loads(req.data))
            return Reply()

        for extra, fields in (
            ([], set()),
            (server_utils.PD_DECODE_FAKE_ARGS, {"bootstrap_room"}),
        ):
            server = server_utils.Server("s", extra, 1, "/tmp")
            sent.clear()
            with mock.patch("urllib.request.urlopen", urlopen):
                for _ in range(2):
                    _, chunks = bench_server.stream_generate(server, [1, 2], 1, 5)
            self.assertEqual(chunks[0][1], 1)
            self.assertEqual(fields & set(sent[0]), fields)
            if fields:  # a room per request
                self.assertNotEqual(
                    sent[0]["bootstrap_room"], sent[1]["bootstrap_room"]
                )
            else:
                self.assertNotIn("bootstrap_host", sent[0])

    def test_unknown_server_is_refused(self):
        import tempfile

        with tempfile.TemporaryDirectory() as out:
            with self.assertRaises(SystemExit) as ctx:
                bench_server.main(["--out", out, "--servers", "ours,ours_prefech"])
        self.assertIn("ours_prefech", str(ctx.exception))

    def test_report_has_a_misses_column_per_offload_server(self):
        def point(itl, misses):
            server = {"throughput_tok_s": 1000.0 / itl, "itl_ms": itl}
            if misses is not None:
                server.update(
                    misses_per_step=3 * misses, misses_per_req_layer_step=misses
                )
            return {
                "ctx": 16384,
                "conc": 1,
                "at_capacity": False,
                "server": server,
                "client": {},
            }

        result = {
            "config": {
                "topk": "override",
                "trace": "/tmp/t.npz",
                "mode": "quick",
                "kv_budget_gib": 4.0,
                "mem_fraction_static": 0.03,
                "mem_fraction_how": "given",
                "max_running_requests": 8,
                "new_tokens": 256,
                "repeats": 3,
                "decode_log_interval": 32,
                "layers": 3,
                "started": "now",
                "wall_s": 1.0,
                "cap_contexts": [],
            },
            "servers": {
                "baseline": {"points": [point(1.5, None)]},
                "ours": {"points": [point(1.8, 1100)]},
                "ours_prefetch": {"points": [point(1.7, 430)]},
            },
        }
        md = bench_server.render_markdown([result])
        self.assertIn("ours misses/step (per req-layer)", md)
        self.assertIn("ours + prefetch misses/step (per req-layer)", md)
        row = next(l for l in md.splitlines() if l.startswith("| 16K | 1 |"))
        self.assertIn("| 3300 (1100) | 1290 (430) |", row)
        header = next(l for l in md.splitlines() if l.startswith("| context | batch"))
        self.assertEqual(header.count("|"), row.count("|"))
        # P4 says what the misses' copy alone costs: 3300 x 656 B at 48 GB/s
        # = 0.045 ms, 3% of the no-offload step.
        p4 = next(l for l in md.splitlines() if l.startswith("- **P4**"))
        self.assertIn("16K x 1: +20.0%", p4)
        self.assertIn("the misses' copy alone 0.05 ms = +3% at 48 GB/s", p4)
        rows = bench_server.evaluate_targets(result)["P4"]["rows"]
        self.assertAlmostEqual(rows[0]["miss_copy_ms"], 3300 * 656 / 48e9 * 1e3)


class TestDecodeLog(unittest.TestCase):
    def test_figures_at_the_full_batch(self):
        text = "\n".join(
            [
                decode_line(2, 100.0, queue=2),  # still admitting
                decode_line(4, 150.0, misses=999),  # first line at 4: has a prefill
                decode_line(4, 400.0, misses=4 * 32 * 3 * 100),
                decode_line(4, 420.0, misses=4 * 32 * 3 * 120),
                decode_line(4, 380.0, misses=4 * 32 * 3 * 110),
                "[t] Prefill batch, #new-seq: 1",
                decode_line(1, 90.0, misses=10),  # draining
            ]
        )
        rows = bench_server.parse_decode_lines(text)
        self.assertEqual(len(rows), 6)
        m = bench_server.server_metrics(rows, interval=32, layers=3)
        self.assertEqual(m["peak_running"], 4)
        self.assertEqual(m["lines_used"], 3)  # the ones after a line at 4
        self.assertEqual(m["throughput_tok_s"], 400.0)
        self.assertAlmostEqual(m["itl_ms"], 1000.0 * 4 / 400.0)
        self.assertAlmostEqual(m["misses_per_req_layer_step"], 110.0)
        self.assertAlmostEqual(m["misses_per_step"], 4 * 3 * 110.0)
        self.assertNotIn("units_moved", m)

    def test_units_lent_and_moved(self):
        lines = [
            decode_line(3, 100.0, misses=10, units=4, moved=2),  # admitting
            decode_line(3, 300.0, misses=10, units=6, moved=1),
            decode_line(3, 300.0, misses=10, units=6, moved=0),
            decode_line(3, 300.0, misses=10, units=7, moved=0),
        ]
        m = bench_server.server_metrics(
            bench_server.parse_decode_lines("\n".join(lines)), interval=32, layers=3
        )
        self.assertEqual(m["units_moved"], 3)  # the whole run's
        self.assertEqual(m["extra_units"], 6)  # median at the full batch
        # Logs before units moved (no "moved" field): lent units only.
        old = decode_line(3, 300.0, misses=10, units=5)
        row = bench_server.parse_decode_lines(old)[0]
        self.assertEqual((row["extra_units"], "units_moved" in row), (5, False))

    def test_direct_requests(self):
        # With direct slots the line counts the requests in direct mode.
        lines = [
            decode_line(3, 100.0, misses=10, units=4, moved=0, direct=0),
            decode_line(3, 300.0, misses=10, units=6, moved=0, direct=2),
            decode_line(3, 300.0, misses=10, units=6, moved=0, direct=2),
            decode_line(3, 300.0, misses=10, units=6, moved=0, direct=1),
        ]
        rows = bench_server.parse_decode_lines("\n".join(lines))
        self.assertEqual([r["direct_requests"] for r in rows], [0, 2, 2, 1])
        m = bench_server.server_metrics(rows, interval=32, layers=3)
        self.assertEqual(m["direct_requests"], 2)
        # The report's misses cell names them.
        ours = {
            "points": [{"ctx": 30720, "conc": 3, "at_capacity": False, "server": m}]
        }
        self.assertEqual(
            bench_server._misses_cell(ours, 30720, 3),
            f"{m['misses_per_step']:.0f} ({m['misses_per_req_layer_step']:.0f}), 2 direct",
        )

    def test_units_per_request(self):
        # Since stop 60 the line names the poorest and the richest request's
        # units (at 8K x 64 an uneven split, not logged then, made +19.2%).
        lines = [
            decode_line(3, 100.0, misses=10, units=4, moved=0, per_request=(1, 3)),
            decode_line(3, 300.0, misses=10, units=6, moved=0, per_request=(1, 3)),
            decode_line(3, 300.0, misses=10, units=6, moved=1, per_request=(2, 3)),
            decode_line(3, 300.0, misses=10, units=6, moved=0, per_request=(3, 3)),
        ]
        rows = bench_server.parse_decode_lines("\n".join(lines))
        self.assertEqual([r["fewest_units"] for r in rows], [1, 1, 2, 3])
        self.assertEqual(rows[0]["extra_units"], 4)  # the units field still parses
        m = bench_server.server_metrics(rows, interval=32, layers=3)
        self.assertEqual((m["fewest_units"], m["most_units"]), (2, 3))
        ours = {"points": [{"ctx": 8192, "conc": 3, "at_capacity": False, "server": m}]}
        self.assertTrue(
            bench_server._misses_cell(ours, 8192, 3).endswith(", units 2-3")
        )
        # Older logs: no such field, no such key.
        old = bench_server.parse_decode_lines(decode_line(3, 300.0, misses=10, units=6))
        self.assertNotIn("fewest_units", old[0])
        # Without direct slots: no field.
        m = bench_server.server_metrics(
            bench_server.parse_decode_lines(decode_line(3, 300.0, misses=10)),
            interval=32,
            layers=3,
        )
        self.assertNotIn("direct_requests", m)

    def test_units_reclaimed(self):
        # Since stop 61 the line names the units taken back over its
        # interval (the coordinator's format, test_nsa_kv_offload_integration)
        # when any was; the run's totals add them up.
        lines = [
            decode_line(3, 100.0, misses=10, units=4, per_request=(1, 3)),
            decode_line(
                3, 300.0, misses=10, units=6, per_request=(2, 3), reclaimed=(3, 1)
            ),
            decode_line(
                3, 300.0, misses=10, units=6, per_request=(2, 3), reclaimed=(2, 2)
            ),
        ]
        rows = bench_server.parse_decode_lines("\n".join(lines))
        self.assertNotIn("units_reclaimed", rows[0])
        self.assertEqual((rows[1]["units_reclaimed"], rows[1]["units_kept"]), (3, 1))
        m = bench_server.server_metrics(rows, interval=32, layers=3)
        self.assertEqual((m["units_reclaimed"], m["units_kept"]), (5, 3))
        self.assertEqual((m["fewest_units"], m["most_units"]), (2, 3))
        ours = {"points": [{"ctx": 8192, "conc": 3, "at_capacity": False, "server": m}]}
        self.assertTrue(
            bench_server._misses_cell(ours, 8192, 3).endswith(
                ", units 2-3, 5 reclaimed (3 kept)"
            )
        )
        m = bench_server.server_metrics(rows[:1], interval=32, layers=3)
        self.assertNotIn("units_reclaimed", m)

    def test_warmed_admissions(self):
        # The line names the admissions warmed over its interval (the
        # coordinator's format, test_nsa_kv_offload_integration); the run's
        # totals add them up.
        lines = [
            decode_line(2, 100.0, misses=10, direct=2, warmed=(2, 2.62)),
            decode_line(2, 300.0, misses=10, direct=2),
            decode_line(2, 300.0, misses=10, direct=2, warmed=(1, 1.31)),
        ]
        rows = bench_server.parse_decode_lines("\n".join(lines))
        self.assertEqual([r.get("warmed_requests") for r in rows], [2, None, 1])
        m = bench_server.server_metrics(rows, interval=32, layers=3)
        self.assertEqual((m["warmed_requests"], m["warmed_gb"]), (3, 3.93))
        m = bench_server.server_metrics(rows[1:2], interval=32, layers=3)
        self.assertNotIn("warmed_requests", m)


class TestRepeats(unittest.TestCase):
    def test_median_of_runs(self):
        runs = [
            {"itl_ms": 2.0, "peak_running": 8, "misses": None, "note": "a"},
            {"itl_ms": 9.0, "peak_running": 8, "misses": 30, "note": "b"},
            {"itl_ms": 3.0, "peak_running": 8, "misses": 10, "note": "c"},
        ]
        out = bench_server.median_of_runs(runs)
        self.assertEqual(out["itl_ms"], 3.0)  # an outlier run does not move it
        self.assertEqual(out["peak_running"], 8)
        self.assertEqual(out["misses"], 20)  # over the runs that have a number
        self.assertEqual(out["note"], "c")  # non-numbers: the last run's
        self.assertEqual(out["runs"], 3)
        self.assertEqual(
            bench_server.median_of_runs([{"itl_ms": None}])["itl_ms"], None
        )


class TestPointEstimate(unittest.TestCase):
    ARGV = "--quick --topk override --no-record --profile-steps 16 --out /tmp/x"

    def test_pd_decode_plans_without_a_prefill(self):
        # run_select_64/: at 30K x 64 a PD decode point (2 runs + a profiled
        # one) took 45 s; the prefill guess planned ~165 s and the budget
        # skipped it.
        pd = bench_server.parse_args((self.ARGV + " --pd-decode").split())
        colo = bench_server.parse_args(self.ARGV.split())
        self.assertEqual(pd.prefill_rate_guess, bench_server.PD_ADMIT_RATE_GUESS)
        self.assertEqual(colo.prefill_rate_guess, bench_server.PREFILL_RATE_GUESS)
        est = lambda a: bench_server.point_estimate_s(
            a, 30720, 64, 2, a.prefill_rate_guess, True
        )
        self.assertLess(est(pd), 90)
        self.assertGreater(est(pd), 45)
        self.assertGreater(est(colo), 150)
        given = bench_server.parse_args(
            (self.ARGV + " --pd-decode --prefill-rate-guess 5000").split()
        )
        self.assertEqual(given.prefill_rate_guess, 5000.0)


class TestInterleave(unittest.TestCase):
    @staticmethod
    def point(itls, interleaved=True):
        return {
            "ctx": 16384,
            "conc": 8,
            "at_capacity": False,
            "interleaved": interleaved,
            "server": {"itl_ms": sorted(itls)[len(itls) // 2]},
            "server_runs": [{"itl_ms": v} for v in itls],
            "client": {},
        }

    def test_median_interval(self):
        # Every round alike: the median cannot move.
        for bound in bench_server.median_ci95([1.2] * 9):
            self.assertAlmostEqual(bound, 0.2)
        rng = np.random.default_rng(1)
        few = list(1.05 + 0.2 * rng.standard_normal(15))
        many = list(1.05 + 0.2 * rng.standard_normal(240))
        for ratios in (few, many):
            lo, hi = bench_server.median_ci95(ratios)
            self.assertLessEqual(lo, np.median(ratios) - 1)
            self.assertGreaterEqual(hi, np.median(ratios) - 1)
            # Seeded: a committed table rebuilds to the same interval.
            self.assertEqual(bench_server.median_ci95(ratios), [lo, hi])
        # 16x the rounds: about a quarter of the width.
        (few_lo, few_hi), (lo, hi) = map(bench_server.median_ci95, (few, many))
        self.assertLess(hi - lo, 0.5 * (few_hi - few_lo))
        # The true median (0.05) inside the interval of many rounds.
        self.assertTrue(lo < 0.05 < hi)

    def test_paired_overhead_follows_the_rounds(self):
        # The host slowed down in round 2 for both servers alike: the ratio
        # of medians says +20%, the rounds say +5% each.
        base = self.point([1.0, 2.0, 1.2])
        ours = self.point([1.05, 2.1, 1.26])
        result = {
            "config": {"cap_contexts": []},
            "servers": {"baseline": {"points": [base]}, "ours": {"points": [ours]}},
        }
        p4 = bench_server.evaluate_targets(result)["P4"]
        row = p4["rows"][0]
        self.assertAlmostEqual(row["overhead_server"], 1.26 / 1.2 - 1)
        self.assertAlmostEqual(row["overhead_paired"], 0.05)
        self.assertEqual(len(row["overhead_paired_iqr"]), 2)
        for q in row["overhead_paired_iqr"]:
            self.assertAlmostEqual(q, 0.05)
        self.assertTrue(p4["met"])
        # A round at +30% in most rounds fails it, whatever the medians say.
        result["servers"]["ours"]["points"] = [self.point([1.3, 2.6, 1.0])]
        p4 = bench_server.evaluate_targets(result)["P4"]
        self.assertAlmostEqual(p4["rows"][0]["overhead_paired"], 0.30)
        self.assertFalse(p4["met"])
        # Runs not interleaved have no pairs: the ratio of medians decides.
        result["servers"]["ours"]["points"] = [self.point([1.3, 2.6, 1.0], False)]
        p4 = bench_server.evaluate_targets(result)["P4"]
        self.assertIsNone(p4["rows"][0]["overhead_paired"])
        self.assertAlmostEqual(p4["max_overhead"], 1.3 / 1.2 - 1)

    def test_a_prefilling_server_gets_a_slot_beyond_the_batch(self):
        # sglang marks the batch full while the last-but-one prompt's final
        # chunk holds the last free slot: with slots = batch the last prompt
        # waited for a request to end (peak 7 of 8 in every such run).
        self.assertEqual(bench_server.slots_to_hold(8, pd_decode=False), 9)
        # PD decode: requests arrive prefilled, no chunk holds a slot.
        self.assertEqual(bench_server.slots_to_hold(8, pd_decode=True), 8)

    def test_a_batch_that_never_filled_is_no_p4_point(self):
        # The rank model's 32K x 8 with real prefill: the batch peaked at 7.
        args = mock.Mock(decode_log_interval=16)
        run = {
            "decode_log": [
                {"running": r, "queue": 0, "throughput": 350.0} for r in (5, 7, 7, 7)
            ],
            "client": {},
            "num_errors": 0,
            "elapsed_s": 9.0,
        }
        point = {"ctx": 32768, "conc": 8, "at_capacity": False}
        bench_server.summarize_point("baseline", point, [run], args, 61)
        self.assertIn("peak 7", point["batch_short"])
        full = dict(point, conc=8, server={"itl_ms": 20.0}, client={})
        full.pop("batch_short")
        result = {
            "config": {"cap_contexts": []},
            "servers": {"baseline": {"points": [point]}, "ours": {"points": [full]}},
        }
        self.assertEqual(bench_server.evaluate_targets(result)["P4"]["rows"], [])
        # Both full: the point counts.
        result["servers"]["baseline"]["points"] = [dict(full, server={"itl_ms": 19.0})]
        self.assertEqual(len(bench_server.evaluate_targets(result)["P4"]["rows"]), 1)

    def test_prefetch_has_its_own_p4(self):
        result = {
            "config": {"cap_contexts": []},
            "servers": {
                "baseline": {"points": [self.point([1.0, 1.0, 1.0])]},
                "ours": {"points": [self.point([1.3, 1.3, 1.3])]},
                "ours_prefetch": {"points": [self.point([1.08, 1.02, 1.05])]},
                "ours_units": {"points": [self.point([1.0, 1.1, 1.02])]},
            },
        }
        t = bench_server.evaluate_targets(result)
        self.assertTrue(t["P4_units"]["met"])
        self.assertIn(
            "- **P4** ITL overhead ours + units", "\n".join(bench_server._targets_md(t))
        )
        self.assertFalse(t["P4"]["met"])
        self.assertTrue(t["P4_prefetch"]["met"])
        lines = bench_server._targets_md(t)
        self.assertTrue(
            any(l.startswith("- **P4** ITL overhead ours + pre") for l in lines)
        )
        self.assertIn(
            "median of per-round ratios +5.0%, IQR +4%..+6%", "\n".join(lines)
        )

    def test_mtp_has_its_own_p4_lines(self):
        result = {
            "config": {"cap_contexts": []},
            "servers": {
                "baseline": {"points": [self.point([1.0, 1.0, 1.0])]},
                "ours": {"points": [self.point([1.05, 1.05, 1.05])]},
                "baseline_mtp": {"points": [self.point([0.5, 0.5, 0.5])]},
                "ours_mtp": {"points": [self.point([0.6, 0.6, 0.6])]},
            },
        }
        t = bench_server.evaluate_targets(result)
        # ours + MTP against no offload + MTP: +20%, over the +10% target.
        self.assertAlmostEqual(t["P4_mtp"]["max_overhead"], 0.2)
        self.assertFalse(t["P4_mtp"]["met"])
        self.assertAlmostEqual(t["mtp_vs_no_mtp"]["max_overhead"], 0.6 / 1.05 - 1)
        self.assertTrue(t["P4"]["met"])
        text = "\n".join(bench_server._targets_md(t))
        self.assertIn(
            "- **P4** ITL overhead ours + MTP vs no offload + MTP at equal batch",
            text,
        )
        self.assertIn("- **P4** ITL overhead ours + MTP vs ours at equal batch", text)
        # results/mtp/summary.json's speed key: the ratio, not the overhead.
        result["config"].update(topk="model", mtp_steps=3, code_commit="abc")
        speed = bench_server.mtp_speed_summary([result])
        ratios = speed["itl_ratio_vs_no_offload_mtp"]
        self.assertEqual(ratios, {"tiny:model:16384x8": 1.2})
        result["config"].update(model="rank", topk="override")
        result["config"].update(trace_calibration="reported")
        speed = bench_server.mtp_speed_summary([result])
        ratios = speed["itl_ratio_vs_no_offload_mtp"]
        self.assertEqual(ratios, {"rank:reported:16384x8": 1.2})
        self.assertEqual((speed["num_steps"], speed["code_commit"]), ([3], "abc"))
        # Without the pair, no MTP line.
        del result["servers"]["baseline_mtp"]
        self.assertNotIn("P4_mtp", bench_server.evaluate_targets(result))
        self.assertIsNone(bench_server.mtp_speed_summary([result]))

    def test_arguments(self):
        argv = ["--out", "/tmp/x", "--interleave", "--no-record"]
        args = bench_server.parse_args(argv)
        self.assertIn("--sleep-on-idle", bench_server.server_specs(args)["ours"])
        spec = bench_server.server_specs(args, 0.04)["baseline"]
        self.assertEqual(spec[spec.index("--mem-fraction-static") + 1], "0.04")
        plain = bench_server.parse_args(["--out", "/tmp/x", "--no-record"])
        self.assertNotIn("--sleep-on-idle", bench_server.server_specs(plain)["ours"])
        # A larger LRU buffer goes to both offload servers only, and leaves
        # room for fewer 128K requests in the same budget.
        self.assertNotIn(
            "--nsa-kv-offload-gpu-buffer-size", bench_server.server_specs(plain)["ours"]
        )
        big = bench_server.parse_args(argv + ["--buffer-size", "12288"])
        specs = bench_server.server_specs(big)
        for kind in ("ours", "ours_fixed"):
            i = specs[kind].index("--nsa-kv-offload-gpu-buffer-size")
            self.assertEqual(specs[kind][i + 1], "12288")
        for kind in ("baseline", "hisparse"):
            self.assertNotIn("--nsa-kv-offload-gpu-buffer-size", specs[kind])
        # Units: ours takes the server's default unless --max-units is given;
        # ours_fixed always holds one.
        flag = "--nsa-kv-offload-max-units"
        self.assertNotIn(flag, specs["ours"])
        self.assertEqual(specs["ours_fixed"][-2:], [flag, "1"])
        # ours_wide: the most units int16 slot ids allow at this buffer.
        self.assertEqual(specs["ours_wide"][-2:], [flag, "2"])
        wide = bench_server.server_specs(plain)["ours_wide"]
        self.assertEqual(wide[-2:], [flag, "7"])
        units = bench_server.server_specs(
            bench_server.parse_args(argv + ["--max-units", "3"])
        )
        for kind in ("ours", "ours_mtp"):
            self.assertEqual(units[kind][units[kind].index(flag) + 1], "3")
        self.assertEqual(units["ours_fixed"][-2:], [flag, "1"])
        self.assertLess(
            bench_server.ours_auto_slots(4.0, 3, 256, 12288),
            bench_server.ours_auto_slots(4.0, 3, 256),
        )
        refused = (
            argv[:3],  # the recorder's flushes would fall between the rounds
            argv + ["--profile-steps", "20"],
            argv + ["--cap-contexts", "131072"],
        )
        for bad in refused:
            with self.assertRaises(SystemExit):
                bench_server.parse_args(bad)
        # ours_units only names session 9's runs: units are ours' default.
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(SystemExit) as ctx:
                bench_server.main(["--out", d, "--servers", "baseline,ours_units"])
            self.assertIn("ours_fixed", str(ctx.exception))

    def test_point_estimate_is_on_the_safe_side_of_the_h200_runs(self):
        import json

        # An interleaved H200 run of four servers (16K/32K x 1/8/32, code
        # 526dbfc; test/srt/fixtures/nsa_offload/README.md).
        path = Path(__file__).resolve().parent / "fixtures" / "nsa_offload"
        with open(path / "bench_server_solo_4servers.json") as f:
            result = json.load(f)
        args = bench_server.parse_args(["--out", "/tmp/x"])
        checked = 0
        for srv in result["servers"].values():
            for p in srv["points"]:
                # one run (+ run_point's 0.5 s wait for the log), at the
                # prefill rate the point itself measured
                est = bench_server.point_estimate_s(
                    args, p["ctx"], p["conc"], 1, p["prefill_tok_s"]
                )
                self.assertGreater(est, p["elapsed_s"] + 0.5)
                self.assertLess(est, 3 * (p["elapsed_s"] + 0.5) + 1)
                checked += 1
        self.assertEqual(checked, 24)
        profiled = bench_server.point_estimate_s(args, 16384, 8, 3, 2e5, True)
        self.assertGreater(
            profiled, bench_server.point_estimate_s(args, 16384, 8, 4, 2e5)
        )


class TestInterleavedRuns(unittest.TestCase):
    """``bench_interleaved``'s schedule with stand-in servers (no sglang)."""

    START = 1e6  # the stand-in clock's start

    def _bench(self, extra_argv, deadline, run_s=1.0):
        """bench_interleaved with stand-in servers (hisparse fails to start)
        and a stand-in clock that a server's run moves by ``run_s``;
        returns (result, calls, started)."""
        import tempfile
        import time
        import types
        from unittest import mock

        calls, started = [], []
        clock = [self.START]
        fake_time = types.SimpleNamespace(
            time=lambda: clock[0], sleep=lambda s: None, strftime=time.strftime
        )

        class FakeServer:
            def __init__(self, name, spec, port, out, env=None, timeout=0):
                started.append(self)
                self.name, self.port = name, port
                self.log_path = f"{out}/server_{name}.log"
                self.proc = mock.Mock(**{"poll.return_value": None})
                self.exited = False

            def __enter__(self):
                if self.name.startswith("hisparse"):
                    raise RuntimeError("not healthy")
                return self

            def __exit__(self, *exc):
                self.exited = True

        def fake_run_point(server, ctx, conc, new_tokens, seed, timeout):
            calls.append((server.name.rsplit("_", 1)[0], ctx, conc, seed))
            clock[0] += run_s
            itl = {"baseline": 1.0, "ours": 1.1}[calls[-1][0]]
            lines = [decode_line(conc, 1000.0 * conc / itl) for _ in range(3)]
            return {
                "elapsed_s": 1.0,
                "errors": [],
                "num_errors": 0,
                "client": {"ttft_s_max": 0.5, "itl_ms_p50": itl},
                "decode_log": bench_server.parse_decode_lines("\n".join(lines)),
            }

        with tempfile.TemporaryDirectory() as out:
            argv = ["--out", out, "--interleave", "--no-record"] + extra_argv
            argv += ["--mem-fraction-static", "0.03"]
            args = bench_server.parse_args(argv)
            args.mem_fraction_how, args.trace = "given", None
            result = {"config": {"cap_contexts": []}, "servers": {}}
            with mock.patch.multiple(
                bench_server,
                BenchServer=FakeServer,
                run_point=fake_run_point,
                warm_up=lambda *a: None,
                num_model_layers=lambda: 3,
                time=fake_time,
            ):
                bench_server.bench_interleaved(
                    args, ["baseline", "ours", "hisparse"], deadline, result, lambda: 0
                )
        return result, calls, started

    def test_rounds_rotate_and_a_failed_start_is_reported(self):
        argv = ["--repeats", "3", "--contexts", "4096", "--concurrency", "1,8"]
        result, calls, started = self._bench(argv, 1e12)
        srv = result["servers"]
        # Every server is stopped at the end, the unhealthy one at once.
        self.assertEqual([x.port for x in started], [31200, 31201, 31202])
        self.assertTrue(all(x.exited for x in started))
        self.assertIn("not healthy", srv["hisparse"]["error"])
        self.assertEqual(srv["hisparse"]["points"], [])
        # Per point: 3 rounds, the order rotated each round, the same prompts.
        order = [c[0] for c in calls[:6]]
        self.assertEqual(order, ["baseline", "ours", "ours", "baseline"] + order[:2])
        self.assertEqual({c[3] for c in calls[:6]}, {1000})
        self.assertEqual(len(calls), 12)
        ours = srv["ours"]["points"]
        self.assertEqual([(p["ctx"], p["conc"]) for p in ours], [(4096, 1), (4096, 8)])
        self.assertTrue(all(p["interleaved"] for p in ours))
        self.assertAlmostEqual(ours[1]["server"]["itl_ms"], 1.1)
        p4 = bench_server.evaluate_targets(result)["P4"]
        self.assertAlmostEqual(p4["rows"][1]["overhead_paired"], 0.1)
        # Every round +10%: the median's interval cannot move either.
        self.assertIn(
            "IQR +10%..+10%, the median's 95% interval +10.0%..+10.0%",
            bench_server._p4_line("ours", p4),
        )
        self.assertFalse(p4["met"])  # +10.000...1% (float) is not <= 10%

    def test_hisparse_records_its_own_budget(self):
        argv = ["--contexts", "4096", "--concurrency", "1", "--repeats", "1"]
        result, _, _ = self._bench(argv + ["--hisparse-kv-budget-gib", "14"], 1e12)
        srv = result["servers"]
        self.assertEqual(srv["baseline"]["mem_fraction_static"], 0.03)
        self.assertEqual(
            srv["hisparse"]["mem_fraction_static"],
            bench_server.mem_fraction_for_budget(14)[0],
        )

    def test_time_budget_cuts_rounds_before_points(self):
        # 2 servers, 20000 tokens: the planner says ~243 s a round, a round
        # takes 80 s. With a 410 s share the first round starts on the
        # estimate and the measured rounds decide the rest: 5 of 50.
        argv = ["--repeats", "50", "--contexts", "4096", "--concurrency", "1"]
        argv += ["--new-tokens", "20000"]
        result, calls, _ = self._bench(argv, self.START + 30 + 410, run_s=40)
        self.assertEqual(len(calls), 10)
        (point,) = result["servers"]["ours"]["points"]
        self.assertEqual(len(point["round_orders"]), 5)
        # Two points share the time left evenly: the first one does not
        # spend the second one's share.
        argv[5] = "1,8"
        result, calls, _ = self._bench(argv, self.START + 30 + 820, run_s=40)
        self.assertEqual([c[2] for c in calls], [1] * 10 + [8] * 10)
        # Slower rounds than planned (300 s): the point stops at its share
        # after the first round.
        argv[5] = "1"
        result, calls, _ = self._bench(argv, self.START + 30 + 410, run_s=150)
        self.assertEqual(len(calls), 2)
        # Not even one round fits: the point is skipped, not cut.
        argv[-1] = "100000"
        result, calls, _ = self._bench(argv, self.START + 30 + 2.5 * 243)
        self.assertEqual(calls, [])
        (point,) = result["servers"]["ours"]["points"]
        self.assertIn("time budget", point["skipped"])


if __name__ == "__main__":
    unittest.main()


class TestChurn(unittest.TestCase):
    """--churn: requests coming and going, so that the admissions' stalls
    reach the measured ITL."""

    @staticmethod
    def request(t_send, first, steps, step_s=0.010, stall_at=None, stall_s=0.0):
        """A request's (time, tokens) chunks: its first token at ``first``,
        then one every ``step_s``; the gap before token ``stall_at`` longer
        by ``stall_s`` (an admission's copy stalling the batch)."""
        chunks, t = [(first, 1)], first
        for n in range(2, steps + 1):
            t += step_s + (stall_s if n == stall_at else 0.0)
            chunks.append((t, n))
        return {"t_send": t_send, "chunks": chunks}

    def test_first_wave_ends_staggered(self):
        firsts = [bench_server.churn_new_tokens(160, 4, i, 0) for i in range(4)]
        self.assertEqual(firsts, [40, 80, 120, 160])
        self.assertEqual(bench_server.churn_new_tokens(160, 4, 0, 1), 160)
        self.assertEqual(bench_server.churn_new_tokens(3, 8, 0, 0), 1)

    def test_plan_holds_the_requests_one_after_another(self):
        # 8 clients x 4 requests of 256 tokens at the rank model's ~23 ms step
        # (H100, 14 GiB): each run decodes >= 4 x 256 steps, ~24 s.
        argv = "--model rank --pd-decode --topk override --no-record --churn 4"
        args = bench_server.parse_args(argv.split() + ["--new-tokens", "256"])
        est = bench_server.point_estimate_s(args, 32768, 8, 1, args.prefill_rate_guess)
        self.assertGreater(est, 4 * 256 * 0.023)
        burst = bench_server.parse_args(argv.split()[:-2] + ["--new-tokens", "256"])
        self.assertLess(
            bench_server.point_estimate_s(burst, 32768, 8, 1, args.prefill_rate_guess),
            est / 3,
        )

    def clients(self, stall_s):
        # Client 0: a short first request, then a second one admitted at
        # 0.5 s whose copy stalls client 1 (its 50th token) by stall_s.
        first = self.request(0.0, 0.1, 30)
        second = self.request(0.45, 0.5, 100)
        other = self.request(0.0, 0.1, 150, stall_at=50, stall_s=stall_s)
        return [[first, second], [other]]

    def test_metrics_count_an_admission_stall(self):
        calm = bench_server.churn_client_metrics(self.clients(0.0), 3)
        stalled = bench_server.churn_client_metrics(self.clients(0.1), 3)
        for m in (calm, stalled):
            self.assertEqual((m["requests_ok"], m["requests"]), (3, 3))
            # Sent inside the window (after every client's first token): one.
            self.assertEqual(m["admissions"], 1)
            self.assertAlmostEqual(m["ttft_s_median"], 0.05)
            self.assertAlmostEqual(m["itl_ms_p50"], 10.0, places=6)
        self.assertAlmostEqual(calm["itl_ms_max"], 10.0, places=6)
        self.assertAlmostEqual(stalled["itl_ms_max"], 110.0, places=6)
        self.assertGreater(stalled["itl_ms_mean"], calm["itl_ms_mean"])
        self.assertLess(stalled["throughput_tok_s"], calm["throughput_tok_s"])
        # The window ends when the first client is done (client 0 at 1.49 s).
        self.assertAlmostEqual(calm["window_s"], 0.5 + 0.99 - 0.1)

    def test_metrics_need_every_client(self):
        m = bench_server.churn_client_metrics([[self.request(0.0, 0.1, 5)], []], 4)
        self.assertEqual((m["requests_ok"], m["requests"]), (1, 4))
        self.assertNotIn("itl_ms_mean", m)

    def test_clients_send_back_to_back(self):
        sent = []

        def fake_generate(server, input_ids, new_tokens, timeout):
            sent.append((tuple(input_ids[:4]), new_tokens))
            t = time.perf_counter()
            return t, [(t + 0.001 * n, n) for n in range(1, new_tokens + 1)]

        with tempfile.TemporaryDirectory() as out:
            server = mock.Mock(log_path=os.path.join(out, "server.log"))
            Path(server.log_path).write_text(decode_line(2, 100.0) + "\n")
            args = bench_server.parse_args(["--churn", "3"])
            runs = []
            with mock.patch.object(
                bench_server, "generate_with_retries", fake_generate
            ):
                for _ in range(2):
                    runs.append(
                        bench_server.point_runner(args)(server, 64, 2, 8, 7, 30)
                    )
        self.assertEqual(len(sent), 12)
        first, second = sent[:6], sent[6:]
        self.assertEqual(sorted(first), sorted(second))  # the same work again
        self.assertEqual(len({ids for ids, _ in first}), 6)  # a new prompt each
        self.assertEqual(sorted(n for _, n in first), [4, 8, 8, 8, 8, 8])
        for run in runs:
            self.assertEqual(run["churn"], 3)
            self.assertEqual(run["num_errors"], 0)
            self.assertEqual(run["client"]["requests_ok"], 6)
        self.assertIs(
            bench_server.point_runner(bench_server.parse_args([])),
            bench_server.run_point,
        )

    def test_a_failed_request_ends_its_client(self):
        def refused(server, input_ids, new_tokens, timeout):
            raise RuntimeError("server error: out of memory")

        with tempfile.TemporaryDirectory() as out:
            server = mock.Mock(log_path=os.path.join(out, "server.log"))
            Path(server.log_path).write_text("")
            with mock.patch.object(bench_server, "generate_with_retries", refused):
                run = bench_server.run_churn_point(server, 64, 2, 8, 7, 30, 3)
        self.assertEqual(run["num_errors"], 2)
        self.assertIn("out of memory", run["errors"][0])
        self.assertEqual(run["client"]["requests_ok"], 0)

    @staticmethod
    def point(itl_server, itl_client_mean, churn=3):
        return {
            "ctx": 32768,
            "conc": 8,
            "at_capacity": False,
            "churn": churn,
            "server": {"itl_ms": itl_server},
            "server_runs": [{"itl_ms": itl_server}],
            "client": {"itl_ms_mean": itl_client_mean, "itl_ms_p50": itl_server},
        }

    def test_p4_takes_the_clients_mean_itl(self):
        base = {"points": [self.point(20.0, 21.0)]}
        ours = {"points": [self.point(20.2, 25.2)]}
        p4 = bench_server._p4(base, ours)
        self.assertAlmostEqual(p4["max_overhead"], 0.2)
        self.assertFalse(p4["met"])
        self.assertIn("churn: client mean ITL", bench_server._p4_line("ours", p4))
        # A burst run of the same figures: the server log's steady ratio.
        for p in base["points"] + ours["points"]:
            p["churn"] = 0
        self.assertAlmostEqual(bench_server._p4(base, ours)["max_overhead"], 0.01)

    def test_churn_runs_keep_out_of_the_p4_keys(self):
        run = {
            "config": {
                "model": "rank",
                "topk": "override",
                "trace_calibration": "reported",
                "churn": 3,
                "command": "bench_server.py --churn 3",
            },
            "servers": {
                "baseline": {"points": [self.point(20.0, 21.0)]},
                "ours_idle_locs": {"points": [self.point(20.2, 22.05)]},
                "hisparse": {"points": [self.point(24.0, 26.25)]},
            },
        }
        speed = bench_server.rank_summaries([run])["rank_speed"]
        self.assertEqual(
            speed["churn_itl_overhead"],
            {
                "ours_idle_locs:reported:32768x8": 0.05,
                "hisparse:reported:32768x8": 0.25,
            },
        )
        self.assertEqual(speed["p4_itl_overhead"], {})
        self.assertEqual(speed["hisparse_itl_overhead"], {})
        self.assertEqual(speed["traces"], {"reported": ["bench_server.py --churn 3"]})

    def test_table(self):
        srv = {
            "baseline": {"points": [self.point(20.0, 21.0)]},
            "ours": {"points": [self.point(20.2, 22.0, churn=0)]},
        }
        table = bench_server._churn_table(srv, ["baseline", "ours"])
        self.assertEqual(len([r for r in table if r.startswith("| 32K x 8")]), 1)
        self.assertIn("| 21.00 / 20.00 / - / - |", table[-1])


def load_result_script(path):
    """A committed result's script (results/*/NAME.py) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def printed(fn, *args) -> str:
    """What ``fn(*args)`` writes to stdout."""
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args)
    return out.getvalue()


class TestCommittedSizing(unittest.TestCase):
    """results/rank_speed/default_sizing/*.json are what its sizing.py
    computes (the offload's own sizing and controller) with the flags its
    README gives: a change to the sizing shows up here, not as a stale table."""

    # The locs' share the idle-loc units' LRU state takes (since 774e470)
    # at the 14 GiB H100 run's budget: 0.5% with 4 units of 4,096 rows.
    IDLE_LOC_STATE_SHARE = 0.01

    RUNS = {
        "sizing.json": [],
        "sizing_14gib.json": (
            "--avail-gib 13.96 --request-slots 13 --host-gib 64,24,16,12 "
            "--units 4,40 --points 8x32768"
        ).split(),
    }

    def test_committed_sizing_is_computed(self):
        folder = BENCH_DIR / "results" / "rank_speed" / "default_sizing"
        sizing = load_result_script(folder / "sizing.py")
        for name, argv in self.RUNS.items():
            with self.subTest(run=name):
                with open(folder / name) as f:
                    committed = json.load(f)
                self.assertEqual(json.loads(printed(sizing.main, argv)), committed)
        with open(folder / "sizing_14gib.json") as f:
            rows = json.load(f)["points"]
        # The H100 run's pools (1,564,608 locs, 13 slots, no spare region),
        # less the idle-loc units' LRU state the run (38c8bde) did not have.
        run = rows[0]
        self.assertEqual((run["host_gib"], run["max_units"]), (64.0, 4))
        self.assertLessEqual(run["locs"], 1564608 + 64)
        self.assertGreaterEqual(run["locs"], 1564608 * (1 - self.IDLE_LOC_STATE_SHARE))
        self.assertEqual(run["spare_regions"], 0)


class TestCommittedSizing128K(unittest.TestCase):
    """results/rank_model/sizing_128k_0517/ is what its script computes with
    the product's sizing: the calibration reproduces each run's logged locs."""

    def test_committed_study_is_computed(self):
        folder = BENCH_DIR / "results" / "rank_model" / "sizing_128k_0517"
        study = load_result_script(folder / "sizing_128k.py")
        computed = json.loads(printed(study.main))
        with open(folder / "sizing_128k.json") as f:
            self.assertEqual(computed, json.load(f))
        for run, (_, _, _, logged, _, _) in zip(computed["runs"], study.RUNS):
            as_run = run["variants"][0]
            self.assertEqual(as_run["locs"], logged)


class TestCommittedRankSummaries(unittest.TestCase):
    """results/rank_model/ and results/rank_speed/summary.json are what
    ``--plot-only`` computes from the committed rank runs (no hand edits)."""

    RESULTS = BENCH_DIR / "results"
    RUNS = (
        # First: their 32K x 8 (a 60 GiB budget) yields to the 14 GiB runs' below;
        # the second's 32K x 32 (ours sizing its own slots) to the first's.
        "rank_speed/run_batch32_pd/bench_server_override.json",
        "rank_speed/run_default_slots_pd/bench_server_override.json",
        "rank_model/run_reported/bench_server_override.json",
        "rank_model/run_pessimistic/bench_server_override.json",
        "rank_model/run_model/bench_server_model.json",
        "rank_speed/run_early_reported/bench_server_override.json",
        "rank_speed/run_early_model/bench_server_model.json",
        # A 86 GiB budget: batch 64 (at 30K) and 128K x 8, HiSparse beside.
        "rank_model/run_reported_86gib/bench_server_override.json",
        # The experimental warm units (spare regions, 7 units).
        "rank_speed/run_warm_pd/bench_server_override.json",
        "rank_speed/run_warm_86gib/bench_server_override.json",
        # Warm units again: 30K x 64 profiled; 128K x 8 with 24 units (int32
        # slot ids).
        "rank_speed/run_profile_64/bench_server_override.json",
        "rank_speed/run_wide_128k/bench_server_override.json",
        # Warm units with the select kernel (13094cf), 30K x 32/64 profiled:
        # two device calls merged (--merge-calls).
        "rank_speed/run_select_64/bench_server_override.json",
        # Warm units with 8 units (int32 slot ids) and spare regions: 30K x 32
        # whole in its units, 30K x 64 (3a29ee0); 30K x 64 again (88de4e2,
        # its flat-copy server skipped by the time budget).
        "rank_speed/run_units8_64/bench_server_override.json",
        "rank_speed/run_flat_control/bench_server_override.json",
        # 30K x 64 at 0e53f8c, one machine: the flat miss copy and the swap
        # after the rope, then warm units alone (the flat one's second call
        # skipped by the time budget).
        "rank_speed/run_flat_rope_64/bench_server_override.json",
        "rank_speed/run_warm_control_64/bench_server_override.json",
        # 44d91c1, one machine: warm units again (direct slots' point skipped
        # by the time budget), then direct slots across warm units at 30K x
        # 64/32; the model's top-k at 32K x 1/8 with the 86 GiB budget (the
        # first call's baseline skipped 32K x 8; the second ran it).
        "rank_speed/run_warm_cold_64/bench_server_override.json",
        "rank_speed/run_warm_direct_64/bench_server_override.json",
        "rank_speed/run_model_86gib/bench_server_model.json",
        "rank_speed/run_model_86gib_b8/bench_server_model.json",
        # cfdc9bc, one machine: the flat miss copy on direct slots at 30K x 64
        # (beside direct slots alone); every request whole in its units at
        # 128K x 8 (33 units, 16 slots) and 32K x 32 at 60 GiB (9 units); 30K
        # x 64 again with four runs per point.
        "rank_speed/run_direct_flat_64/bench_server_override.json",
        "rank_speed/run_all_direct_128k/bench_server_override.json",
        "rank_speed/run_all_direct_32k/bench_server_override.json",
        "rank_speed/run_direct_flat_64_repeat/bench_server_override.json",
        # bb34380 on an H100 (no H200 came): 32K x 8 at 14 GiB, the default
        # and warm units + direct slots + flat copy (no request direct).
        "rank_speed/run_h100_reported_32k_x8/bench_server_override.json",
        # 85f8ec9 on an H100: the idle-loc units (ours_idle_locs) at 32K x 8 /
        # 14 GiB (reported beside the elastic settings, pessimistic beside
        # HiSparse), 32K x 16 / 30 GiB beside the default; the model's top-k
        # at 32K x 8 (7 held at once: no P4).
        "rank_speed/run_h100_idle_locs_reported_32k_x8/bench_server_override.json",
        "rank_speed/run_h100_idle_locs_pessimistic_32k_x8/bench_server_override.json",
        "rank_speed/run_h100_idle_locs_reported_32k_x16/bench_server_override.json",
        "rank_speed/run_h100_idle_locs_model_32k/bench_server_model.json",
        # 5eeef49 on an H100, 14 GiB: the idle-loc units at 32K / 64K x 1 / 4
        # and 128K x 1 / 2 beside HiSparse (128K also beside the default), the
        # pessimistic trace at 128K x 1 / 2.
        "rank_speed/run_h100_idle_locs_reported_32k_64k/bench_server_override.json",
        "rank_speed/run_h100_idle_locs_reported_128k/bench_server_override.json",
        "rank_speed/run_h100_idle_locs_pessimistic_128k/bench_server_override.json",
        # 722e45f (the tree of 834aede) on an H200, the elastic defaults: 30K
        # x 64 profiled (HiSparse out of GPU memory), 32K x 8 / x 32 and 128K
        # x 8 at 86 GiB; the --churn run at 32K x 8 / 14 GiB.
        "rank_speed/run_h200_default_30k_x64/bench_server_override.json",
        "rank_speed/run_h200_default_86gib/bench_server_override.json",
        "rank_speed/run_h200_churn_32k_x8/bench_server_override.json",
        # f9a2494 on an H100 (no H200 came), 14 GiB, the elastic defaults: the
        # model's top-k at 32K x 1 profiled (its x 8 held 7 at once: not here);
        # the pessimistic trace at 32K x 1 / 8 beside HiSparse, profiled.
        "rank_speed/run_h100_default_model_32k_x1/bench_server_model.json",
        "rank_speed/run_h100_default_pessimistic_32k/bench_server_override.json",
        # ba83674 on an H100 (no H200 came), the elastic defaults, the model's
        # top-k with a request slot beyond the batch (all held at once): 32K x
        # 8 at 14 GiB; 16K x 32 and 8K x 64 at 30 GiB (two calls merged),
        # profiled.
        "rank_speed/run_h100_default_model_32k_x8/bench_server_model.json",
        "rank_speed/run_h100_default_model_16k_x32/bench_server_model.json",
        "rank_speed/run_h100_default_model_8k_x64/bench_server_model.json",
        # c4afa95 on an H100 (no H200 came): 8K x 64 at 30 GiB again, units
        # of every source levelled (020b0f3) and reclaims that keep a buried
        # unit's rows (c4afa95); replaces the point above.
        "rank_speed/run_h100_default_model_8k_x64_level/bench_server_model.json",
        # 32751af on an H100, sglang 0.5.17: the model's top-k at 32K x 8, 14
        # GiB (replaces the 0.5.12.post1 point above).
        "rank_speed/run_h100_0517_model_32k_x8/bench_server_model.json",
        # c227cb6 on an H100, sglang 0.5.17: 32K x 8 at 14 GiB again, beside
        # 0.5.17's HiSparse (prefill CUDA graphs off on all three).
        "rank_speed/run_h100_0517_hisparse_32k_x8/bench_server_model.json",
        # 7c2decb on an H100, sglang 0.5.17, 30 GiB: batch 1 at 8K / 32K
        # beside HiSparse (ours' 32K and every 8K x 64 but the no-offload
        # one skipped by the time budget), then ours and no offload again
        # (ours' 32K x 1; its 8K x 64 skipped again).
        "rank_speed/run_h100_0517_hisparse_8k_32k_x1/bench_server_model.json",
        "rank_speed/run_h100_0517_model_32k_x1/bench_server_model.json",
    )

    def test_every_committed_server_kind_renders(self):
        # --plot-only re-renders any committed run: a server kind retired
        # since (ours_units, ours_warm_late) keeps its label and colour.
        for path in sorted(self.RESULTS.glob("rank_*/*/bench_server_*.json")):
            with open(path) as f:
                kinds = set(json.load(f)["servers"])
            with self.subTest(run=str(path.relative_to(self.RESULTS))):
                self.assertLessEqual(kinds, set(bench_server.LABELS))
        with tempfile.TemporaryDirectory() as out:
            run = (
                self.RESULTS / "rank_speed/run_late_reorder/bench_server_override.json"
            )
            bench_server.main(["--plot-only", str(run), "--out", out])
            with open(os.path.join(out, "bench_server.md")) as f:
                self.assertIn("ours, warm units + late reorder vs no offload", f.read())

    def test_merged_run_is_its_calls(self):
        run = self.RESULTS / "rank_speed" / "run_select_64"
        calls = []
        for name in ("call2_baseline.json", "call3_ours_warm.json"):
            with open(run / "calls" / name) as f:
                calls.append(json.load(f))
        with open(run / "bench_server_override.json") as f:
            committed = json.load(f)
        merged = bench_server.merge_calls(calls)
        self.assertEqual(json.loads(json.dumps(merged)), committed)
        self.assertEqual(merged["config"]["servers"], ["baseline", "ours_warm"])
        # ours_warm's points were all skipped in the first call: the second's count.
        warm = merged["servers"]["ours_warm"]
        self.assertIs(warm, calls[1]["servers"]["ours_warm"])
        self.assertIn(
            "Merged from 2 device calls", bench_server.render_markdown([merged])
        )
        # Not one measurement: another flag.
        other = json.loads(json.dumps(calls[1]))
        other["config"]["kv_budget_gib"] = 60.0
        with self.assertRaisesRegex(ValueError, "kv_budget_gib"):
            bench_server.merge_calls([calls[0], other])
        # A server measured in two calls: which one counts is not clear.
        with self.assertRaisesRegex(ValueError, "baseline"):
            bench_server.merge_calls([calls[0], calls[0]])
        with self.assertRaisesRegex(ValueError, "at least two"):
            bench_server.merge_calls(calls[:1])

    def test_summaries_match_the_runs(self):
        runs = []
        for rel in self.RUNS:
            with open(self.RESULTS / rel) as f:
                runs.append(json.load(f))
        computed = bench_server.rank_summaries(runs)
        for name in ("rank_model", "rank_speed"):
            with open(self.RESULTS / name / "summary.json") as f:
                committed = json.load(f)
            self.assertEqual(json.loads(json.dumps(computed[name])), committed, name)
        model = computed["rank_model"]
        # P5 counts only with misses crossing PCIe.
        self.assertGreater(model["p5_h2d_gbps"], 1.0)
        self.assertEqual(
            set(computed["rank_speed"]["traces"]), {"model", "reported", "pessimistic"}
        )
        # The warm units' ratios come from their own server kind (ours_warm).
        warm = computed["rank_speed"]["p4_itl_overhead_warm_units"]
        self.assertIn("reported:30720x64", warm)
        self.assertLess(warm["reported:30720x64"], 0.5)
        self.assertNotEqual(
            warm["reported:30720x64"],
            computed["rank_speed"]["p4_itl_overhead"]["reported:30720x64"],
        )
