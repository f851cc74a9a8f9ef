"""Prometheus collector of the decode NSA KV offload (CPU).

Every counter adds what one decode log interval reports and every gauge holds
the last value, under the scheduler's labels and sglang's metric prefix.
"""

import unittest

from prometheus_client import CollectorRegistry, generate_latest
from sglang.srt.observability.nsa_kv_offload_metrics import (
    NSAKVOffloadMetricsCollector,
)

LABELS = {"model_name": "m", "tp_rank": "0"}


def interval(**over):
    stats = dict(
        lru_hits=10,
        window_hits=3,
        misses=5,
        h2d_bytes=5 * 656,
        d2h_bytes=656,
        warmed_requests=1,
        warmed_bytes=40 * 3 * 656,
        units_moved=1,
        units_reclaimed=3,
        units_kept=1,
        host_used_tokens=128,
        host_total_tokens=1024,
        regions_used=1,
        regions_total=4,
        extra_units=2,
        direct_requests=1,
        idle_loc_units_lent=1,
        staging_used_rows=64,
        staging_total_rows=640,
        verify_checked_rows=8,
        verify_mismatches=0,
    )
    stats.update(over)
    return stats


class TestNSAKVOffloadMetrics(unittest.TestCase):
    def setUp(self):
        self.registry = CollectorRegistry()
        self.metrics = NSAKVOffloadMetricsCollector(LABELS, self.registry)

    def value(self, name):
        return self.registry.get_sample_value("sglang:nsa_kv_offload_" + name, LABELS)

    def test_counters_add_gauges_set(self):
        self.metrics.observe(interval())
        self.metrics.observe(
            interval(
                misses=7, host_used_tokens=256, regions_used=3, verify_mismatches=1
            )
        )
        self.assertEqual(self.value("lru_hits_total"), 20)
        self.assertEqual(self.value("window_hits_total"), 6)
        self.assertEqual(self.value("misses_total"), 12)
        self.assertEqual(self.value("h2d_bytes_total"), 2 * 5 * 656)
        self.assertEqual(self.value("d2h_bytes_total"), 2 * 656)
        self.assertEqual(self.value("warmed_requests_total"), 2)
        self.assertEqual(self.value("warmed_bytes_total"), 2 * 40 * 3 * 656)
        self.assertEqual(self.value("units_moved_total"), 2)
        self.assertEqual(self.value("units_reclaimed_total"), 6)
        self.assertEqual(self.value("units_kept_total"), 2)
        self.assertEqual(self.value("host_pool_used_tokens"), 256)
        self.assertEqual(self.value("host_pool_total_tokens"), 1024)
        self.assertEqual(self.value("decode_regions_used"), 3)
        self.assertEqual(self.value("decode_regions_total"), 4)
        self.assertEqual(self.value("extra_units_used"), 2)
        self.assertEqual(self.value("idle_loc_units_used"), 1)
        self.assertEqual(self.value("direct_requests"), 1)
        self.assertEqual(self.value("staging_rows_used"), 64)
        self.assertEqual(self.value("staging_rows_total"), 640)
        # The verify mode's (--nsa-kv-offload-verify).
        self.assertEqual(self.value("verify_checked_rows_total"), 16)
        self.assertEqual(self.value("verify_mismatches_total"), 1)

    def test_exposition(self):
        self.metrics.observe(interval())
        text = generate_latest(self.registry).decode()
        self.assertIn(
            'sglang:nsa_kv_offload_misses_total{model_name="m",tp_rank="0"} 5.0', text
        )
        self.assertIn("# TYPE sglang:nsa_kv_offload_host_pool_used_tokens gauge", text)

    def test_empty_interval_adds_nothing(self):
        self.metrics.observe(interval())
        self.metrics.observe(
            interval(
                lru_hits=0,
                window_hits=0,
                misses=0,
                h2d_bytes=0,
                d2h_bytes=0,
            )
        )
        self.assertEqual(self.value("misses_total"), 5)


if __name__ == "__main__":
    unittest.main()
