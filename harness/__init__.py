"""What the tests and the benchmarks share: real clips, a mesh of two replicas per stage and its faults, the fuzz of
every door and the checks after it, and a real browser on the gateway's page. Neither tests/ nor bench/ imports the
other; both import this."""
