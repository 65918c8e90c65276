"""Storage tiers: the host-memory tier and directory tiers (local NVMe, shared file systems)."""
