"""The backend protocol: handles, the core Backend, capability mixins, the op table."""
