"""Process-group start-up, launching, stat synchronisation and optimizer sharding."""
