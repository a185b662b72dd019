"""Models shardplan plans in its tests, benchmarks and demo."""
