"""Helpers shared by the benchmark scripts in benchmarks/ (which run with benchmarks/ on sys.path).

`common` holds what every script uses (result folder, shared flags, provenance, a local swarm run to the end);
the other modules belong to one benchmark each: `exchange_*`, `quality_*` and `simulation*`.
"""
