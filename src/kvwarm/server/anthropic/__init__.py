"""The Anthropic Messages API: its request bodies, routes and translation to the shared chat
path."""
