"""Replica pools and routing: where members come from, their health and load, which replica a request is pinned to, and preemption by priority.
"""
