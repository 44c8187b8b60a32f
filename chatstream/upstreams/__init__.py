"""The upstreams: their clients, the UPSTREAMS pool and its health, and failover between them."""
