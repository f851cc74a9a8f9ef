"""The verify mode (``--nsa-kv-offload-verify``) through the real pools and
coordinator: the full KV pool it keeps beside the offload is written with the
offload's rows, a clean run counts rows and no mismatch, and one KV row
overwritten on purpose is counted (mode "count") or stops the server at the
next check (mode "fail") with the layer, position and GPU row it was read at.
"""

import unittest
from types import SimpleNamespace

import torch
from offload_harness import (  # noqa: F401
    DEVICE,
    OffloadHarness,
    setUpModule,
    tearDownModule,
)
from sglang.srt.mem_cache.nsa_kv_offload_verify import NSAKVOffloadVerifier


def _plant_wrong_row(h, req, layer):
    """Overwrite the GPU row of an LRU slot of ``req`` in ``layer`` (not a
    window row) that the next swap is sure to read: returns (position, row)."""
    lru, r = h.co.lru, req.req_pool_idx
    n = req.seq_len
    for pos in range(n - h.W - 1, -1, -1):
        loc = int(h.req_to_token[r, pos])
        slot = int(lru.loc_to_slot[layer, loc])
        if slot < 0:
            continue
        unit, offset = divmod(slot, h.C)
        row = int(lru.unit_base[r, unit]) + offset
        rows = h.pool.kv_buffer[layer].view(torch.uint8).view(-1, h.row_bytes)
        rows[row] ^= 0x5A  # every byte differs
        return pos, row
    raise AssertionError("no resident LRU slot to corrupt")


def _run_with_planted_row(test, mode):
    h = OffloadHarness(test, verify=mode, max_units=2, seed=3)
    a = h.new_req()
    h.prefill([(a, 200)])
    for step in range(2):
        h.decode_step([a], first_step_of=(a,) if step == 0 else ())
    clean = h.co.verifier.read()
    test.assertGreater(clean["verify_checked_rows"], 0)
    test.assertEqual(clean["verify_mismatches"], 0)
    pos, row = _plant_wrong_row(h, a, layer=1)
    # The harness's own page-table check would catch the row first; the
    # planted step is the verifier's alone.
    h.check_page_table = lambda *args: None
    real_pick = h.pick_topk

    def pick_with(n, first_step=False):
        topk = real_pick(n, first_step)
        if pos not in topk.tolist():
            topk[(topk < 0).nonzero()[0]] = pos
        return topk

    h.pick_topk = pick_with
    h.decode_step([a])
    return h, a, pos, row


