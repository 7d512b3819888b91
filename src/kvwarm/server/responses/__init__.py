"""The OpenAI Responses API: its request body, routes, stored responses and translation to the
shared chat path."""
