"""NSA offload traces: file format, calibrated generator, offline replay models.

Covers benchmark/nsa_offload/{trace_format,trace_gen,replay}.py: the trace file
round trip, the generator hitting its overlap targets, our policy's replay model
(docs/ENGINE.md) and HiSparse's on hand-computed examples, the HiSparse model
against a line-by-line transcription of the upstream CUDA kernel, Belady's OPT,
the reference engine (LRUCacheState, torch path) agreeing with the model, and
the replay of the embedded default trace. CPU only, well under a minute.
"""

import os
import sys
import tempfile
import unittest
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "benchmark" / "nsa_offload"
sys.path.insert(0, str(BENCH_DIR / "traces"))

import prefetch_study  # noqa: E402
import replay  # noqa: E402
import trace_format  # noqa: E402
import trace_gen  # noqa: E402
from replay import HiSparseLRU, OursLRU  # noqa: E402
from trace_format import (  # noqa: E402
    NSATopkTrace,
    TraceRecorder,
    load_trace,
    save_trace,
)

EMBEDDED_TRACE = BENCH_DIR / "traces" / "dsv32_synth_default.npz"

# Hand-computed example (K=3, C=H=4; ours W=1). Both policies make hits the
# most recent, so at step 2 both evict position 2 (a miss of step 1) and keep
# position 0 (a hit of step 1), which step 3 then hits. With misses most recent
# (the engine's first rule) ours evicted position 0 instead and missed it at
# step 3: TINY_MISSES_MRU_* below.
TINY_SEQ_LENS = [20, 21, 22, 23]
TINY_TOPK = [[0, 1, 19], [0, 2, 3], [4, 5, 21], [0, 3, 22]]
TINY_OURS_MISSES = [2, 2, 2, 0]
TINY_OURS_ORDERS = [[2, 3, 0, 1], [1, 2, 3, 0], [3, 0, 1, 2], [1, 2, 3, 0]]
TINY_MISSES_MRU_MISSES = [2, 2, 2, 1]
TINY_MISSES_MRU_ORDERS = [[2, 3, 0, 1], [1, 0, 2, 3], [2, 3, 1, 0], [1, 0, 3, 2]]
TINY_HISPARSE_MISSES = [2, 2, 2, 0]
TINY_HISPARSE_ORDERS = [[2, 3, 0, 1], [1, 2, 3, 0], [3, 0, 1, 2], [1, 2, 3, 0]]


def _tiny_trace(topk, seq_lens, k):
    S = len(topk)
    arr = np.full((S, 1, 1, k), -1, dtype=np.int32)
    for s, row in enumerate(topk):
        arr[s, 0, 0, : len(row)] = row
    return NSATopkTrace(arr, np.array(seq_lens)[:, None], [0], ["r0"], {})


