"""Offline pipelines: distilling the draft (`distill`) and training its pre-verifier (`preverifier`).

They import the core (`specdec`) and the benchmark's prompt sets, never the services.
"""
