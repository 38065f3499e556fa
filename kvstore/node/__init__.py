"""kvstore node."""
