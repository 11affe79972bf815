"""Small example models used by the demo, the benchmarks and the tests."""
