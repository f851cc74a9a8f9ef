"""Benchmark-only NSA decode top-k trace override and recorder (CPU).

Covers ``benchmark/nsa_offload/traces/nsa_topk_trace.py`` (loaded by path)
and its entry point ``nsa_topk_trace.apply_decode_topk_hooks``:

* override: valid rows (unique positions < seq_len, ``-1`` only as padding,
  rows with seq_len <= K untouched) for random batches, int32/int64 inputs,
  deterministic, the Triton kernel (interpreter) equal to the torch path;
  exact reproduction of the trace when the live lengths equal the trace's;
  stepping through the trace as decode proceeds; the trace's step-to-step
  reuse preserved when the live request is longer than the trace's;
  the layer map;
* recorder: a few steps (with ring wrap-around and CUDA-graph padding rows)
  round-trip through ``trace_format``'s writer and reader, through the torch
  and the Triton path, and the ``<path>.flush`` trigger;
* negative control: the first entry of the chosen layer's rows is replaced
  exactly while armed and where ``seq_len % M == R`` (padding rows and
  ``-1`` entries never), other layers untouched, the hit count published;
* all off when their environment variables are unset: the hook returns the
  very same tensor object.
"""

import importlib.util
import os
import sys
import tempfile
import time
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
NSA_TOPK_TRACE_PY = (
    REPO_ROOT / "benchmark" / "nsa_offload" / "traces" / "nsa_topk_trace.py"
)


