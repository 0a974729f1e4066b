"""The test harness: helpers shared by the test tiers (and, for netns, the benchmarks)."""
