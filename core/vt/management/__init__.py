"""Backend management: hookspecs, rules, the registry, probes, audit, trust."""
