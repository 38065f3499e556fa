"""kvstore master."""