def _load_nsa_topk_trace():
    # Benchmark tooling: not installed into the venv's sglang (apply_patch.py
    # installs it only with --with-bench-hooks), so it is loaded by path.
    spec = importlib.util.spec_from_file_location("nsa_topk_trace", NSA_TOPK_TRACE_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules["nsa_topk_trace"] = module
    spec.loader.exec_module(module)
    return module


nsa_topk_trace = _load_nsa_topk_trace()
TRACE_FORMAT_PY = REPO_ROOT / "benchmark" / "nsa_offload" / "traces" / "trace_format.py"
os.environ.setdefault(nsa_topk_trace.ENV_FORMAT, str(TRACE_FORMAT_PY))
tf = nsa_topk_trace.import_trace_format()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K = 64
SINKS = 4
RECENT = 32
ALL_ENV = [
    v
    for k, v in vars(nsa_topk_trace).items()
    if k.startswith("ENV_") and k != "ENV_FORMAT"
]

# Trace: layers 0, 20, 40 of a 41-layer model; columns with first decode
# lengths 301, 301, 501 (6 steps each) and a short one (41 < K, padded rows).
TRACE_LAYERS = [0, 20, 40]
PROMPTS = [300, 300, 500, 40]
STEPS = 6


def make_trace(seed=0, order="mixed"):
    rng = np.random.default_rng(seed)
    S, L, B = STEPS, len(TRACE_LAYERS), len(PROMPTS)
    topk = np.full((S, L, B, K), -1, dtype=np.int32)
    seq_lens = np.zeros((S, B), dtype=np.int32)
    for b, prompt in enumerate(PROMPTS):
        for s in range(S):
            n = prompt + 1 + s
            seq_lens[s, b] = n
            for li in range(L):
                m = min(n, K)
                # sinks + newest + random middle, like the indexer's picks
                must = np.unique(np.r_[0:2, n - 3 : n].clip(0, n - 1))
                rest = np.setdiff1d(np.arange(n), must)
                pick = np.r_[must, rng.choice(rest, m - must.size, replace=False)]
                if order == "ascending" or (order == "mixed" and b % 2 == 0):
                    pick = np.sort(pick)
                else:
                    pick = rng.permutation(pick)
                topk[s, li, b, :m] = pick
    meta = {"source": "synthetic", "topk_order": "indexer", "num_model_layers": 41}
    return tf.NSATopkTrace(topk, seq_lens, TRACE_LAYERS, ["a", "b", "c", "d"], meta)


def make_override(trace=None, impl="torch", num_model_layers=3, **kw):
    ov = nsa_topk_trace.TopkTraceOverride(
        trace if trace is not None else make_trace(),
        sinks=SINKS,
        recent=RECENT,
        impl=impl,
        **kw,
    )
    ov.prepare(DEVICE, K, list(range(num_model_layers)), num_model_layers)
    return ov


def indexer_rows(seq_lens, gen, dtype=torch.int32):
    """What the positional indexer returns: all positions when n <= K
    (shuffled, -1 padded), else K distinct positions."""
    out = torch.full((len(seq_lens), K), -1, dtype=dtype)
    for b, n in enumerate(seq_lens.tolist()):
        m = min(n, K)
        out[b, :m] = torch.randperm(n, generator=gen)[:m].to(dtype)
    return out


def check_valid(test, out, inp, seq_lens):
    test.assertEqual(out.dtype, inp.dtype)
    test.assertEqual(tuple(out.shape), tuple(inp.shape))
    for b, n in enumerate(seq_lens.tolist()):
        row = out[b].cpu()
        if n <= K:
            test.assertTrue(torch.equal(row, inp[b].cpu()), f"row {b} changed")
            continue
        valid = row[row >= 0]
        test.assertTrue(bool((row >= -1).all()))
        test.assertTrue(bool((valid < n).all()), f"row {b}: >= seq_len {n}")
        test.assertEqual(valid.unique().numel(), valid.numel(), f"row {b}: repeat")
        test.assertGreater(valid.numel(), 0)


def fake_forward_batch(seq_lens, req_pool_indices, layer_num=3):
    # What sglang's model runner passes: the model's exclusive end layer.
    pool = SimpleNamespace(layer_num=layer_num, start_layer=0, end_layer=layer_num)
    return SimpleNamespace(
        seq_lens=seq_lens.to(DEVICE),
        req_pool_indices=req_pool_indices.to(DEVICE),
        token_to_kv_pool=pool,
    )


class TestOverride(unittest.TestCase):
    def test_random_batches_valid_and_deterministic(self):
        gen = torch.Generator().manual_seed(1)
        ov_t = make_override(impl="torch")
        ov_k = make_override(impl="triton")
        self.assertTrue(ov_k._use_triton)  # passed its self-check: no fallback
        for trial in range(4):
            bs = 9
            n = torch.randint(1, 900, (bs,), generator=gen)
            n[0], n[1], n[2] = 1, K, K + 1  # padding row, edge lengths
            n[3], n[4] = 301, 45  # a trace length, shorter than every trace row
            r = torch.randint(0, 40, (bs,), generator=gen)
            len_dtype = torch.int32 if trial % 2 else torch.int64
            top_dtype = torch.int64 if trial % 2 else torch.int32
            x = indexer_rows(n, gen, top_dtype).to(DEVICE)
            args = (n.to(DEVICE, len_dtype), r.to(DEVICE, len_dtype))
            for layer in range(3):
                out = ov_t.apply(layer, x, *args)
                check_valid(self, out, x, n)
                again = ov_t.apply(layer, x.clone(), *args)
                self.assertTrue(torch.equal(out, again))
                self.assertTrue(torch.equal(ov_k.apply(layer, x, *args), out))

    def test_reproduces_trace_at_its_lengths(self):
        trace = make_trace()
        for impl in ("torch", "triton"):
            ov = make_override(trace, impl=impl)
            # req 0 / 1 -> the two columns of first length 301; req 2 -> 501
            for b, r in ((0, 0), (1, 1), (2, 0)):
                for s in range(STEPS):
                    n = int(trace.seq_lens[s, b])
                    x = torch.zeros((1, K), dtype=torch.int32, device=DEVICE)
                    lens = torch.tensor([n], device=DEVICE)
                    req = torch.tensor([r], device=DEVICE)
                    for layer, li in ((0, 0), (1, 1), (2, 2)):
                        out = ov.apply(layer, x, lens, req).cpu().numpy()[0]
                        np.testing.assert_array_equal(out, trace.topk[s, li, b])

    def test_advances_through_steps_and_wraps(self):
        trace = make_trace(order="ascending")
        ov = make_override(trace)
        outs = []
        for t in range(2 * STEPS):
            lens = torch.tensor([501 + t], device=DEVICE)
            x = torch.zeros((1, K), dtype=torch.int32, device=DEVICE)
            out = ov.apply(2, x, lens, torch.tensor([7], device=DEVICE))
            outs.append(out.cpu().numpy()[0])
        for t in range(STEPS):
            np.testing.assert_array_equal(outs[t], trace.topk[t, 2, 2])
            self.assertFalse(np.array_equal(outs[t], outs[(t + 1) % STEPS]))
        # After the wrap: trace step t mod S, recent tokens follow the newest
        # one, the rest stay absolute.
        for t in range(STEPS, 2 * STEPS):
            src = trace.topk[t - STEPS, 2, 2]
            m = int(trace.seq_lens[t - STEPS, 2])
            d = m - 1 - src
            expect = np.where((src >= SINKS) & (d < RECENT), src + STEPS, src)
            np.testing.assert_array_equal(outs[t], expect)

    def test_reuse_preserved_for_longer_requests(self):
        trace = make_trace(order="ascending")
        ov = make_override(trace)
        shift = 10 * STEPS  # live request 60 tokens longer than the trace's
        lives, srcs = [], []
        for s in range(STEPS):
            n = int(trace.seq_lens[s, 2]) + shift
            x = torch.zeros((1, K), dtype=torch.int64, device=DEVICE)
            out = ov.apply(
                0, x, torch.tensor([n], device=DEVICE), torch.tensor([0], device=DEVICE)
            )
            lives.append(set(out.cpu().numpy()[0].tolist()))
            srcs.append(set(trace.topk[s, 0, 2].tolist()))
        for s in range(STEPS - 1):
            # A trace token re-picked at the next step maps to the same live
            # token, except one crossing the recent-window boundary.
            live_reuse = len(lives[s] & lives[s + 1])
            trace_reuse = len(srcs[s] & srcs[s + 1])
            self.assertLessEqual(abs(live_reuse - trace_reuse), 2)

    def test_layer_map(self):
        m = nsa_topk_trace.map_model_layers([0, 1, 2], 3, [0, 20, 21, 40, 60], 61)
        self.assertEqual(m, {0: 0, 1: 2, 2: 4})  # targets 0, 30 (-> 21), 60
        m = nsa_topk_trace.map_model_layers([0, 1, 2], 3, [0, 20, 40, 60], 61)
        self.assertEqual(m, {0: 0, 1: 1, 2: 3})  # 30: tie 20 / 40 -> 20
        m = nsa_topk_trace.map_model_layers([0, 1, 2], 3, [0, 30, 60], 61)
        self.assertEqual(m, {0: 0, 1: 1, 2: 2})
        m = nsa_topk_trace.map_model_layers([0, 1, 2], 3, [0, 1, 2, 5], 3)
        self.assertEqual(m, {0: 0, 1: 1, 2: 2})  # same model: identity
        m = nsa_topk_trace.map_model_layers([0, 1], 2, [0, 30, 60], 61, [60, 0])
        self.assertEqual(m, {0: 2, 1: 0})
        with self.assertRaises(ValueError):
            nsa_topk_trace.map_model_layers([0, 1], 2, [0, 30], 61, [0, 31])


class HookEnvCase(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="nsa_topk_trace_")
        self.env = mock.patch.dict(os.environ, {}, clear=False)
        self.env.start()
        for name in ALL_ENV:
            os.environ.pop(name, None)
        nsa_topk_trace.reset_decode_topk_hooks()

    def tearDown(self):
        nsa_topk_trace.reset_decode_topk_hooks()
        self.env.stop()

    def save_trace(self, trace=None):
        path = os.path.join(self.tmp, "trace.npz")
        tf.save_trace(path, trace if trace is not None else make_trace())
        return path


class TestHook(HookEnvCase):
    def test_noop_when_unset(self):
        x = torch.randint(0, 100, (3, K), dtype=torch.int32, device=DEVICE)
        fb = fake_forward_batch(torch.tensor([500, 600, 700]), torch.arange(3))
        for layer in range(3):
            self.assertIs(nsa_topk_trace.apply_decode_topk_hooks(fb, layer, x), x)
        self.assertFalse(nsa_topk_trace.get_decode_topk_hooks().active)

    def test_override_via_env(self):
        os.environ[nsa_topk_trace.ENV_OVERRIDE] = self.save_trace()
        os.environ[nsa_topk_trace.ENV_SINKS] = str(SINKS)
        os.environ[nsa_topk_trace.ENV_RECENT] = str(RECENT)
        os.environ[nsa_topk_trace.ENV_IMPL] = "torch"
        gen = torch.Generator().manual_seed(3)
        n = torch.tensor([1, 40, 301, 777, 1500])
        r = torch.tensor([3, 0, 1, 2, 9])
        x = indexer_rows(n, gen).to(DEVICE)
        fb = fake_forward_batch(n, r)
        ref = make_override()
        for layer in range(3):
            out = nsa_topk_trace.apply_decode_topk_hooks(fb, layer, x)
            self.assertIsNot(out, x)
            check_valid(self, out, x, n)
            expect = ref.apply(layer, x, fb.seq_lens, fb.req_pool_indices)
            self.assertTrue(torch.equal(out, expect))


class TestRecorder(HookEnvCase):
    def _run_steps(self, impl, num_steps=6, max_steps=4):
        path = os.path.join(self.tmp, f"rec_{impl}.npz")
        os.environ[nsa_topk_trace.ENV_RECORD] = path
        os.environ[nsa_topk_trace.ENV_RECORD_MAX_STEPS] = str(max_steps)
        os.environ[nsa_topk_trace.ENV_RECORD_MAX_ROWS] = "2"
        os.environ[nsa_topk_trace.ENV_RECORD_FLUSH_IDLE_S] = "0"
        os.environ[nsa_topk_trace.ENV_IMPL] = impl
        gen = torch.Generator().manual_seed(5)
        fed = []
        for t in range(num_steps):
            # rows: request slot 4 (growing), request slot 2 (growing), padding
            n = torch.tensor([200 + t, 90 + t, 1])
            r = torch.tensor([4, 2, 0], dtype=torch.int32)
            fb = fake_forward_batch(n, r)
            layers = []
            for layer in range(3):
                x = indexer_rows(n, gen).to(DEVICE)
                out = nsa_topk_trace.apply_decode_topk_hooks(fb, layer, x)
                self.assertIs(out, x)  # recording does not change the top-k
                layers.append(x.cpu().numpy())
            fed.append((n.numpy(), layers))
        rec = nsa_topk_trace.get_decode_topk_hooks().recorder
        self.assertIsNotNone(rec)  # not disabled by an error
        self.assertEqual(rec._use_triton, impl == "triton")
        self.assertEqual(rec.flush(), path)
        return path, fed

    def _check_round_trip(self, impl):
        path, fed = self._run_steps(impl)
        trace = tf.load_trace(path)
        self.assertEqual(trace.num_steps, 4)  # ring of the latest 4 steps
        self.assertEqual(trace.layer_ids.tolist(), [0, 1, 2])
        self.assertEqual(trace.request_ids, ["slot4_len202", "slot2_len92"])
        self.assertEqual(trace.metadata["source"], "recorded")
        self.assertEqual(trace.metadata["recorder"]["stage"], "output")
        for s in range(4):
            n, layers = fed[2 + s]
            np.testing.assert_array_equal(trace.seq_lens[s], n[:2])
            for li in range(3):
                np.testing.assert_array_equal(trace.topk[s, li], layers[li][:2])

    def test_round_trip_torch(self):
        self._check_round_trip("torch")

    def test_round_trip_triton(self):
        self._check_round_trip("triton")

    def test_warns_when_the_last_layer_never_runs(self):
        rec = nsa_topk_trace.TopkTraceRecorder(
            os.path.join(self.tmp, "never.npz"),
            max_steps=4,
            max_rows=2,
            layer_ids=[0, 1, 2, 3],
            impl="torch",
            start_thread=False,
        )
        rec.setup(DEVICE, K, [0, 1, 2, 3], 4)
        gen = torch.Generator().manual_seed(3)
        n, r = torch.tensor([300, 200]), torch.tensor([1, 2])
        for layer in range(3):  # layer 3 never runs
            rec.record(layer, indexer_rows(n, gen).to(DEVICE), n, r)
        with self.assertLogs(nsa_topk_trace.logger, "WARNING") as logs:
            self.assertIsNone(rec.flush())
        self.assertIn("layer 3", logs.output[0])
        self.assertFalse(os.path.exists(rec.path))

    def test_flush_trigger_file(self):
        path, _ = self._run_steps("torch", num_steps=2, max_steps=8)
        os.remove(path)
        trigger = path + nsa_topk_trace.FLUSH_TRIGGER_SUFFIX
        open(trigger, "w").close()
        deadline = time.monotonic() + 10
        while os.path.exists(trigger) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(os.path.exists(trigger))
        self.assertEqual(tf.load_trace(path).num_steps, 2)

    def test_model_layers_from_pool(self):
        # sglang's pools get the model's exclusive end layer; an MTP layer of
        # the checkpoint is not a layer of the target model's pool.
        fb = fake_forward_batch(torch.tensor([5]), torch.tensor([0]), layer_num=3)
        self.assertEqual(nsa_topk_trace._model_layers(fb), ([0, 1, 2], 3))
        fb.token_to_kv_pool = SimpleNamespace(layer_num=3, start_layer=2, end_layer=5)
        self.assertEqual(nsa_topk_trace._model_layers(fb), ([2, 3, 4], 5))

    def test_model_layers_from_forward_context(self):
        # sglang 0.5.17's batch has no pool: its forward context's backend has.
        pool = SimpleNamespace(layer_num=3, start_layer=1, end_layer=4)
        context = SimpleNamespace(
            get_attn_backend=lambda: SimpleNamespace(token_to_kv_pool=pool)
        )
        name = "sglang.srt.model_executor.forward_context"
        with mock.patch.dict(sys.modules, {name: context}):
            fb = SimpleNamespace(seq_lens=torch.tensor([5]))
            self.assertEqual(nsa_topk_trace._model_layers(fb), ([1, 2, 3], 4))

    def test_override_and_record_output(self):
        os.environ[nsa_topk_trace.ENV_OVERRIDE] = self.save_trace()
        os.environ[nsa_topk_trace.ENV_SINKS] = str(SINKS)
        os.environ[nsa_topk_trace.ENV_RECENT] = str(RECENT)
        path = os.path.join(self.tmp, "rec.npz")
        os.environ[nsa_topk_trace.ENV_RECORD] = path
        os.environ[nsa_topk_trace.ENV_RECORD_FLUSH_IDLE_S] = "0"
        os.environ[nsa_topk_trace.ENV_IMPL] = "torch"
        gen = torch.Generator().manual_seed(7)
        outs = []
        for t in range(3):
            n = torch.tensor([501 + t, 301 + t])
            fb = fake_forward_batch(n, torch.tensor([0, 1]))
            for layer in range(3):
                x = indexer_rows(n, gen).to(DEVICE)
                out = nsa_topk_trace.apply_decode_topk_hooks(fb, layer, x)
                outs.append(out.cpu().numpy())
        nsa_topk_trace.get_decode_topk_hooks().recorder.flush()
        trace = tf.load_trace(path)  # validates: unique, < seq_len
        self.assertEqual(trace.num_steps, 3)
        for t in range(3):
            for li in range(3):
                np.testing.assert_array_equal(trace.topk[t, li], outs[3 * t + li])


class TestNegativeControl(HookEnvCase):
    def arm(self, text):
        path = os.path.join(self.tmp, "arm")
        if text is None:
            if os.path.exists(path):
                os.remove(path)
        else:
            with open(path, "w") as f:
                f.write(text)
        return path

    def hooks(self, layer=1):
        os.environ[nsa_topk_trace.ENV_CORRUPT] = self.arm(None)
        os.environ[nsa_topk_trace.ENV_CORRUPT_LAYER] = str(layer)
        hooks = nsa_topk_trace.get_decode_topk_hooks()
        self.assertTrue(hooks.active)
        hooks.corruption.poll_s = 0  # the test polls by hand
        x = torch.zeros((1, K), dtype=torch.int32, device=DEVICE)
        fb = fake_forward_batch(torch.tensor([64]), torch.arange(1))
        nsa_topk_trace.apply_decode_topk_hooks(fb, layer, x)  # sets up
        return hooks

    def test_replaces_first_entry_only_when_armed(self):
        hooks = self.hooks(layer=1)
        gen = torch.Generator().manual_seed(5)
        n = torch.tensor([1, 64, 128, 130, 4096, 200])
        x = indexer_rows(n, gen).to(DEVICE)
        x[5, 0] = -1  # an invalid first entry stays as it is
        fb = fake_forward_batch(n, torch.arange(len(n)))
        out = nsa_topk_trace.apply_decode_topk_hooks(fb, 1, x)
        self.assertTrue(torch.equal(out, x))  # not armed yet
        self.arm("64 0")
        hooks.corruption.poll()
        for layer in (0, 2):
            self.assertTrue(
                torch.equal(nsa_topk_trace.apply_decode_topk_hooks(fb, layer, x), x)
            )
        out = nsa_topk_trace.apply_decode_topk_hooks(fb, 1, x)
        hit = torch.tensor([False, True, True, False, True, False])
        self.assertTrue(torch.equal(out[:, 1:], x[:, 1:]))
        self.assertTrue(torch.equal(out[~hit, 0], x[~hit, 0]))
        expect = (x[hit, 0].cpu() + n[hit] // 2) % n[hit]
        self.assertTrue(torch.equal(out[hit, 0].cpu(), expect.to(out.dtype)))
        self.assertTrue(bool((out[hit, 0] != x[hit, 0]).all()))
        self.assertTrue(bool((out[hit, 0].cpu() < n[hit]).all()))
        hooks.corruption.poll()
        with open(hooks.corruption.path + ".hits") as f:
            self.assertEqual(int(f.read()), 3)
        self.arm("64 2")  # residue 2: row 3 (130) only
        hooks.corruption.poll()
        out = nsa_topk_trace.apply_decode_topk_hooks(fb, 1, x)
        self.assertEqual(int((out != x).sum()), 1)
        self.assertNotEqual(int(out[3, 0]), int(x[3, 0]))
        self.arm(None)
        hooks.corruption.poll()
        out = nsa_topk_trace.apply_decode_topk_hooks(fb, 1, x)
        self.assertTrue(torch.equal(out, x))
        hooks.corruption.poll()
        with open(hooks.corruption.path + ".hits") as f:
            self.assertEqual(int(f.read()), 4)

    def test_one_step_in_every_64(self):
        hooks = self.hooks(layer=0)
        self.arm("64 0")
        hooks.corruption.poll()
        gen = torch.Generator().manual_seed(9)
        changed = []
        for t in range(64):
            n = torch.tensor([3000 + t, 77 + t])
            x = indexer_rows(n, gen).to(DEVICE)
            fb = fake_forward_batch(n, torch.arange(2))
            out = nsa_topk_trace.apply_decode_topk_hooks(fb, 0, x)
            changed.append((out != x).any(dim=1).cpu())
        self.assertEqual(torch.stack(changed).sum(dim=0).tolist(), [1, 1])

    def test_verify_rows_by_query_position(self):
        # MTP target verify: q = 3 rows per request; row j of a request with
        # committed length n is the query at position n + j (n + j + 1 rows).
        hooks = self.hooks(layer=1)
        self.arm("64 0")
        hooks.corruption.poll()
        gen = torch.Generator().manual_seed(11)
        n = torch.tensor([62, 127, 300])
        q = 3
        row_lens = (n[:, None] + torch.arange(q)[None, :] + 1).reshape(-1)
        x = indexer_rows(row_lens, gen).to(DEVICE)

        def verify_batch(mode):
            fb = fake_forward_batch(n, torch.arange(len(n)))
            fb.batch_size = len(n)
            fb.forward_mode = SimpleNamespace(is_target_verify=lambda: mode == "verify")
            return fb

        # Prefill and draft extends pass through, armed or not.
        out = nsa_topk_trace.apply_verify_topk_hooks(verify_batch("extend"), 1, x)
        self.assertTrue(torch.equal(out, x))
        out = nsa_topk_trace.apply_verify_topk_hooks(verify_batch("verify"), 1, x)
        # 62 + 1 + 1 = 64 (request 0, query 1) and 127 + 0 + 1 = 128 (request 1,
        # query 0): the rows whose length is a multiple of 64.
        hit = torch.zeros(len(row_lens), dtype=torch.bool)
        hit[[1, 3]] = True
        self.assertTrue(torch.equal(out[~hit], x[~hit]))
        expect = (x[hit, 0].cpu() + row_lens[hit] // 2) % row_lens[hit]
        self.assertTrue(torch.equal(out[hit, 0].cpu(), expect.to(out.dtype)))
        self.assertTrue(torch.equal(out[hit, 1:], x[hit, 1:]))
        # Another layer: untouched.
        out = nsa_topk_trace.apply_verify_topk_hooks(verify_batch("verify"), 0, x)
        self.assertTrue(torch.equal(out, x))


class TestVerifyOverride(unittest.TestCase):
    def test_query_rows_are_the_decode_rows_at_their_lengths(self):
        # Query j of a request with committed length n gets the override's
        # row of the decode step at length n + j + 1 (the same request).
        hooks = nsa_topk_trace.DecodeTopkHooks(make_override(), None)
        gen = torch.Generator().manual_seed(4)
        n = torch.tensor([900, 3000, 5000])
        req = torch.tensor([2, 0, 5])
        q = 4
        row_lens = (n[:, None] + torch.arange(q)[None, :] + 1).reshape(-1)
        x = indexer_rows(row_lens, gen).to(DEVICE)
        fb = fake_forward_batch(n, req)
        fb.batch_size = len(n)
        fb.forward_mode = SimpleNamespace(is_target_verify=lambda: True)
        out = nsa_topk_trace.DecodeTopkHooks.verify(hooks, fb, 1, x).cpu()
        self.assertFalse(torch.equal(out, x.cpu()))  # the override acted
        for j in range(q):
            rows = torch.arange(len(n)) * q + j
            decode = hooks(fake_forward_batch(n + j + 1, req), 1, x[rows])
            self.assertTrue(torch.equal(out[rows], decode.cpu()), f"query {j}")


if __name__ == "__main__":
    unittest.main()
