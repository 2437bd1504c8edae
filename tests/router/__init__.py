"""Router tests: pure policy/state units, proxy against real HTTP upstreams, end to end."""
