"""Input generators shared by tests, self-checks and benchmarks (realistic data, not noise)."""
