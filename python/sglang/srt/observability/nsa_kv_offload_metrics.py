"""Prometheus metrics and the decode log line of the decode NSA KV offload.

Fed where the offload reads its device counters for the decode log line (one
host sync per log interval) and when the scheduler idles: counters add each
interval, gauges hold the last state.
"""

from typing import Dict, Optional

_PREFIX = "sglang:nsa_kv_offload_"

# Counters: stats key (also the attribute; metric <key>_total) -> help.
_COUNTERS = {
    "lru_hits": "Top-k lookups found in LRU rows.",
    "window_hits": "Top-k lookups found in the recent-window rows.",
    "misses": "Top-k lookups copied from host memory.",
    "units_moved": "Extra LRU units moved from the largest holders to the smallest.",
    "units_reclaimed": "Extra LRU units taken back by their lenders (admissions, "
    "prefill staging, token locs).",
    "units_kept": "Of those, units below the request's newest whose rows a GPU copy "
    "kept (the newest unit's slots dropped instead).",
    "warmed_requests": "Admitted requests whose GPU rows were warmed.",
    "warmed_bytes": "Bytes the admissions' warm-ups copied into GPU rows (from host "
    "memory or prefill staging).",
    "h2d_bytes": "Bytes copied host to device.",
    "verify_checked_rows": "KV rows read by attention that the verify mode compared "
    "with the full pool.",
    "verify_mismatches": "Of those, rows that differed (or were skipped or read by "
    "mistake).",
    "d2h_bytes": "Bytes copied device to host.",
}
# Gauges: metric name (also the attribute) -> "stats key: help".
_GAUGES = {
    "host_pool_used_tokens": "host_used_tokens: Tokens whose KV the host pool holds.",
    "host_pool_total_tokens": "host_total_tokens: Tokens the host pool can hold.",
    "decode_regions_used": "regions_used: Decode regions held by running requests.",
    "decode_regions_total": "regions_total: Decode regions of the GPU pool.",
    "extra_units_used": "extra_units: Extra LRU units lent to running requests (idle "
    "regions, idle locs and staging).",
    "idle_loc_units_used": "idle_loc_units_lent: Of those, units lent by the indexer "
    "keys of free token locs.",
    "direct_requests": "direct_requests: Running requests swapping in direct mode "
    "(slot = position, no LRU walk).",
    "staging_rows_used": "staging_used_rows: Prefill staging rows held (by prompts or "
    "lent as units).",
    "staging_rows_total": "staging_total_rows: Prefill staging rows of the GPU pool.",
}


class NSAKVOffloadMetricsCollector:
    """The offload's counters and gauges, labelled like the scheduler's."""

    def __init__(self, labels: Dict[str, str], registry: Optional[object] = None):
        # Imported here, after sglang set PROMETHEUS_MULTIPROC_DIR.
        from prometheus_client import REGISTRY, Counter, Gauge

        self.labels = labels
        registry = registry if registry is not None else REGISTRY
        for key, doc in _COUNTERS.items():
            metric = Counter(
                name=_PREFIX + key + "_total",
                documentation=doc,
                labelnames=labels.keys(),
                registry=registry,
            )
            setattr(self, key, metric)
        for name, text in _GAUGES.items():
            metric = Gauge(
                name=_PREFIX + name,
                documentation=text.split(": ", 1)[1],
                labelnames=labels.keys(),
                multiprocess_mode="mostrecent",
                registry=registry,
            )
            setattr(self, name, metric)

    def observe(self, stats: Dict[str, float]) -> None:
        """Add one log interval's counts (``get_stats``) and set the gauges."""
        for key in _COUNTERS:
            if stats.get(key):
                getattr(self, key).labels(**self.labels).inc(stats[key])
        for name, text in _GAUGES.items():
            key = text.split(": ", 1)[0]
            if key in stats:
                getattr(self, name).labels(**self.labels).set(stats[key])


def decode_log_suffix(stats: Dict[str, float], interval_s: float) -> str:
    """``, nsa-offload hit rate: ...`` for the scheduler's decode log line, from
    one interval's stats (``NSAKVOffloadCoordinator.get_stats``)."""
    s = stats
    lookups = s["lru_hits"] + s["window_hits"] + s["misses"]
    hit_rate = (lookups - s["misses"]) / max(lookups, 1)
    parts = [
        f"nsa-offload hit rate: {hit_rate:.3f}",
        f"misses: {s['misses']}",
        f"H2D: {s['h2d_bytes'] / max(interval_s, 1e-9) / 1e9:.2f} GB/s",
        f"regions: {s['regions_used']}/{s['regions_total']}",
    ]
    if s["max_units"] > 1:
        parts.append(
            f"extra units: {s['extra_units']} ({s['extra_units_lent']} of staging, "
            f"{s['units_moved']} moved, {s['idle_loc_units_lent']} of idle locs)"
        )
        parts.append(f"units per request: {s['fewest_units']}-{s['most_units']}")
        if s["units_reclaimed"]:
            parts.append(
                f"units reclaimed: {s['units_reclaimed']} "
                f"({s['units_kept']} kept by a copy)"
            )
    parts.append(f"direct: {s['direct_requests']}")
    if s["warmed_requests"]:
        parts.append(
            f"warmed: {s['warmed_requests']} ({s['warmed_bytes'] / 1e9:.2f} GB)"
        )
    if "verify_checked_total" in s:
        parts.append(
            f"verify: {s['verify_checked_total']} rows checked, "
            f"{s['verify_mismatches_total']} mismatches"
        )
    return ", " + ", ".join(parts)