class TestVerifyMode(unittest.TestCase):
    def test_clean_run_counts_rows_and_no_mismatch(self):
        h = OffloadHarness(self, verify="fail", max_units=2)
        a, b = h.new_req(), h.new_req()
        h.prefill([(a, 200), (b, 150)])
        h.decode_step([a, b], first_step_of=(a, b))
        for step in range(3):
            h.decode_step([a, b], pad_rows=step % 2)
        # The full pool holds what the offload wrote, loc by loc.
        for layer in range(h.L):
            truth = h.pool.verify_kv_buffer[layer].view(torch.uint8)
            truth = truth.view(-1, h.row_bytes)
            for req in (a, b):
                locs = h.req_to_token[req.req_pool_idx, : req.seq_len].long()
                self.assertTrue(torch.equal(truth[locs], h.ref[layer, locs]))
        stats = h.co.get_stats()
        self.assertGreater(stats["verify_checked_rows"], 0)
        self.assertEqual(stats["verify_mismatches_total"], 0)
        self.assertIn(
            f"verify: {stats['verify_checked_total']} rows checked, 0 mismatches",
            h.co.get_decode_log_msg(),
        )
        h.finish(a)
        h.finish(b)
        h.check_no_leaks()

    def test_planted_row_is_counted_then_fails(self):
        h, a, pos, row = _run_with_planted_row(self, "count")
        totals = h.co.verifier.read()  # mode "count": no raise
        self.assertEqual(totals["verify_mismatches"], 1)
        first = h.co.verifier.first_mismatch()
        self.assertEqual(
            (first["layer"], first["position"], first["gpu_row"]), (1, pos, row)
        )
        self.assertEqual(first["loc"], int(h.req_to_token[a.req_pool_idx, pos]))
        h.co.check_idle()  # counts only
        # Mode "fail" stops at the next check, naming the first mismatch.
        h.co.verifier.mode = "fail"
        h.co.verifier.poll()  # between forwards: copies the counts, no sync
        with self.assertRaisesRegex(RuntimeError, f"'position': {pos}"):
            h.co.verifier.poll()  # sees the copy once it has landed
        with self.assertRaisesRegex(RuntimeError, f"'position': {pos}"):
            h.co.check_idle()

    def test_skipped_and_extra_entries_are_mismatches(self):
        h = OffloadHarness(self, verify="count")
        a = h.new_req()
        h.prefill([(a, 150)])
        h.decode_step([a], first_step_of=(a,))
        verifier = NSAKVOffloadVerifier(h.pool, h.req_to_token, "count")
        n = a.seq_len
        topk = torch.full((1, h.K), -1, dtype=torch.int32, device=DEVICE)
        topk[0, :3] = torch.tensor([n - 1, n - 2, n + 5])  # the last is beyond
        idx = torch.tensor([a.req_pool_idx], device=DEVICE)
        seq = torch.tensor([n], device=DEVICE)
        one = torch.ones(1, dtype=torch.int32, device=DEVICE)
        page_table = h.controller.swap_one_layer(0, topk, idx, seq, h.req_to_token, one)
        verifier.check(0, topk, page_table, idx, seq, one)
        self.assertEqual(
            verifier.read(), dict(verify_checked_rows=2, verify_mismatches=0)
        )
        wrong = page_table.clone()
        wrong[0, 0] = -1  # skips a position attention must read
        wrong[0, 2] = page_table[0, 1]  # reads a row for a position beyond
        verifier.check(0, topk, wrong, idx, seq, one)
        self.assertEqual(verifier.read()["verify_mismatches"], 2)

    def test_pd_decode_truth_from_host_slots(self):
        # PD decode: the prompt arrives in host slots; the full pool takes it
        # from there at admission.
        h = OffloadHarness(self, verify="fail", kv_arrives_in_host=True)
        a = h.new_req()
        h.transfer(a, 180)
        h.decode_step([a], first_step_of=(a,))
        for _ in range(2):
            h.decode_step([a])
        totals = h.co.verifier.read()
        self.assertGreater(totals["verify_checked_rows"], 0)
        self.assertEqual(totals["verify_mismatches"], 0)
        h.finish(a)
        h.check_no_leaks()

    def test_check_never_syncs(self):
        # It runs inside CUDA-graph capture, where a host sync fails; on the
        # meta device every host read of a tensor value raises.
        meta = torch.device("meta")
        buf = torch.empty((2, 128, 1, 16), dtype=torch.bfloat16, device=meta)
        pool = SimpleNamespace(
            kv_buffer=[buf[0]],
            verify_kv_buffer=[buf[1]],
            start_layer=0,
            device=meta,
            kv_row_bytes=32,
        )
        req_to_token = torch.empty((4, 64), dtype=torch.int32, device=meta)
        verifier = NSAKVOffloadVerifier(pool, req_to_token, "fail")
        topk = torch.empty((3, 16), dtype=torch.int32, device=meta)
        idx = torch.empty((3,), dtype=torch.int64, device=meta)
        one = torch.empty((1,), dtype=torch.int32, device=meta)
        verifier.check(0, topk, topk, idx, idx, one)
        verifier.check(0, topk, topk, idx, idx, one, num_query_tokens=3)
        with self.assertRaises(Exception):  # the control: a read does sync
            int(verifier.counts[0])

    @unittest.skipUnless(DEVICE == "cuda", "CUDA-graph capture needs CUDA")
    def test_check_inside_a_cuda_graph(self):
        # What a decode forward does: check() captured once, replayed per step.
        h = OffloadHarness(self, verify="count")
        a = h.new_req()
        h.prefill([(a, 150)])
        h.decode_step([a], first_step_of=(a,))
        v, n = h.co.verifier, a.seq_len
        topk = torch.full((1, h.K), -1, dtype=torch.int32, device=DEVICE)
        topk[0, :16] = torch.arange(n - 16, n, device=DEVICE)
        idx = torch.tensor([a.req_pool_idx], device=DEVICE)
        seq = torch.tensor([n], device=DEVICE)
        one = torch.ones(1, dtype=torch.int32, device=DEVICE)
        page_table = h.controller.swap_one_layer(0, topk, idx, seq, h.req_to_token, one)
        before = v.read()["verify_checked_rows"]
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            v.check(0, topk, page_table, idx, seq, one)  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            v.check(0, topk, page_table, idx, seq, one)
        graph.replay()
        graph.replay()
        totals = v.read()
        self.assertEqual(totals["verify_checked_rows"], before + 3 * 16)
        self.assertEqual(totals["verify_mismatches"], 0)

    def test_needs_a_verify_pool(self):
        h = OffloadHarness(self)
        self.assertIsNone(h.co.verifier)
        with self.assertRaisesRegex(ValueError, "verify=True"):
            NSAKVOffloadVerifier(h.pool, h.req_to_token, "fail")


if __name__ == "__main__":
    unittest.main()
