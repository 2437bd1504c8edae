"""The kvroute router: HTTP proxy, routing policies, admin API, config and CLI."""
