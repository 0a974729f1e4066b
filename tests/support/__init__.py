"""The test harness: helpers shared by the test tiers (what benchmarks share with them is mshpc.bench)."""