def _random_trace(seed, S=12, L=2, B=3, K=32, max_len=400, sorted_rows=True):
    rng = np.random.default_rng(seed)
    topk = np.full((S, L, B, K), -1, dtype=np.int32)
    seq_lens = np.zeros((S, B), dtype=np.int32)
    for b in range(B):
        start = int(rng.integers(0, 3))  # requests join late
        stop = S - int(rng.integers(0, 3))  # and leave early
        n0 = int(rng.integers(K // 2, max_len - S))
        for s in range(start, stop):
            n = n0 + s
            seq_lens[s, b] = n
            for li in range(L):
                m = min(K, n) - int(rng.integers(0, 2))
                # Hot set + recency + noise, so the LRU sees reuse.
                hot = rng.choice(min(n, 3 * K), size=m, replace=False)
                row = hot if rng.random() < 0.5 else rng.choice(n, m, replace=False)
                if sorted_rows:
                    row = np.sort(row)
                topk[s, li, b, :m] = row
    return NSATopkTrace(topk, seq_lens, list(range(L)), [f"r{b}" for b in range(B)])


def _hisparse_kernel_step(top_k, buffer_tokens, lru_slots, seq_len, H):
    """Line-by-line transcription of load_cache_to_device_buffer_kernel
    (sglang 0.5.12.post1 jit_kernel/csrc/hisparse.cuh) for one request, written
    sequentially: hash of the top-k, scan of lru_slots in order (hits forward,
    evictables backward in s_lru_slots_out), misses in top-k order take
    s_lru_slots_out[H - 1 - miss_offset], then the LRU write-back loop."""
    K = len(top_k)
    if seq_len <= H:
        return 0
    TOKEN_HIT = -1  # 0xFFFFFFFF as int32
    newest_token = seq_len - 1
    s_top = list(top_k)
    table = {}
    newest_hit = 0
    for i, tok in enumerate(top_k):
        if tok == newest_token:
            s_top[i] = TOKEN_HIT
            newest_hit = 1
        else:
            table[tok] = i
    out = [0] * H
    hits = evicts = 0
    for slot_idx in range(H):
        buf_slot = lru_slots[slot_idx]
        tok = buffer_tokens[buf_slot]
        found = table.get(tok, -1) if tok >= 0 else -1
        if found >= 0:
            s_top[found] = TOKEN_HIT
            out[hits] = buf_slot
            hits += 1
        else:
            out[H - 1 - evicts] = buf_slot
            evicts += 1
    misses = 0
    for i in range(K):
        if s_top[i] != TOKEN_HIT:
            evict_slot = out[H - 1 - misses]
            buffer_tokens[evict_slot] = s_top[i]
            misses += 1
    total_misses = K - hits - newest_hit
    total_evictable = H - hits
    new = [0] * H
    for i in range(H):
        if i < total_misses:
            new[total_evictable - total_misses + i] = out[H - 1 - i]
        elif i < total_evictable:
            new[i - total_misses] = out[H - 1 - i]
        else:
            new[i] = out[i - total_evictable]
    lru_slots[:] = new
    return misses


class TestTraceFormat(unittest.TestCase):
    def test_round_trip_both_encodings(self):
        with tempfile.TemporaryDirectory() as d:
            for sorted_rows, expected in ((True, "sorted_delta"), (False, "dense")):
                t = _random_trace(1, sorted_rows=sorted_rows)
                t.metadata = {"source": "synthetic", "x": [1, 2], "topk_order": "?"}
                path = os.path.join(d, "t.npz")
                self.assertEqual(save_trace(path, t), expected)
                u = load_trace(path)
                np.testing.assert_array_equal(u.topk, t.topk)
                np.testing.assert_array_equal(u.seq_lens, t.seq_lens)
                np.testing.assert_array_equal(u.layer_ids, t.layer_ids)
                self.assertEqual(u.request_ids, t.request_ids)
                self.assertEqual(u.metadata, t.metadata)
            # Forcing dense on a sortable trace is lossless too.
            t = _random_trace(2)
            self.assertEqual(save_trace(path, t, encoding="dense"), "dense")
            np.testing.assert_array_equal(load_trace(path).topk, t.topk)
            # Uncompressed (the in-server recorder's choice) reads back the same.
            t = _random_trace(4, sorted_rows=False)
            self.assertEqual(save_trace(path, t, compress=False), "dense")
            np.testing.assert_array_equal(load_trace(path).topk, t.topk)

    def test_iter_batches(self):
        t = _random_trace(5)
        got = list(t.iter_batches())
        self.assertEqual(len(got), t.num_steps * t.num_layers)
        for s, li, cols, seq_lens, topk in got:
            np.testing.assert_array_equal(cols, np.nonzero(t.seq_lens[s] > 0)[0])
            np.testing.assert_array_equal(seq_lens, t.seq_lens[s, cols])
            np.testing.assert_array_equal(topk, t.topk[s, li, cols])

    def test_version_and_validation(self):
        t = _random_trace(3)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.npz")
            save_trace(path, t)
            with np.load(path) as z:
                arrays = dict(z)
            arrays["format_version"] = np.array(99)
            np.savez(path, **arrays)
            with self.assertRaisesRegex(ValueError, "version 99"):
                load_trace(path)
        bad = _random_trace(3)
        s, b = np.argwhere(bad.seq_lens > 0)[0]
        bad.topk[s, 0, b, 0] = bad.seq_lens[s, b]  # position >= seq_len
        with self.assertRaises(ValueError):
            bad.validate()

    def test_recorder(self):
        rec = TraceRecorder(top_k=4, metadata={"model": "tiny"})
        rec.begin_step(["a", "b"], np.array([10, 12]))
        rec.record_layer(3, np.array([[0, 9, -1, -1], [11, 1, 2, 3]]))
        rec.record_layer(4, np.array([[1, 2, 3, 4], [0, 5, -1, -1]]))
        rec.end_step()
        rec.begin_step(["b", "c"], [13, 7])  # a left, c joined
        rec.record_layer(3, np.array([[12, 0, 1, 2], [6, 5, 4, 3]]))
        rec.record_layer(4, np.array([[3, 2], [1, 0]]))  # narrower: padded
        rec.end_step()
        t = rec.to_trace()
        t.validate()
        self.assertEqual(t.request_ids, ["a", "b", "c"])
        self.assertEqual(t.layer_ids.tolist(), [3, 4])
        np.testing.assert_array_equal(t.seq_lens, [[10, 12, 0], [0, 13, 7]])
        np.testing.assert_array_equal(t.topk[1, 0, 0], [-1] * 4)
        np.testing.assert_array_equal(t.topk[1, 0, 1], [12, 0, 1, 2])
        np.testing.assert_array_equal(t.topk[1, 1, 2], [1, 0, -1, -1])
        self.assertEqual(t.metadata["source"], "recorded")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.npz")
            self.assertEqual(rec.save(path), "dense")  # indexer order is kept
            np.testing.assert_array_equal(load_trace(path).topk, t.topk)


class TestTraceGenerator(unittest.TestCase):
    def test_calibration_targets_reached(self):
        cfg = trace_gen.GeneratorConfig(
            num_model_layers=6,
            num_requests=2,
            prompt_lens=[4096, 6144],
            num_steps=24,
            top_k=256,
            seed=7,
            step_overlap="0-1:0.02,2-5:0.44",
            adjacent_overlap="3-5:0.8",
            recency_amp="0-1:0,2-5:4.0",
            recency_tau=16.0,
            calib_reps=3,
        )
        trace, report = trace_gen.build_trace(cfg, "test", verbose=False)
        trace.validate()
        self.assertEqual(trace.topk.shape, (24, 6, 2, 256))
        self.assertEqual(
            trace_gen.check_calibration(report, tol_step=0.03, tol_adj=0.05), []
        )
        layers = {e["layer"]: e for e in report["per_layer"]}
        # Early layers sit below the chance overlap K/n (needs the refractory term).
        self.assertLess(layers[0]["step_overlap"], layers[0]["chance_overlap"])
        for layer in (3, 4, 5):
            self.assertAlmostEqual(layers[layer]["adjacent_overlap"], 0.8, delta=0.05)
        for layer in range(6):
            self.assertGreater(min(layers[layer]["sink_pick_rate"]), 0.95)
        for layer in (2, 3, 4, 5):
            self.assertGreater(layers[layer]["recency_pick_rate"]["0-0"], 0.9)
        # Deterministic for a seed.
        again, _ = trace_gen.build_trace(cfg, "test", verbose=False)
        np.testing.assert_array_equal(again.topk, trace.topk)

    def test_layer_spec(self):
        v = trace_gen.parse_layer_spec("0-1:0.015,2-4:0.1~0.3,6:1", 8, "x")
        self.assertEqual(v[:2], [0.015, 0.015])
        np.testing.assert_allclose(v[2:5], [0.1, 0.2, 0.3])
        self.assertEqual(v[5:], [None, 1.0, None])


class TestReplayModels(unittest.TestCase):
    def test_ours_hand_example(self):
        m = OursLRU(lru_slots=4, window=1, max_pos=30)
        for n, row, misses, order in zip(
            TINY_SEQ_LENS, TINY_TOPK, TINY_OURS_MISSES, TINY_OURS_ORDERS
        ):
            r = m.step(np.array(row), n)
            self.assertEqual(r.misses, misses)
            self.assertEqual(m.order.tolist(), order)
        self.assertEqual(m.slot_pos.tolist(), [0, 4, 5, 3])

    def test_ours_misses_mru_hand_example(self):
        m = OursLRU(lru_slots=4, window=1, max_pos=30, hits_mru=False)
        for n, row, misses, order in zip(
            TINY_SEQ_LENS, TINY_TOPK, TINY_MISSES_MRU_MISSES, TINY_MISSES_MRU_ORDERS
        ):
            r = m.step(np.array(row), n)
            self.assertEqual(r.misses, misses)
            self.assertEqual(m.order.tolist(), order)
        self.assertEqual(m.slot_pos.tolist(), [5, 4, 0, 3])

    def test_ours_window_and_page_table(self):
        m = OursLRU(lru_slots=4, window=3, max_pos=30)
        # n=10: window = positions 7..9; 5 and 2 go through the LRU; -1 padding.
        r = m.step(np.array([9, 5, -1, 7, 2]), 10, want_plan=True)
        self.assertEqual((r.misses, r.lru_hits, r.window_hits), (2, 0, 2))
        self.assertEqual(r.rows.tolist(), [4 + 9 % 3, 0, -1, 4 + 7 % 3, 1])
        self.assertEqual(r.miss_pos.tolist(), [5, 2])
        # n=13: 9 left the window (now 10..12) and is not resident -> miss; 5 hit.
        r = m.step(np.array([9, 5, 12]), 13, want_plan=True)
        self.assertEqual((r.misses, r.lru_hits, r.window_hits), (1, 1, 1))
        self.assertEqual(r.victims.tolist(), [2])

    def test_hisparse_hand_example(self):
        m = HiSparseLRU(lru_slots=4, max_pos=30)
        for n, row, misses, order in zip(
            TINY_SEQ_LENS, TINY_TOPK, TINY_HISPARSE_MISSES, TINY_HISPARSE_ORDERS
        ):
            r = m.step(np.array(row), n)
            self.assertEqual(r.misses, misses)
            self.assertEqual(m.order.tolist(), order)
        self.assertEqual(m.slot_pos.tolist(), [0, 4, 5, 3])
        # Fast path: seq_len <= H keeps everything resident, state untouched.
        m = HiSparseLRU(lru_slots=8, max_pos=30, init="prefix")
        r = m.step(np.array([0, 3, 7]), 8)
        self.assertEqual((r.misses, r.lru_hits), (0, 3))
        self.assertEqual(m.order.tolist(), list(range(8)))

    def test_hisparse_matches_kernel_transcription(self):
        rng = np.random.default_rng(0)
        compared = 0
        for case in range(40):
            H = int(rng.integers(6, 20))
            K = int(rng.integers(2, H + 1))
            init = "prefix" if case % 2 else "cold"
            n = int(rng.integers(H - 3, H + 10))
            model = HiSparseLRU(H, max_pos=n + 40, init=init)
            tokens = list(range(H)) if init == "prefix" else [-1] * H
            tokens += [-1]  # the newest-token slot
            lru = list(range(H))
            for _ in range(30):
                pool = min(n, H + 8)  # reuse-heavy picks near the front + newest
                row = rng.choice(pool, size=min(K, pool), replace=False)
                if rng.random() < 0.5 and n - 1 not in row:
                    row[-1] = n - 1
                if row.size < K or n <= K:
                    n += 1
                    continue
                expected = _hisparse_kernel_step(list(row), tokens, lru, n, H)
                r = model.step(row, n)
                self.assertEqual(r.misses, expected)
                if n > H:
                    self.assertEqual(model.order.tolist(), lru)
                    self.assertEqual(model.slot_pos.tolist(), tokens[:H])
                    compared += 1
                n += 1
        self.assertGreater(compared, 500)

    def test_warm_newest_below_the_window(self):
        # First step at n = 30, W = 4: positions below 26 warm, oldest first
        # (slot i holds the i-th of them, the newest most recent).
        m = OursLRU(lru_slots=8, window=4, max_pos=40, init="topk", top_k=5)
        r = m.step(np.array([25, 21, 20, 27]), 30)
        self.assertEqual((r.misses, r.lru_hits, r.window_hits), (1, 2, 1))
        self.assertEqual(m.slot_pos[:5].tolist(), [21, 22, 23, 24, 25])
        self.assertEqual(m.slot_pos[5].tolist(), 20)  # the miss: an empty slot
        m = OursLRU(lru_slots=8, window=4, max_pos=40, init="newest")
        m.step(np.array([29]), 30)
        self.assertEqual(sorted(m.slot_pos.tolist()), list(range(18, 26)))
        # A prompt shorter than the slots warms what it has.
        m = HiSparseLRU(lru_slots=8, max_pos=40, init="newest")
        m.step(np.array([3]), 6)
        self.assertEqual(m.slot_pos.tolist(), [0, 1, 2, 3, 4, -1, -1, -1])
        with self.assertRaises(ValueError):
            OursLRU(8, 4, 40, init="warm")

    def test_belady(self):
        # Non-newest picks {0,1},{2,3},{0,4},{1,2}; 3 flexible rows (budget 4):
        # step 1 keeps 0 (needed at step 2) over 1, step 2 keeps 2 over 3.
        t = _tiny_trace([[0, 1], [2, 3], [0, 4], [1, 2]], [10, 11, 12, 13], 2)
        self.assertEqual(replay.belady_misses(t, 4)[:, 0, 0].tolist(), [2, 2, 1, 1])
        self.assertEqual(replay.belady_misses(t, 3)[:, 0, 0].tolist(), [2, 2, 2, 2])
        # OPT is a lower bound of both policies.
        t = _random_trace(5, K=32)
        opt = replay.belady_misses(t, 48).sum()
        ours = replay.replay(t, lambda mp: OursLRU(40, 8, mp)).misses.sum()
        hs = replay.replay(t, lambda mp: HiSparseLRU(47, mp)).misses.sum()
        self.assertLessEqual(opt, min(ours, hs))
        # Also from the policies' warmed state (--init prefix): OPT starts
        # from it too, else a cold OPT can miss more than a warm LRU.
        opt = replay.belady_misses(t, 48, "prefix").sum()
        ours = replay.replay(t, lambda mp: OursLRU(40, 8, mp, "prefix")).misses.sum()
        hs = replay.replay(t, lambda mp: HiSparseLRU(47, mp, "prefix")).misses.sum()
        self.assertLessEqual(opt, min(ours, hs))
        # The newest positions warmed (every slot, or the top-k of them).
        for init in ("newest", "topk"):
            opt = replay.belady_misses(t, 48, init).sum()
            ours = replay.replay(t, lambda mp: OursLRU(40, 8, mp, init, top_k=32))
            hs = replay.replay(t, lambda mp: HiSparseLRU(47, mp, init, top_k=32))
            self.assertLessEqual(opt, min(ours.misses.sum(), hs.misses.sum()))
        # The prompt's first positions picked again: warm, nothing to miss.
        t = _tiny_trace([[0, 1, 2, 3], [0, 1, 2, 3]], [10, 11], 4)
        self.assertEqual(replay.belady_misses(t, 5, "prefix").sum(), 0)
        self.assertEqual(replay.belady_misses(t, 5).sum(), 4)


class TestReferenceEngine(unittest.TestCase):
    def setUp(self):
        path, note = replay.find_reference_engine()
        if path is None:
            self.skipTest(note)
        self.path = path

    def test_engine_matches_model(self):
        # The hand example, then a random multi-request trace.
        tiny = _tiny_trace(TINY_TOPK, TINY_SEQ_LENS, 3)
        res = replay.engine_check(tiny, 4, 1, engine_path=self.path)
        self.assertEqual(res["status"], "exact", res)
        self.assertEqual(res["engine_misses"], sum(TINY_OURS_MISSES))
        t = _random_trace(11, K=32, sorted_rows=False)
        for init in replay.INITS:
            res = replay.engine_check(t, 40, 6, init=init, engine_path=self.path)
            self.assertEqual(res["status"], "exact", (init, res))


class TestEnginePolicies(unittest.TestCase):
    """The engine's LRU (LRUCacheState, torch path) misses exactly what the
    policy study's model of its rule misses, swap for swap
    (policy_engine_replay.py); HiSparse's LRU does not (the control: the
    check can fail)."""

    def test_engine_matches_the_study_model(self):
        import policy_engine_replay
        import policy_study

        t = _random_trace(12, S=16, K=32, sorted_rows=False)
        for budget in (40, 48, 70):  # 34 to 64 slots: second revolutions
            with self.subTest(budget=budget):
                res = policy_engine_replay.compare_at(t, budget, 6, warmup=2)
                self.assertTrue(all(res["checks"].values()), res["checks"])
        slots = 34
        engine = policy_engine_replay.engine_misses(t, slots, 6)
        study = policy_study.replay_misses(
            t, policy_study.policy_factories(slots + 6, 6)["hisparse"][0]
        )
        self.assertFalse(bool((engine == study).all()))


class TestEmbeddedTrace(unittest.TestCase):
    def test_replay_embedded_trace(self):
        self.assertLess(EMBEDDED_TRACE.stat().st_size, 2 * 1024 * 1024)
        t = load_trace(str(EMBEDDED_TRACE))
        self.assertEqual(t.metadata["source"], "synthetic")
        self.assertIn("trace_gen.py", t.metadata["command"])
        self.assertEqual(t.top_k, 2048)
        args = replay.parse_args(
            ["--trace", str(EMBEDDED_TRACE), "--budgets", "4160", "--windows", "64"]
        )
        res = replay.run(args)
        (row,) = res["p6"]
        self.assertEqual(row["budget"], 4160)
        self.assertGreater(row["hisparse_misses_per_row"], 0)
        self.assertLessEqual(row["opt_misses_per_row"], row["ours_misses_per_row"])
        self.assertIn("P6", res["markdown"])
        if res["engine_check"]["status"] != "unavailable":
            self.assertEqual(res["engine_check"]["status"], "exact")


class TestPrefetchStudy(unittest.TestCase):
    def _shared_across_layers(self, layer_ids):
        base = _random_trace(7, S=14, L=1, B=2, K=32, max_len=300)
        L = len(layer_ids)
        topk = np.repeat(base.topk, L, axis=1)
        return NSATopkTrace(topk, base.seq_lens, layer_ids, base.request_ids)

    def test_neighbouring_layers_share_everything(self):
        # The same top-k in 3 consecutive layers: after the prefetch only the
        # first layer misses on demand; the others' misses became prefetches.
        r = prefetch_study.study(self._shared_across_layers([5, 6, 7]), 48, 8, 2)
        p = r["per_row"]
        self.assertGreater(p["ours"], 0)
        self.assertAlmostEqual(p["demand"], p["ours"] / 3)
        self.assertAlmostEqual(p["prefetch"], 2 * p["ours"] / 3)
        self.assertEqual(r["consecutive_layer_pairs"], 2)

    def test_no_neighbours_no_prefetch(self):
        r = prefetch_study.study(self._shared_across_layers([0, 20, 40]), 48, 8, 2)
        p = r["per_row"]
        self.assertEqual(p["prefetch"], 0)
        self.assertEqual(p["demand"], p["ours"])
        self.assertEqual(r["consecutive_layer_pairs"], 0)

    def test_served_to_a_smaller_model(self):
        # Layers 0, 20, 40 of a 61-layer trace (plus 30, unused) served to a
        # 3-layer model become its consecutive layers 0, 1, 2: the prefetch
        # then applies, as in the live server.
        base = _random_trace(8, S=10, L=4, B=2, K=32, max_len=300)
        trace = NSATopkTrace(
            base.topk,
            base.seq_lens,
            [0, 20, 31, 60],
            base.request_ids,
            {"num_model_layers": 61},
        )
        served = prefetch_study.as_served(trace, 3)
        self.assertEqual(served.layer_ids.tolist(), [0, 1, 2])
        self.assertEqual(served.metadata["num_model_layers"], 3)
        # model layer 1 -> target 30 -> nearest trace layer 31
        for i, src in enumerate([0, 2, 3]):
            np.testing.assert_array_equal(served.topk[:, i], trace.topk[:, src])
        r = prefetch_study.study(served, 48, 8, 2)
        self.assertEqual(r["consecutive_layer_pairs"], 2)
        self.assertGreater(r["per_row"]["prefetch"], 0)


if __name__ == "__main__":
    unittest.main()
