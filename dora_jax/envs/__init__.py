"""Multi-turn environments and the tools they call."""
