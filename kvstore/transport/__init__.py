"""kvstore transport."""
