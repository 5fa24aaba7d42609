"""Front ends: the engine, vt.LLM, bench, the HTTP server and the CLI."""
