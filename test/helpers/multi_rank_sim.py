"""Attention-TP ranks of the decode NSA KV offload as CPU processes (test helper).

``run_ranks`` spawns ``world`` processes joined by a gloo process group; each
builds the real pools and ``NSAKVOffloadCoordinator`` of one attention-TP rank
(``offload_harness.OffloadHarness``) around the one host pool they
share (``nsa_kv_offload_shared_host``) and plays the same schedule with the
same seed, as TP ranks do: the same requests, token locs and top-k, and the
same KV bytes (the latent is replicated). Rank 0 writes the host pool; the
others only read it. On a GPU host each rank takes a GPU (round robin) and
page-locks its mapping, so the same test checks ``cudaHostRegister`` of one
shared mapping in several processes.

Every forward of an attention-TP group starts with a collective of the group
(the embedding's all-reduce), which orders rank 0's host writes of earlier
forwards before any rank's reads: ``TPRankHarness.forward_barrier`` stands for
it. A reader checks host rows only after such a barrier (it may not read a row
rank 0 writes in the same forward), and every reader's page tables must read
exactly the KV the test wrote, misses included, i.e. the rows rank 0 wrote.

Each scenario returns a short result per rank (``"ok ..."`` or the failure)
to the parent through a queue. On CPU the ranks take the torch paths of the
swap, the copies and the KV rows (``mtp_verify_sim.cpu_torch_paths``; the
kernels have their own tests, the GPU runs them here).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import traceback
import unittest
from types import SimpleNamespace

# The shims of conftest.py, before sglang is imported (spawned processes do
# not run conftest.py; TRITON_INTERPRET=1 comes through the environment).
import cpu_shims

cpu_shims.install_all()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

PAGE = 64


class GlooGroup:
    """The part of sglang's ``GroupCoordinator`` (the attention-TP group) the
    shared host pool uses, over the default gloo process group."""

    def __init__(self):
        self.rank_in_group = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_gather_object(self, obj):
        objs = [None] * self.world_size
        dist.all_gather_object(objs, obj)
        return objs

    def barrier(self):
        dist.barrier()


def make_tp_harness(group, **kwargs):
    from offload_harness import OffloadHarness, sync

    class TPRankHarness(OffloadHarness):
        """One attention-TP rank: the harness around a shared host pool (its
        options: direct slots on, warm units off)."""

        def __init__(self, test, **kw):
            self.group = group
            self.rank = group.rank_in_group
            self._pending_host_checks = []
            super().__init__(test, host_pool_group=group, **kw)

        def check_host(self, locs):
            # Rank 0 reads what it wrote itself; a reader only after the next
            # forward's collective.
            if self.rank == 0:
                super().check_host(locs)
            else:
                self._pending_host_checks.append(locs.clone())

        def forward_barrier(self):
            # On a GPU host the collective orders GPU work: finish this rank's
            # first (a CPU barrier alone would not wait for its kernels).
            sync()
            self.group.barrier()
            pending, self._pending_host_checks = self._pending_host_checks, []
            for locs in pending:
                OffloadHarness.check_host(self, locs)
            # The readers' checks above read host rows rank 0 may rewrite in
            # this forward (a new prompt's backup into freed locs): rank 0
            # writes only once every reader has checked. Test-only; the
            # ranks' own reads all happen inside forwards.
            self.group.barrier()

    h = TPRankHarness(unittest.TestCase(), **kwargs)
    assert h.options.shares_host_pool and h.options.direct_slots
    assert not h.options.warm_units
    return h


def _host_digest(h) -> str:
    return hashlib.sha256(
        h.controller.host_pool.kv_buffer.numpy().tobytes()
    ).hexdigest()[:16]


# ---------------------------------------------------------------- scenarios


def scenario_segment(group):
    """Rank 0 writes a pattern into the shared segment; every rank reads it."""
    from sglang.srt.mem_cache.nsa_kv_offload_shared_host import (
        SharedHostLayout,
        open_shared_host_segment,
    )

    layout = SharedHostLayout(layer_num=3, num_rows=5 * PAGE, row_bytes=656)
    segment = open_shared_host_segment(layout, group)
    rows = segment.tensor()
    if group.rank_in_group == 0:
        gen = torch.Generator().manual_seed(7)
        rows.copy_(
            torch.randint(0, 256, layout.shape, dtype=torch.uint8, generator=gen)
        )
    group.barrier()
    digest = hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]
    return f"ok {digest} {rows.data_ptr()}"


def scenario_layout_mismatch(group):
    """The last rank holds another layout: every rank raises, none hangs."""
    from sglang.srt.mem_cache.nsa_kv_offload_shared_host import (
        SharedHostLayout,
        open_shared_host_segment,
    )

    rows = 6 * PAGE if group.rank_in_group == group.world_size - 1 else 5 * PAGE
    try:
        open_shared_host_segment(SharedHostLayout(3, rows, 656), group)
    except RuntimeError as e:
        return f"raised {e}"
    return "ok (no error)"


def scenario_lifecycle(group, max_units=1):
    """Chunked prefill, admission, decode with misses, finish, slot reuse.
    Direct slots: B (130 tokens) fits one unit's 128 slots below its first
    window and swaps in direct mode (warmed from its staging rows into slots
    0..n-1), A (160) does not."""
    h = make_tp_harness(group, max_units=max_units, lend_staging_pages=0)
    a, b = h.new_req(), h.new_req()
    h.forward_barrier()
    h.prefill([(a, 100)], chunked_req=a)
    h.forward_barrier()
    h.prefill([(a, 60), (b, 130)])
    direct = []
    for _ in range(8):
        h.forward_barrier()
        h.decode_step([a, b], pad_rows=1)
        if not direct:
            direct = [int(h.controller.lru.direct[r.req_pool_idx]) for r in (a, b)]
    h.finish(a)
    c = h.new_req()
    # C's locs reuse A's: rank 0's backup rewrites host rows the readers read
    # for A until its last forward.
    h.forward_barrier()
    h.prefill([(c, 200)])
    # From its 9th step on, B picks the token that just left its W = 8
    # window: a decoded token, written back by rank 0 W steps earlier.
    for _ in range(4):
        h.forward_barrier()
        h.decode_step([b, c])
    h.finish(b)
    h.finish(c)
    h.forward_barrier()
    h.check_no_leaks()
    counters = [int(x) for x in h.controller.counters.tolist()]
    h2d_rows, _, d2h_rows, _ = counters
    return (
        f"ok h2d_rows={h2d_rows} d2h_rows={d2h_rows} host={_host_digest(h)} "
        f"direct={''.join(map(str, direct))}"
    )


def scenario_naive_warm(group):
    """Negative control: the readers warm a new request from host memory at
    admission (instead of their staging rows) before rank 0 has backed it up.
    Their first decode step must read wrong KV."""
    from offload_harness import sync

    h = make_tp_harness(group)
    a = h.new_req()
    h.forward_barrier()
    h.prefill([(a, 150)], admit=False)
    batch = SimpleNamespace(reqs=[a])
    if h.rank != 0:
        # Warm from host slots, as a rank with a host pool of its own does.
        h.co.options = dataclasses.replace(h.co.options, shares_host_pool=False)
        h.co.admit_prefilled_batch(batch, None)
    sync()  # the readers' warm is done before rank 0 writes
    group.barrier()
    if h.rank == 0:
        h.co.admit_prefilled_batch(batch, None)
    h.forward_barrier()
    h.decode_step([a], first_step_of=(a,))
    return "ok"


SCENARIOS = {
    "segment": scenario_segment,
    "layout_mismatch": scenario_layout_mismatch,
    "lifecycle": scenario_lifecycle,
    "lifecycle_units": lambda group: scenario_lifecycle(group, max_units=2),
    "naive_warm": scenario_naive_warm,
}


def _rank_main(rank, world, init_file, names, queue):
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        # One GPU per rank where there are enough (each pins its mapping).
        torch.cuda.set_device(rank % torch.cuda.device_count())
    import offload_harness
    from mtp_verify_sim import cpu_torch_paths

    cpu_shims.stamp_one_gpu_layout()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    offload_harness.setUpModule()
    for patch in cpu_torch_paths():
        patch.start()
    group = GlooGroup()
    for name in names:
        try:
            result = SCENARIOS[name](group)
        except Exception as e:  # reported to the parent
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            result = f"failed {last}"
        queue.put((name, rank, result))
        if result.startswith("failed"):
            # The other ranks may be waiting in a collective of this
            # scenario: leave, so that theirs fail at once instead of
            # pairing with the wrong collectives (or hanging).
            break
        try:
            # Every rank leaves a scenario before the next one starts.
            group.barrier()
        except Exception:
            break  # a rank left after its failure
    queue.close()
    queue.join_thread()
    # Not destroy_process_group(): with a rank gone it may wait for it.
    os._exit(0)


def run_ranks(world, names, tmp_dir, timeout=900.0):
    """``{(scenario, rank): result}`` of ``world`` spawned ranks; a result
    no rank sent (it left after a failure, or timed out) reads "no result"."""
    import multiprocessing as mp
    import queue as queue_module
    import time

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(tmp_dir, "gloo_init")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, init_file, names, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world * len(names) and time.monotonic() < deadline:
            try:
                name, rank, result = queue.get(timeout=1.0)
            except queue_module.Empty:
                if any(p.is_alive() for p in procs):
                    continue
                # Every rank has left: what they sent is in the pipe.
                try:
                    while True:
                        name, rank, result = queue.get(timeout=1.0)
                        results[(name, rank)] = result
                except queue_module.Empty:
                    break
            results[(name, rank)] = result
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for name in names:
        for rank in range(world):
            results.setdefault((name, rank), "no result (the rank left or hung)")
    return results
