"""The coordinator: GenerationService front door, replica pools and routing (Ray actors), request pipelines.

Layout: `config` (settings), `discovery` (static/file/DNS pool sources), `pool` (membership, health, least-loaded
routing), `clients` (gRPC draft/target backends with pinning and failover), `pipeline` (one request through
`specdec.schedule`), `actor` (Ray hosts), `router` (driver → pipelines), `service` (GenerationService),
`server` (assembly), `stack` (the embedded one-machine stack of the CLI).
"""
