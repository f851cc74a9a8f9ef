"""MTP verify steps through ``SparseCacheController`` with real KV bytes
(docs/MTP.md): every row a page table names holds the KV of the token the
query token picked, a committed token's or this step's draft's, never a
rejected draft's; the host pool holds every committed token.
"""

import random
import unittest
from unittest import mock

import torch
from mtp_verify_sim import DEVICE, TRITON_OK, TRITON_SKIP
from sglang.srt.mem_cache import sparse_cache_controller as controller_module
from sglang.srt.mem_cache.nsa_kv_only_host_pool import NSAKVOnlyTokenToKVPoolHost
from sglang.srt.mem_cache.sparse_cache_controller import SparseCacheController

ROW_BYTES = 656


class TestVerifyExactness(unittest.TestCase):
    """MTP verify steps through ``SparseCacheController`` with real KV bytes.

    Each step writes every request's ``q`` drafts (new token ids, so new
    bytes) into their window rows, swaps every layer with ``q`` query tokens,
    writes the drafts back to their host slots (all of them, as the forward
    does before acceptance is known) and accepts 1..q. Rejected drafts' locs
    carry the next step's drafts (same positions) or go back to the free list,
    where new prompts take them. After every swap each page-table entry must
    name a row holding the KV of the token at that position *now*: a
    committed token's, or this step's draft's, never a rejected draft's.
    """

    L, K, Q, C, W = 2, 6, 3, 20, 5
    MAX_REQS, NUM_REGIONS, STAGING = 5, 3, 256
    HOST_SIZE, PAGE, MAX_CTX = 1024, 16, 200

    def _run(self, use_triton, seed, steps=20):
        rng = random.Random(seed)
        L, K, Q, C, W = self.L, self.K, self.Q, self.C, self.W
        R = C + W
        gpu = [
            torch.zeros(
                (self.STAGING + self.NUM_REGIONS * R, ROW_BYTES), dtype=torch.uint8
            )
            for _ in range(L)
        ]
        gpu = [g.to(DEVICE) for g in gpu]
        host = NSAKVOnlyTokenToKVPoolHost(
            size=self.HOST_SIZE, page_size=self.PAGE, layer_num=L, row_bytes=ROW_BYTES
        )
        ctrl = SparseCacheController(
            gpu,
            host,
            max_num_reqs=self.MAX_REQS,
            top_k=K,
            buffer_size=C,
            recent_window=W,
            region_start_row=self.STAGING,
            num_regions=self.NUM_REGIONS,
            max_batch_size=4,
            use_triton=use_triton,
            max_query_tokens=Q,
        )
        # The KV of token id t in layer l (every draft is a new id).
        kv = torch.randint(0, 256, (L, 4096, ROW_BYTES), dtype=torch.uint8)
        kv_dev = kv.to(DEVICE)
        next_id = [0]

        def new_ids(n):
            ids = list(range(next_id[0], next_id[0] + n))
            next_id[0] += n
            return ids

        req_to_token = torch.zeros((self.MAX_REQS, self.MAX_CTX), dtype=torch.int32)
        free_locs = list(range(self.PAGE, self.HOST_SIZE))
        rng.shuffle(free_locs)
        free_reqs = list(range(self.MAX_REQS))
        live = {}  # r -> {"ids": committed ids, "kept": locs for the next drafts}
        checked = {"committed": 0, "draft": 0, "rejected": 0}

        def admit():
            r = free_reqs.pop(rng.randrange(len(free_reqs)))
            n = rng.randint(1, 60)
            locs = [free_locs.pop() for _ in range(n)]
            ids = new_ids(n)
            req_to_token[r, :n] = torch.tensor(locs, dtype=torch.int32)
            staging = torch.randperm(self.STAGING)[:n].to(DEVICE)
            loc_t = torch.tensor(locs, dtype=torch.int64, device=DEVICE)
            for layer in range(L):
                gpu[layer][staging] = kv_dev[layer][torch.tensor(ids)]
            ctrl.backup_prefilled_request(staging, loc_t)
            self.assertIsNotNone(ctrl.admit_request(r, prefix_locs=loc_t))
            live[r] = {"ids": ids, "kept": []}

        def release(r):
            ctrl.release_request(r)
            req = live.pop(r)
            free_locs.extend(req_to_token[r, : len(req["ids"])].tolist() + req["kept"])
            free_reqs.append(r)

        for _ in range(self.NUM_REGIONS):
            admit()
        for step in range(steps):
            if step % 6 == 5:
                release(rng.choice(sorted(live)))
            while len(live) < self.NUM_REGIONS and ctrl.can_admit():
                admit()
            q = rng.choice([1, Q, Q] + list(range(2, Q)))
            reqs = sorted(live)
            rng.shuffle(reqs)
            drafts, draft_ids = {}, {}
            for r in reqs:
                n = len(live[r]["ids"])
                kept, live[r]["kept"] = live[r]["kept"], []
                locs = kept[:q] + [free_locs.pop() for _ in range(q - len(kept[:q]))]
                free_locs.extend(kept[q:])
                drafts[r], draft_ids[r] = locs, new_ids(q)
                req_to_token[r, n : n + q] = torch.tensor(locs, dtype=torch.int32)
                # The forward writes the drafts' KV into their window rows.
                rows = [ctrl.region_base(r) + C + (n + j) % W for j in range(q)]
                for layer in range(L):
                    gpu[layer][torch.tensor(rows, device=DEVICE)] = kv_dev[layer][
                        torch.tensor(draft_ids[r])
                    ]
            pad = rng.randint(0, 1)
            seq = [len(live[r]["ids"]) + q for r in reqs] + [1] * pad
            rpi = torch.tensor(reqs + [0] * pad, device=DEVICE)
            seq_t = torch.tensor(seq, device=DEVICE)
            num_real = torch.tensor([len(reqs)], dtype=torch.int32, device=DEVICE)
            r2t = req_to_token.to(DEVICE)
            ctrl.wait_backup()
            for layer in range(L):
                topk = torch.full(((len(reqs) + pad) * q, K), -1, dtype=torch.int64)
                for b, r in enumerate(reqs):
                    for j in range(q):
                        kv_len = seq[b] - q + j + 1
                        pick = rng.sample(range(kv_len), min(K, kv_len))
                        topk[b * q + j, : len(pick)] = torch.tensor(pick)
                page_table = ctrl.swap_one_layer(
                    layer,
                    topk.to(DEVICE),
                    rpi,
                    seq_t,
                    r2t,
                    num_real,
                    num_query_tokens=q,
                )
                pt = page_table.cpu().long()
                rows = gpu[layer].cpu()
                for b, r in enumerate(reqs):
                    n = len(live[r]["ids"])
                    ids = live[r]["ids"] + draft_ids[r]
                    for j in range(q):
                        for i in range(K):
                            p = int(topk[b * q + j, i])
                            if p < 0:
                                self.assertEqual(int(pt[b * q + j, i]), -1)
                                continue
                            got = rows[int(pt[b * q + j, i])]
                            self.assertTrue(
                                torch.equal(got, kv[layer, ids[p]]),
                                f"step {step} layer {layer} req {r} query {j} "
                                f"pos {p} (committed {n})",
                            )
                            checked["committed" if p < n else "draft"] += 1
                self.assertTrue(bool((pt[len(reqs) * q :] == -1).all()))
            # The last layer's hook: every draft back to its host slot.
            win = [
                ctrl.region_base(r) + C + (len(live[r]["ids"]) + j) % W
                for r in reqs
                for j in range(q)
            ]
            locs = [loc for r in reqs for loc in drafts[r]]
            ctrl.write_back_new_tokens(
                torch.tensor(win + [1 << 30], device=DEVICE),
                torch.tensor(locs + [-1], device=DEVICE),
                torch.tensor([len(locs)], dtype=torch.int32, device=DEVICE),
            )
            for r in reqs:
                a = rng.randint(1, q)
                live[r]["ids"] += draft_ids[r][:a]
                rejected = drafts[r][a:]
                checked["rejected"] += len(rejected)
                if rng.random() < 0.5:
                    live[r]["kept"] = rejected
                else:
                    free_locs.extend(rejected)
        ctrl.synchronize()
        # What is on the host is what later steps read: every committed token.
        for r, req in live.items():
            n = len(req["ids"])
            locs = req_to_token[r, :n].long()
            ids = torch.tensor(req["ids"])
            for layer in range(L):
                self.assertTrue(
                    torch.equal(host.kv_buffer[layer, locs], kv[layer, ids])
                )
        # A meaningful workload (20 steps: 300 committed, 30 draft entries
        # checked, 5 drafts rejected at least).
        self.assertGreater(checked["committed"], 15 * steps)
        self.assertGreater(checked["draft"], 1.5 * steps)
        self.assertGreater(checked["rejected"], steps / 4)
        self.assertGreater(ctrl.get_stats()["misses"], 0)

    def test_reference(self):
        # The torch swap and the torch copies (off CUDA; the kernels: below).
        with mock.patch.object(
            controller_module, "copy_kernels_interpreted", lambda: False
        ):
            self._run(use_triton=False, seed=1)

    @unittest.skipUnless(TRITON_OK, TRITON_SKIP)
    def test_triton(self):
        # The swap and copy kernels (interpreted on CPU: ~0.3 s a layer-step).
        self._run(use_triton=True, seed=2, steps=6)


if __name__ == "__main__":
    unittest.main()
