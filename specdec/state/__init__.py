"""What a replica keeps per session: the session table and its limits, the KV slots, the prefix cache, and a feature
draft's per-position inputs."""
