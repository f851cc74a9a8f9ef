"""Plain-Python model of the per-layer LRU swap of docs/ENGINE.md.

Lists and dicts only, written to be obviously correct rather than fast: the
differential tests hold ``LRUCacheState`` (torch reference and Triton kernel)
to it.

With ``max_units > 1`` a request's slots span up to that many units of
``buffer_size`` slots (unit 0 is its region): slot ``s`` lives at row
``units[r][s // C] + s % C``. Its LRU order lists the slots it holds (below
``len(units[r]) * C``): a grown unit's slots come first, a dropped unit's
slots leave it.

Direct mode (``enter_direct``): while a request's positions below the window
fit its slots, a miss of position ``p`` goes to slot ``p`` and its order is
left alone; the first swap past its slots ends it for good.
"""

from typing import Dict, List, Optional, Sequence, Tuple


class LRUModel:
    def __init__(
        self,
        num_layers: int,
        buffer_size: int,
        recent_window: int,
        max_units: int = 1,
        read_window: Optional[int] = None,
    ):
        self.L = num_layers
        self.C = buffer_size
        self.W = recent_window
        # Newest positions read from the window ring (rows base + C + p % W).
        self.WR = recent_window if read_window is None else read_window
        self.max_units = max_units
        self.num_slots = buffer_size * max_units
        # Per (layer, request pool index).
        self.slot_loc: Dict[Tuple[int, int], List[int]] = {}
        self.lru_order: Dict[Tuple[int, int], List[int]] = {}
        # Per layer: loc -> slot, resident locs only.
        self.loc_to_slot: List[Dict[int, int]] = [{} for _ in range(num_layers)]
        self.region_base: Dict[int, int] = {}
        # Per request: first GPU row of each unit it holds (unit 0 = region).
        self.units: Dict[int, List[int]] = {}
        # Per layer: [LRU hits, window hits, misses].
        self.counters = [[0, 0, 0] for _ in range(num_layers)]
        # Misses that evicted a resident loc (workload statistics only).
        self.evictions = 0
        # Requests in direct mode (slot = position); how many outgrew it.
        self.direct: set = set()
        self.direct_ended = 0

    def admit(self, r: int, base: int) -> None:
        self.region_base[r] = base
        self.units[r] = [base]
        for layer in range(self.L):
            self.slot_loc[layer, r] = [-1] * self.num_slots
            self.lru_order[layer, r] = list(range(self.C))

    def release(self, r: int) -> None:
        for layer in range(self.L):
            for loc in self.slot_loc.get((layer, r), []):
                if loc >= 0:
                    del self.loc_to_slot[layer][loc]
            self.slot_loc[layer, r] = [-1] * self.num_slots
            self.lru_order[layer, r] = []
        self.region_base.pop(r, None)
        self.units.pop(r, None)
        self.direct.discard(r)

    def enter_direct(self, r: int) -> None:
        self.direct.add(r)

    def warm_direct(
        self, layers: Sequence[int], r: int, locs, first_position: int = 0
    ) -> List[List[int]]:
        """Direct mode's warm-up of a request holding nothing: position p
        (``locs[p - first_position]``) into slot p of each layer, its order
        slot order, then direct mode (slots below ``first_position`` empty)."""
        end = first_position + len(locs)
        assert end <= len(self.units[r]) * self.C
        for layer in layers:
            self.lru_order[layer, r] = list(range(len(self.units[r]) * self.C))
            for p, loc in enumerate(locs, start=first_position):
                assert self.slot_loc[layer, r][p] == -1, "slot taken"
                assert loc not in self.loc_to_slot[layer], "loc resident"
                self.loc_to_slot[layer][loc] = p
                self.slot_loc[layer, r][p] = loc
        self.enter_direct(r)
        return [[self.row(r, p) for p in range(first_position, end)] for _ in layers]

    def grow(self, r: int, base: int) -> None:
        """Add a unit at ``base``; its (empty) slots go to the LRU end."""
        lo = len(self.units[r]) * self.C
        self.units[r].append(base)
        for layer in range(self.L):
            new = list(range(lo, lo + self.C))
            self.lru_order[layer, r] = new + self.lru_order[layer, r]

    def shrink(self, r: int) -> None:
        """Drop the last unit: the locs its slots hold stop being resident,
        its slots leave the order."""
        self.units[r].pop()
        lo = len(self.units[r]) * self.C
        for layer in range(self.L):
            order = self.lru_order[layer, r]
            self.lru_order[layer, r] = [s for s in order if s < lo]
            for s in range(lo, lo + self.C):
                loc = self.slot_loc[layer, r][s]
                if loc >= 0:
                    del self.loc_to_slot[layer][loc]
                    self.slot_loc[layer, r][s] = -1

    def _direct_slots(self, layer: int, r: int, locs, positions):
        """Direct mode's lookup: a miss of position p takes slot p."""
        resident = self.loc_to_slot[layer]
        slots, missed = [None] * len(locs), []
        for i, loc in enumerate(locs):
            if loc is None:
                continue
            if loc in resident:
                slots[i] = resident[loc]
            else:
                p = positions[i]
                assert self.slot_loc[layer, r][p] == -1, "direct slot taken"
                resident[loc] = p
                self.slot_loc[layer, r][p] = loc
                slots[i] = p
                missed.append(i)
        return slots, missed, [positions[i] for i in missed]

    def row(self, r: int, slot: int) -> int:
        return self.units[r][slot // self.C] + slot % self.C

    def _take_slots(self, layer: int, r: int, locs: Sequence[int]):
        """Look up ``locs`` (None = skip); misses take victims. Returns
        (slot per entry or None, hit slots, victims in order)."""
        resident = self.loc_to_slot[layer]
        order = self.lru_order[layer, r]
        slots = [None] * len(locs)
        hit_slots = set()
        missed = []
        for i, loc in enumerate(locs):
            if loc is None:
                continue
            if loc in resident:
                slots[i] = resident[loc]
                hit_slots.add(resident[loc])
            else:
                missed.append(i)
        assert len(order) == len(self.units[r]) * self.C
        evictable = [s for s in order if s not in hit_slots]
        assert len(missed) <= len(evictable)
        victims = evictable[: len(missed)]
        for i, victim in zip(missed, victims):
            old = self.slot_loc[layer, r][victim]
            if old >= 0:
                del resident[old]
                self.evictions += 1
            resident[locs[i]] = victim
            self.slot_loc[layer, r][victim] = locs[i]
            slots[i] = victim
        # Tie rule: [untaken evictables] + [victims] + [hits, in old order].
        kept = [s for s in order if s in hit_slots]
        self.lru_order[layer, r] = evictable[len(missed) :] + victims + kept
        return slots, missed, victims

    def swap(
        self,
        layer: int,
        topk: Sequence[Sequence[int]],
        req_pool_indices: Sequence[int],
        seq_lens: Sequence[int],
        req_to_token: Sequence[Sequence[int]],
        num_real: int,
    ):
        """One layer's swap. Returns per row (page-table row, [(src loc, dst row)])."""
        C, W, WR = self.C, self.W, self.WR
        out = []
        for b, row in enumerate(topk):
            if b >= num_real:
                out.append(([-1] * len(row), []))
                continue
            r, n = req_pool_indices[b], seq_lens[b]
            base = self.region_base[r]
            locs = [None] * len(row)
            page = [-1] * len(row)
            for i, p in enumerate(row):
                if p < 0 or p >= n:
                    continue
                if p >= n - WR:
                    page[i] = base + C + p % W
                    self.counters[layer][1] += 1
                else:
                    locs[i] = req_to_token[r][p]
            if r in self.direct and n - WR > len(self.units[r]) * C:
                self.direct.discard(r)
                self.direct_ended += 1
            if r in self.direct:
                slots, missed, victims = self._direct_slots(layer, r, locs, row)
            else:
                slots, missed, victims = self._take_slots(layer, r, locs)
            for i, s in enumerate(slots):
                if s is not None:
                    page[i] = self.row(r, s)
            self.counters[layer][0] += sum(s is not None for s in slots) - len(missed)
            self.counters[layer][2] += len(missed)
            copies = [(locs[i], self.row(r, v)) for i, v in zip(missed, victims)]
            out.append((page, copies))
        return out

    def warm(self, layers: Sequence[int], r: int, locs_per_layer) -> List[List[int]]:
        rows = []
        for layer, locs in zip(layers, locs_per_layer):
            locs = [loc if loc >= 0 else None for loc in locs]
            slots, _, _ = self._take_slots(layer, r, locs)
            rows.append([-1 if s is None else self.row(r, s) for s in slots])
        return rows

    def swap_multi(
        self,
        layer: int,
        topk: Sequence[Sequence[int]],
        req_pool_indices: Sequence[int],
        seq_lens: Sequence[int],
        req_to_token: Sequence[Sequence[int]],
        num_real: int,
        num_query_tokens: int,
    ):
        """One layer's swap with ``q = num_query_tokens`` query tokens per
        request (docs/MTP.md): ``topk`` has ``q`` rows per request, query token
        ``j`` at position ``seq_lens[b] - q + j`` sees the positions before it
        and itself. The request's looked-up locs, in order of first appearance
        (query token by query token, each in top-k order), go through one
        swap; every entry maps to its loc's slot. Only the newest ``WR``
        positions are read from the window ring.

        Returns (page-table rows, one per query token; copies per request)."""
        C, W, WR, q = self.C, self.W, self.WR, num_query_tokens
        pages, copies = [], []
        for b, r in enumerate(req_pool_indices):
            rows = topk[b * q : (b + 1) * q]
            if b >= num_real:
                pages += [[-1] * len(row) for row in rows]
                copies.append([])
                continue
            n = seq_lens[b]
            base = self.region_base[r]
            entries = []  # (query token, top-k index, loc)
            unique, seen = [], set()  # looked-up locs, first appearance first
            page_rows = [[-1] * len(row) for row in rows]
            for j, row in enumerate(rows):
                kv_len = n - q + j + 1
                for i, p in enumerate(row):
                    if p < 0 or p >= kv_len:
                        continue
                    if p >= n - WR:
                        page_rows[j][i] = base + C + p % W
                        self.counters[layer][1] += 1
                        continue
                    loc = req_to_token[r][p]
                    entries.append((j, i, loc))
                    if loc not in seen:
                        seen.add(loc)
                        unique.append(loc)
            slots, missed, victims = self._take_slots(layer, r, unique)
            slot_of = dict(zip(unique, slots))
            for j, i, loc in entries:
                page_rows[j][i] = self.row(r, slot_of[loc])
            self.counters[layer][0] += len(entries) - len(missed)
            self.counters[layer][2] += len(missed)
            pages += page_rows
            copies.append(
                [(unique[i], self.row(r, v)) for i, v in zip(missed, victims)]
            )
        return pages, copies
