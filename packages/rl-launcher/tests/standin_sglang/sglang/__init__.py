"""A stand-in for SGLang in the launcher's tests (see launch_server.py): no model, no GPU."""
