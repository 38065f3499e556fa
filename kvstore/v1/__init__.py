"""Generated control-plane stubs (``scripts/gen_proto.py``); do not edit."""
