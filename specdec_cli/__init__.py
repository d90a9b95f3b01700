"""The `specdec` command: generate, serve the embedded stack, batch, bench, and the offline pipelines.

The top layer: it may import every other package of the project.
"""
