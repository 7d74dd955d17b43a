"""Serving under load (DESIGN §6, issue 15): load generators, the load-level protocol, its summary.

``runner.run_serving`` is the entry point (``serve.enabled=true``). Kept free of imports so that
``bench.load.summary`` stays a leaf the report can read.
"""
