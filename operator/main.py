"""kvstrata operator."""
