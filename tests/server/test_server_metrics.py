"""The /metrics gauges follow the engine's stats; its running totals become Prometheus counters."""

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from kiln.runtime.engine import EngineStats
from kiln.server.metrics import ServerMetrics


def test_engine_stats_reach_the_gauges():
    m = ServerMetrics("tiny")
    st = EngineStats(num_steps=3, num_preemptions=1, prefix_cache_queries=6, prefix_cache_hits=4,
                     prefix_cache_evictions=0, num_shared_blocks=0, num_free_blocks=5, num_blocks=9, kv_waste_slots=0,
                     num_running=2, num_waiting=1, num_batched_tokens=10, num_generated_tokens=7, spec_proposed=8,
                     spec_accepted=6, spec_rows=2, spec_emitted=8)
    m.engine_stats(st)
    got = {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert got["kiln_kv_blocks_used"] == 4 and got["kiln_num_requests_running"] == 2
    assert got["kiln_spec_draft_tokens_proposed_total"] == 8 and got["kiln_spec_draft_tokens_accepted_total"] == 6
    assert got["kiln_spec_mean_accepted_length"] == 4.0 and got["kiln_num_preemptions_total"] == 1
    assert got["kiln_prefix_cache_queries_total"] == 6 and got["kiln_prefix_cache_hits_total"] == 4
    # Later stats carry larger totals: each counter grows by the difference, never double counting.
    later = dataclasses.replace(st, num_preemptions=3, spec_proposed=12, spec_accepted=7, prefix_cache_queries=9)
    m.engine_stats(later)
    m.engine_stats(later)
    types = {f.name: f.type for f in text_string_to_metric_families(m.render().decode())}
    got = {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert got["kiln_num_preemptions_total"] == 3 and got["kiln_spec_draft_tokens_proposed_total"] == 12
    assert got["kiln_spec_draft_tokens_accepted_total"] == 7 and got["kiln_prefix_cache_queries_total"] == 9
    assert types["kiln_num_preemptions"] == types["kiln_spec_draft_tokens_proposed"] == "counter"
    assert types["kiln_prefix_cache_queries"] == types["kiln_prefix_cache_hits"] == "counter"
