"""What benchmarks/ and tests/ share, and nothing that trains imports: the benchmark harness
(`harness`: rounds, paired runs with their interval, the JSON record, local ranks), two ranks on
an emulated link (`links`), the namespace fabric that link runs on (`netns`) and /proc look-ups
(`processes`). A benchmark imports it as `from mshpc.bench import harness`, never by a path."""
