"""The instance process: step loop, I/O thread, spec and entry point."""
